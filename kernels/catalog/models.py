"""Model catalog: transformer shapes from published Hugging Face configs, and a config.json parser."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kernels.yamlsrc import FieldReader, YamlDoc, load_yaml, parse_yaml

_WEIGHT_DTYPES = ("bf16", "fp8", "mxfp4_experts")
# the shape fields the performance model divides by (heads per KV head, head size, layers): 0 is a
# ZeroDivisionError wherever the model is first used
_AT_LEAST_ONE = frozenset({"num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                           "max_context"})
USER_CATALOG_ENV = "POLYMORPH_MODEL_CATALOG"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a decoder-only transformer (dense, MoE, or MLA+MoE like DeepSeek-V3)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int = 131072
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_layers: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    num_sliding_layers: int = 0
    tie_word_embeddings: bool = False
    weight_dtype: str = "bf16"
    published_params_b: float = 0.0
    published_active_params_b: float = 0.0
    source: str = ""
    aliases: tuple[str, ...] = ()
    # published draft checkpoints for speculative decoding: (algorithm, Hugging Face repo), e.g.
    # ("EAGLE3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"); `drafts_source` says where they are listed
    drafts: tuple[tuple[str, str], ...] = ()
    drafts_source: str = ""

    def draft_model(self, algorithm: str) -> str | None:
        """The published draft checkpoint for `algorithm` ("EAGLE3", "EAGLE"), if the catalog has one."""
        return dict(self.drafts).get(algorithm)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_layers if self.is_moe else 0

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.is_mla:
            qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_dim if self.q_lora_rank else h * self.num_heads * qk_dim
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + self.num_heads * self.v_head_dim * h
        q_dim = self.num_heads * self.head_dim
        return 2 * h * q_dim + 2 * h * self.num_kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def routed_expert_params(self) -> int:
        """All routed-expert parameters of the model (the part MoE routing reads sparsely)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def dense_params(self) -> int:
        """Parameters every token touches: attention, dense FFNs, shared experts, routers, lm_head
        (input embeddings are a lookup and are excluded, see `embedding_params`)."""
        h = self.hidden_size
        dense_ffn_layers = self.first_k_dense_layers if self.is_moe else self.num_layers
        ffn = dense_ffn_layers * 3 * h * self.intermediate_size
        moe_extra = self.num_moe_layers * (self.num_shared_experts * self.expert_params + h * self.num_experts)
        lm_head = self.vocab_size * h
        return self.num_layers * self.attention_params_per_layer + ffn + moe_extra + lm_head

    @property
    def embedding_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        return self.dense_params + self.routed_expert_params + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters a single token multiplies through (routed experts counted top-k only)."""
        routed = self.num_moe_layers * self.num_experts_per_tok * self.expert_params
        return self.dense_params + routed

    @property
    def kv_elements_per_token(self) -> int:
        """KV elements one token stores across all full-attention layers (MLA: compressed latent + rope key).
        Sliding-window layers are counted separately, see `num_sliding_layers`."""
        return self.num_full_attention_layers * self.kv_elements_per_token_per_layer

    @property
    def kv_elements_per_token_per_layer(self) -> int:
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def num_full_attention_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    @property
    def attention_flops_per_token_per_context(self) -> float:
        """FLOPs of QK^T and PV for one query token against one cached token, all layers (full attention)."""
        if self.is_mla:
            # Absorbed MLA: scores over the (latent + rope) width, values over the latent width.
            per_head = 2 * (self.kv_lora_rank + self.qk_rope_head_dim) + 2 * self.kv_lora_rank
        else:
            per_head = 4 * self.head_dim
        return float(self.num_layers * self.num_heads * per_head)


@functools.cache
def _catalog() -> dict[str, ModelSpec]:
    return _specs(parse_yaml(resources.files("kernels.catalog").joinpath("models.yaml").read_text(), "kernels/catalog/models.yaml").data)


def _specs(raw: Mapping[str, Mapping[str, Any]]) -> dict[str, ModelSpec]:  # YAML values are untyped
    known = {f.name for f in fields(ModelSpec)}
    specs: dict[str, ModelSpec] = {}
    for name, entry in raw.items():
        values = {key: value for key, value in entry.items() if key in known}
        values["aliases"] = tuple(entry.get("aliases", ()))
        values["drafts"] = tuple((str(k), str(v)) for k, v in (entry.get("drafts") or {}).items())
        specs[name] = ModelSpec(name=name, **values)
    return specs


def user_catalog_path() -> Path:
    """The user's own models (`polymorph kernels add-model`): $POLYMORPH_MODEL_CATALOG, else
    $XDG_CONFIG_HOME/polymorph/models.yaml (~/.config when unset)."""
    if os.environ.get(USER_CATALOG_ENV):
        return Path(os.environ[USER_CATALOG_ENV])
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "polymorph" / "models.yaml"


def _user_entries(path: Path) -> dict[str, dict[str, Any]]:
    """The user catalog's entries, each checked as ``_check_user_entry`` says: the file is the user's to
    edit, and a wrong field would otherwise surface as a TypeError wherever the model is first used."""
    if not path.is_file():
        return {}
    doc = load_yaml(path)  # a ConfigError (a ValueError) names the file and line, as every error below
    raw = doc.data or {}
    if not isinstance(raw, dict):
        raise doc.error((), "the user model catalog must be a mapping of model names to their fields")
    for name, entry in raw.items():
        _check_user_entry(doc, str(name), entry)
    return raw


def _check_user_entry(doc: YamlDoc, name: str, entry: object) -> None:
    """Every field one of ModelSpec's and of its type, and the transformer's shape given."""
    spec_fields = {f.name: f for f in fields(ModelSpec) if f.name != "name"}
    reader = FieldReader(doc, (name,), entry, set(spec_fields))
    for field in spec_fields.values():
        if field.name not in reader.data:
            if field.default is MISSING:
                raise reader.error(field.name, "required: the model's shape needs num_layers, hidden_size, num_heads, "
                                   "num_kv_heads, head_dim, intermediate_size and vocab_size")
        elif field.type in ("int", "float"):
            reader.number(field.name, 0, integer=field.type == "int", lo=1 if field.name in _AT_LEAST_ONE else 0)
        elif field.type == "bool":
            reader.flag(field.name, False)
        elif field.type == "str":
            reader.text(field.name, None)
        elif field.name == "aliases":
            reader.names(field.name, None)
        else:  # drafts: algorithm -> the draft's Hugging Face repo
            drafts = reader.data[field.name]
            if not isinstance(drafts, dict) or not all(isinstance(v, str) for v in drafts.values()):
                raise reader.error(field.name, "must be a mapping of algorithm -> draft repo")


def add_model(config_path: Path, name: str | None = None, catalog_path: Path | None = None) -> tuple[ModelSpec, Path]:
    """Parse a Hugging Face config.json (the parser `get_model` uses for a path) and add it to the user
    catalog under `name` (default: the config's folder name), replacing a user entry of that name.
    A built-in model's name is refused: the user catalog adds models, it does not change published ones."""
    if not config_path.is_file() and not (config_path / "config.json").is_file():
        raise ValueError(f"no config.json at {config_path}")
    parsed = get_model(config_path)
    spec = replace(parsed, name=name or parsed.name, source=f"Hugging Face config {config_path.resolve()} (polymorph kernels add-model)")
    if _normalise(spec.name) in _alias_to_name():
        raise ValueError(f"{spec.name!r} is a built-in model (or one of its aliases); pass --name to add it under another name")
    path = catalog_path or user_catalog_path()
    entries = _user_entries(path)
    defaults = {f.name: f.default for f in fields(ModelSpec)}
    entries[spec.name] = {k: v for k, v in asdict(spec).items()
                          if k not in ("name", "aliases", "drafts") and v != defaults.get(k)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(entries, sort_keys=False))
    return spec, path


def _normalise(name: str) -> str:
    text = re.sub(r"\(.*?\)", " ", name.lower())
    return re.sub(r"[^a-z0-9/]+", "", text)


@functools.cache
def _alias_to_name() -> dict[str, str]:
    table: dict[str, str] = {}
    for name, spec in _catalog().items():
        for alias in (name, *spec.aliases):
            table[_normalise(alias)] = name
            table[_normalise(alias.split("/")[-1])] = name
    return table


def list_models() -> tuple[str, ...]:
    """Canonical names of every catalogued model."""
    return tuple(_catalog())


def get_model(name_or_path: str | Path) -> ModelSpec:
    """A model by catalogue name, alias (HF repo id, calibration-CSV spelling) or a path to a
    Hugging Face config.json (or a directory holding one). Raises ValueError for unknown names."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        try:
            return model_from_hf_config(config, name=path.parent.name or path.stem)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    text = str(name_or_path)
    table = _alias_to_name()
    for key in (_normalise(text), _normalise(text.split("/")[-1])):
        if key in table:
            return _catalog()[table[key]]
    user = _specs(_user_entries(user_catalog_path()))
    if text in user:
        return user[text]
    raise ValueError(f"unknown model {text!r}; known models: {', '.join((*list_models(), *user))} "
                     f"(or pass a config.json path, or add one with `polymorph kernels add-model`)")


class _Missing(ValueError):
    """None of a required field's keys is set."""


def _first_int(config: Mapping[str, object], *keys: str, default: int | None = None, minimum: int = 0) -> int:
    """The first of `keys` that config sets, as an int of at least `minimum`; `default` when none is
    (_Missing when there is no default). A value that is not a whole number is a ValueError naming its key."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{key} must be a whole number, not {value!r}")
        if value < minimum:
            raise ValueError(f"{key} must be at least {minimum}, not {value!r}")
        return int(value)
    if default is None:
        raise _Missing(f"none of {keys} is set")
    return default


def model_from_hf_config(config: Mapping[str, object], name: str = "custom") -> ModelSpec:
    """Parse llama / qwen2-3 / qwen3-moe / mixtral / deepseek-v3 / gpt-oss style config.json keys.
    Raises ValueError naming the key: a shape field that is missing, not a whole number, or (for the
    fields every layer divides by) below 1."""
    if not isinstance(config, Mapping):
        raise ValueError("the config is not a JSON object")
    try:
        return _parse_hf_config(config, name)
    except _Missing as exc:
        raise ValueError("the config lacks hidden_size / num_hidden_layers / num_attention_heads") from exc


def _parse_hf_config(config: Mapping[str, object], name: str) -> ModelSpec:
    text = config.get("text_config")
    if isinstance(text, Mapping):
        config = {**config, **text}
    hidden = _first_int(config, "hidden_size", "d_model", minimum=1)
    num_layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers", minimum=1)
    num_heads = _first_int(config, "num_attention_heads", "n_head", minimum=1)
    num_experts = _first_int(config, "num_local_experts", "n_routed_experts", "num_experts", default=0)
    intermediate = _first_int(config, "intermediate_size", "ffn_dim", default=4 * hidden, minimum=1)
    sliding_window = _first_int(config, "sliding_window", default=0)
    layer_types = config.get("layer_types")
    num_sliding = sum(1 for kind in layer_types if kind == "sliding_attention") if isinstance(layer_types, list) else 0
    quant = config.get("quantization_config")
    quant_method = str(quant.get("quant_method", "")) if isinstance(quant, Mapping) else ""
    weight_dtype = {"fp8": "fp8", "mxfp4": "mxfp4_experts"}.get(quant_method, "bf16")
    return ModelSpec(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=_first_int(config, "num_key_value_heads", default=num_heads, minimum=1),
        head_dim=_first_int(config, "head_dim", default=max(1, hidden // num_heads), minimum=1),
        intermediate_size=intermediate,
        vocab_size=_first_int(config, "vocab_size", default=32000, minimum=1),
        max_context=_first_int(config, "max_position_embeddings", default=131072, minimum=1),
        num_experts=num_experts,
        num_experts_per_tok=_first_int(config, "num_experts_per_tok", "num_experts_per_token", "experts_per_token", default=0) if num_experts else 0,
        num_shared_experts=_first_int(config, "n_shared_experts", default=0),
        moe_intermediate_size=_first_int(config, "moe_intermediate_size", default=intermediate) if num_experts else 0,
        first_k_dense_layers=_first_int(config, "first_k_dense_replace", default=0),
        q_lora_rank=_first_int(config, "q_lora_rank", default=0),
        kv_lora_rank=_first_int(config, "kv_lora_rank", default=0),
        qk_rope_head_dim=_first_int(config, "qk_rope_head_dim", default=0),
        qk_nope_head_dim=_first_int(config, "qk_nope_head_dim", default=0),
        v_head_dim=_first_int(config, "v_head_dim", default=0),
        sliding_window=sliding_window if num_sliding else 0,
        num_sliding_layers=num_sliding,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        weight_dtype=weight_dtype,
    )
