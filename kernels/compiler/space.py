"""The search space: which EngineConfig knobs the compiler may turn, to which values, and sglang's
structural constraints on them.

Each knob is an ordered tuple of choices (None means "sglang's auto value", resolved as
`PerfModel.config` resolves it), so a proposer can step to a neighbouring value. Lossy knobs
(fp8 weights) are only in the space when the caller allows them: the compiler must not trade
model quality for speed behind the operator's back. An fp8 KV cache is in by default (sglang's
documented near-lossless option on Hopper and newer); `lossless_only` removes it too. Speculative
decoding with a draft model is in when the catalog names a published draft for the model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from kernels.catalog import GpuSpec, ModelSpec
from kernels.config import EngineConfig
from kernels.perf import PerfModel

KNOBS = (
    "tp", "max_running_requests", "chunked_prefill_size", "max_prefill_tokens", "schedule_policy", "kv_cache_dtype",
    "quantization", "cuda_graph_max_bs", "mem_fraction_static", "enable_prefix_caching", "speculative",
)
# Speculative decoding is one knob: (algorithm, steps, draft tokens) moves together.
SpecChoice = tuple[str, int, int] | None


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Ordered choices per knob. `engine_default` is where every search starts: sglang's defaults."""

    tp: tuple[int, ...]
    max_running_requests: tuple[int | None, ...] = (None, 16, 32, 64, 128, 256, 512, 1024)
    chunked_prefill_size: tuple[int | None, ...] = (None, 1024, 2048, 4096, 8192, 16384)
    max_prefill_tokens: tuple[int, ...] = (8192, 16384, 32768)
    schedule_policy: tuple[str, ...] = ("fcfs", "lpm")
    kv_cache_dtype: tuple[str, ...] = ("auto", "fp8_e4m3")
    quantization: tuple[str | None, ...] = (None,)
    cuda_graph_max_bs: tuple[int | None, ...] = (None, 32, 64, 128, 256, 512)
    mem_fraction_static: tuple[float | None, ...] = (None, 0.8, 0.85, 0.9, 0.93)
    enable_prefix_caching: tuple[bool, ...] = (True, False)
    speculative: tuple[SpecChoice, ...] = (None, ("NGRAM", 3, 4))

    def choices(self, knob: str) -> tuple[object, ...]:
        return getattr(self, knob)  # type: ignore[no-any-return]

    def to_dict(self) -> dict[str, list[object]]:
        return {f.name: list(getattr(self, f.name)) for f in fields(self)}


def default_space(
    model: ModelSpec,
    gpu: GpuSpec,
    num_gpus: int,
    allow_fp8_weights: bool = False,
    lossless_only: bool = False,
    draft_models: tuple[str, ...] = (),
    published_drafts: bool = True,
) -> SearchSpace:
    """The space for `model` on `num_gpus` x `gpu`. Speculative decoding is lossless (the target model
    verifies every token): n-gram needs no weights; draft-model algorithms enter when the catalog
    lists a published draft checkpoint for the model (`published_drafts`, `ModelSpec.drafts`) or the
    operator names them in `draft_models` ("EAGLE3", "EAGLE", "MTP") because they provide the weights."""
    if num_gpus < 1:
        raise ValueError(f"the space needs at least one GPU, got {num_gpus}")
    tps = tuple(tp for tp in (1, 2, 4, 8, 16) if tp <= num_gpus and num_gpus % tp == 0)
    has_fp8 = gpu.fp8_tflops is not None
    kv = ("auto",) if lossless_only or not has_fp8 else ("auto", "fp8_e4m3")
    quant: tuple[str | None, ...] = (None, "fp8") if allow_fp8_weights and has_fp8 and model.weight_dtype == "bf16" and not lossless_only else (None,)
    spec: list[SpecChoice] = [None, ("NGRAM", 3, 4)]
    published = tuple(algorithm for algorithm, _ in model.drafts) if published_drafts else ()
    for algorithm in dict.fromkeys((*published, *draft_models)):
        spec += [(algorithm, steps, steps + 1) for steps in range(1, 6)]  # chains of 1 to 5 draft steps (top-k 1)
    space = SearchSpace(tp=tps, kv_cache_dtype=kv, quantization=quant, speculative=tuple(spec))
    resolved = PerfModel(model, gpu, EngineConfig(tp=tps[-1])).config
    ordered = {knob: _place_auto(space.choices(knob), getattr(resolved, knob)) for knob in _AUTO_KNOBS}
    return replace(space, **ordered)  # type: ignore[arg-type]  # knobs set by name: each keeps its own choices' type


_AUTO_KNOBS = ("max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs", "mem_fraction_static")


def _place_auto(choices: tuple[object, ...], resolved: object) -> tuple[object, ...]:
    """Put None ("auto") where its resolved value sorts, so a one-step move from the default is a
    small change; an explicit choice equal to the resolved value would be a duplicate and is dropped."""
    values = sorted(v for v in choices if v is not None and v != resolved)  # type: ignore[type-var]
    below = [v for v in values if v < resolved]  # type: ignore[operator]
    return (*below, None, *values[len(below):])


def engine_default(num_gpus: int, tp: int) -> EngineConfig:
    """sglang's own defaults for a replica of `num_gpus` GPUs at tensor parallelism `tp` (the rest is
    data parallel): what `python -m sglang.launch_server --tp-size tp --dp-size n/tp` runs."""
    return EngineConfig(tp=tp, dp=num_gpus // tp)


def knob_value(config: EngineConfig, knob: str) -> object:
    if knob == "speculative":
        if config.speculative_algorithm is None:
            return None
        return (config.speculative_algorithm, config.speculative_num_steps, config.speculative_num_draft_tokens)
    return getattr(config, knob)


def with_knob(config: EngineConfig, knob: str, value: object, num_gpus: int) -> EngineConfig:
    """`config` with one knob set; tp keeps the replica at `num_gpus` GPUs (dp = num_gpus / tp)."""
    if knob == "speculative":
        if value is None:
            return replace(config, speculative_algorithm=None, speculative_num_steps=None, speculative_num_draft_tokens=None)
        if not isinstance(value, tuple):
            raise TypeError(f"speculative must be None or (algorithm, steps, draft tokens), not {value!r}")
        algorithm, steps, drafts = value
        return replace(config, speculative_algorithm=algorithm, speculative_num_steps=steps, speculative_num_draft_tokens=drafts)
    if knob == "tp":
        return replace(config, tp=int(value), dp=num_gpus // int(value))  # type: ignore[call-overload]
    return replace(config, **{knob: value})  # type: ignore[arg-type]  # a knob set by name: the value is one of its choices


def config_from_dict(values: Mapping[str, object]) -> EngineConfig:
    """Parse a candidate (from a proposer or the store); ValueError names what is wrong."""
    if not isinstance(values, Mapping):
        raise ValueError(f"a candidate must be a JSON object of EngineConfig keys, got {type(values).__name__}")
    return EngineConfig.from_dict(values)


def in_space(space: SearchSpace, config: EngineConfig) -> str | None:
    """None when every knob of `config` takes one of the space's choices, else the first reason."""
    for knob in KNOBS:
        value = knob_value(config, knob)
        if value not in space.choices(knob):
            return f"{knob}={value!r} is outside the search space {list(space.choices(knob))}"
    untouched = EngineConfig()
    for name in ("ep", "enable_dp_attention", "page_size", "disable_cuda_graph"):
        if getattr(config, name) != getattr(untouched, name):
            return f"{name} is not searched; it must stay {getattr(untouched, name)!r}"
    return None
