"""The gateway's classifier: one OpenAI request body in, one :class:`Shape` out, on the hot path.

Everything that can fail (model files, tokenizer file, rules) fails in :meth:`RequestClassifier.load`
with a :class:`ClassifierLoadError`; :meth:`RequestClassifier.classify` never raises on a body the
gateway has validated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from classifiers.domain import DomainModel, ModelFileError, builtin_model_dir, load_domain_model, window_of_parts
from classifiers.output_predictor import DEFAULT_MAX_HISTORY_PER_KEY, OutputPredictor
from classifiers.prefix import prefix_fingerprint
from classifiers.shape import DOMAINS, Shape, ShapeRules, default_shape_rules
from classifiers.tokens import ExactTokenCounter, content_parts, count_chat_tokens, estimate_tokens


class ClassifierLoadError(Exception):
    """The classifier cannot start: the message says which file or setting and why."""


def _model_text(content: Any) -> str:
    """What the domain model reads of a message content (multi-part text is never joined whole)."""
    return content if isinstance(content, str) else window_of_parts(content_parts(content)[0])


def _chat_text(messages: list[Any]) -> str:
    """The text the domain model reads: the last user turn (what is asked now), else the last turn."""
    for message in reversed(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return _model_text(message.get("content"))
    if messages and isinstance(messages[-1], Mapping):
        return _model_text(messages[-1].get("content"))
    return ""


def _prompt_text(prompt: Any, count_text: Callable[[str], int]) -> tuple[str, int]:
    """(text the model reads, prompt tokens) of a validated completion ``prompt``: str, list of str, or ids.

    The gateway has checked the list's items, so the first one says which kind it is: a 32k-id
    prompt is not walked again.
    """
    if isinstance(prompt, str):
        return prompt, count_text(prompt)
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int):
            return "", len(prompt)
        if isinstance(prompt[0], list):  # a batch of token-id lists
            return "", sum(len(item) for item in prompt if isinstance(item, list))
        texts = [item for item in prompt if isinstance(item, str)]
        return window_of_parts(texts), sum(map(count_text, texts))
    return "", 0


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class RequestClassifier:
    """Features, domain, predicted output and shape of each request; learns from finished ones."""

    __slots__ = ("_count_text", "domain_model", "predictor", "rules", "tokenizer_path")

    def __init__(self, domain_model: DomainModel, rules: ShapeRules, predictor: OutputPredictor,
                 count_text: Callable[[str], int] = estimate_tokens, tokenizer_path: str | None = None) -> None:
        self.domain_model = domain_model
        self.rules = rules
        self.predictor = predictor
        self._count_text = count_text
        self.tokenizer_path = tokenizer_path

    @classmethod
    def load(cls, model: str = "builtin", tokenizer: str | None = None, rules: ShapeRules | None = None,
             max_history_per_key: int = DEFAULT_MAX_HISTORY_PER_KEY) -> RequestClassifier:
        """Load the domain model (``builtin`` or a directory) and optional ``tokenizer.json``."""
        model_dir = builtin_model_dir() if model == "builtin" else model
        try:
            domain_model = load_domain_model(model_dir)
        except ModelFileError as exc:
            raise ClassifierLoadError(f"classifier.model={model!r}: {exc}") from exc
        unknown = sorted(set(domain_model.classes) - set(DOMAINS))
        if unknown:
            raise ClassifierLoadError(f"classifier.model={model!r}: unknown domains {unknown}; expected {DOMAINS}")
        count_text: Callable[[str], int] = estimate_tokens
        if tokenizer is not None:
            try:
                count_text = ExactTokenCounter(tokenizer).count
            except (FileNotFoundError, ValueError) as exc:
                raise ClassifierLoadError(f"classifier.tokenizer={tokenizer!r}: {exc}") from exc
        try:
            predictor = OutputPredictor(max_history_per_key)
        except ValueError as exc:
            raise ClassifierLoadError(str(exc)) from exc
        return cls(domain_model, rules or default_shape_rules(), predictor, count_text, tokenizer)

    def classify(self, body: Mapping[str, Any], *, chat: bool, tenant: str, tier: str) -> Shape:
        """Classify one parsed OpenAI chat (``chat=True``) or completion request body."""
        num_messages = 0
        prefix_fp = 0
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list):
                messages = []
            num_messages = len(messages)
            prefix_fp = prefix_fingerprint(messages)
            prompt_tokens = count_chat_tokens(messages, self._count_text)
            text = _chat_text(messages)
        else:
            text, prompt_tokens = _prompt_text(body.get("prompt"), self._count_text)
        tools = body.get("tools") or body.get("functions")
        if tools:
            prompt_tokens += self._count_text(repr(tools))  # tool schemas are part of the prompt
        domain, confidence = self.domain_model.predict(text)  # reads a bounded head and tail only
        max_tokens = _max_tokens(body)
        p50, p90 = self.predictor.predict(tenant, domain, prompt_tokens, max_tokens)
        response_format = body.get("response_format")
        return Shape(
            name=self.rules.select(tier, domain, tenant, prompt_tokens, p50),  # rules read the median
            domain=domain,
            domain_confidence=confidence,
            prompt_tokens=prompt_tokens,
            predicted_output_p50=p50,
            predicted_output_p90=p90,
            tier=tier,
            tenant=tenant,
            prefix_fp=prefix_fp,
            max_tokens=max_tokens,
            stream=body.get("stream") is True,
            num_messages=num_messages,
            has_tools=bool(tools),
            json_mode=isinstance(response_format, Mapping)
            and response_format.get("type") in ("json_object", "json_schema"),
        )

    def with_rules(self, rules: ShapeRules) -> RequestClassifier:
        """The same model and learned history under new shape rules (a config reload)."""
        return RequestClassifier(self.domain_model, rules, self.predictor, self._count_text, self.tokenizer_path)

    def observe(self, shape: Shape, completion_tokens: int) -> None:
        """Learn from a finished response's ``usage.completion_tokens``."""
        self.predictor.observe(shape.tenant, shape.domain, completion_tokens)
