"""EngineConfig: the engine knobs Polymorph compiles per pool, with sglang, vLLM and llama.cpp command-line codecs.

Defaults are sglang's (python/sglang/srt/server_args.py). sglang resolves several knobs at start-up
from the GPU and model ("auto"); those are `None` here and the performance model resolves them the
same way (see `kernels.perf.PerfModel.config`)."""

from __future__ import annotations

import itertools
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

SCHEDULE_POLICIES = ("fcfs", "lpm", "random", "dfs-weight", "lof", "priority")
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")
# Quantization methods grouped by the bytes a weight occupies; "fp8"/"fp4" are generic names.
FP8_QUANTIZATIONS = ("fp8", "w8a8_fp8", "modelopt_fp8", "fbgemm_fp8", "mxfp8")
FP4_QUANTIZATIONS = ("fp4", "modelopt_fp4", "nvfp4", "mxfp4", "w4afp8", "awq", "gptq", "awq_marlin", "gptq_marlin")
QUANTIZATIONS = FP8_QUANTIZATIONS + FP4_QUANTIZATIONS
SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NGRAM", "MTP")
# sglang flags renamed between releases: (widely deployed spelling, newer spelling, first release
# verified to use the newer one). sglang 0.5.23 split --cuda-graph-max-bs into -decode and -prefill
# (argparse then rejects the old flag as an ambiguous prefix); EngineConfig's knob is the decode one.
_SGLANG_RENAMES = (("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", (0, 5, 23)),)


@dataclass(frozen=True, slots=True)
class SglangTarget:
    """The sglang release arguments are rendered for. Its parser's `option_strings` (reported by the
    parser gate, kernels.compiler.gates.ParserGate.target) decide a spelling; failing that, `version`
    against the first release verified to use the newer one; neither: the widely deployed spelling."""

    version: str | None = None
    option_strings: frozenset[str] | None = None

    def spelling(self, flag: str) -> str:
        for old, new, since in _SGLANG_RENAMES:
            if flag != old:
                continue
            if self.option_strings is not None:
                return new if new in self.option_strings and old not in self.option_strings else old
            release = _release(self.version)
            return new if release is not None and release >= since else old
        return flag


def _release(version: str | None) -> tuple[int, ...] | None:
    """(0, 5, 23) from "0.5.23", "0.5.23.post1" or "0.5.23rc0"; None when unknown or unparseable."""
    if not version:
        return None
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


_ALIASES = {
    "tp_size": "tp",
    "tensor_parallel_size": "tp",
    "dp_size": "dp",
    "data_parallel_size": "dp",
    "ep_size": "ep",
    "expert_parallel_size": "ep",
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "chunked_prefill_size",
    "quant": "quantization",
    "block_size": "page_size",
    "gpu_memory_utilization": "mem_fraction_static",
    "speculative_algo": "speculative_algorithm",
}


def canonical_key(key: str) -> str:
    """An EngineConfig key as its field is named: '-' read as '_', sglang's and vLLM's spellings as ours."""
    key = key.replace("-", "_")
    return _ALIASES.get(key, key)


# A prefix cache never serves a whole prompt (the last token is always computed) and shares measured over
# a short window overstate the long run's: a share is capped here wherever one is measured.
MAX_PREFIX_SHARE = 0.95


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One compiled engine configuration (per replica: tp GPUs per data-parallel rank, dp ranks)."""

    tp: int = 1
    dp: int = 1
    ep: int = 1
    enable_dp_attention: bool = False
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    page_size: int = 1
    mem_fraction_static: float | None = None
    enable_prefix_caching: bool = True
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_num_draft_tokens: int | None = None
    # The KV pool in tokens, shared by every running request (sglang --max-total-tokens, llama.cpp -c);
    # None: the engine sizes it from memory (mem_fraction_static; llama.cpp: the model's context).
    max_total_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep", "max_prefill_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_running_requests", "cuda_graph_max_bs", "speculative_num_steps", "speculative_num_draft_tokens",
                     "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "cuda_graph_max_bs" else 1):
                raise ValueError(f"{name} must be positive, got {value}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1 and self.chunked_prefill_size != -1:
            raise ValueError(f"chunked_prefill_size must be positive or -1 (disabled), got {self.chunked_prefill_size}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.speculative_algorithm is not None:
            _check_choice("speculative_algorithm", self.speculative_algorithm, SPECULATIVE_ALGORITHMS)

    def prefilled_share(self, prefix_share: float) -> float:
        """The share of a prompt's tokens this engine computes when a prefix cache could reuse
        ``prefix_share`` of them. Charging a prompt at its unshared length is an approximation: decode
        still reads the whole context (the compiler's evaluators and the fleet's capacity model both)."""
        return 1.0 - prefix_share if self.enable_prefix_caching else 1.0

    @property
    def num_gpus(self) -> int:
        return self.tp * self.dp

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> EngineConfig:
        """Build from a mapping (YAML/JSON); keys may use '-' or sglang/vLLM spellings (tp_size, max_num_seqs).

        Raises ValueError naming the key for an unknown key or a value of the wrong type."""
        types = {f.name: f.type for f in fields(cls)}
        kwargs: dict[str, object] = {}
        spelled: dict[str, object] = {}  # key -> the spelling it was given as
        for raw_key, value in values.items():
            key = canonical_key(str(raw_key))
            if key not in types:
                raise ValueError(f"unknown engine config key {raw_key!r}; known keys: {', '.join(types)}")
            if key in spelled:  # `tp` and `tp_size` both: before, the later silently won
                raise ValueError(f"engine config key {raw_key!r} is {key!r}, already given as {spelled[key]!r}")
            spelled[key] = raw_key
            kwargs[key] = _coerce(key, str(types[key]), value)
        return cls(**kwargs)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def to_sglang_args(self, model_path: str, target: SglangTarget | None = None, draft_model_path: str | None = None) -> list[str]:
        """Arguments for `python -m sglang.launch_server` (auto-resolved knobs left out), spelled for
        `target` (default: the widely deployed release's spelling). `draft_model_path`: the draft
        checkpoint EAGLE/EAGLE3 speculation loads (rendered only with such an algorithm)."""
        spell = (target or SglangTarget()).spelling
        args = ["--model-path", model_path, "--tp-size", str(self.tp), "--dp-size", str(self.dp)]
        if self.ep != 1:
            args += ["--ep-size", str(self.ep)]
        if self.enable_dp_attention:
            args.append("--enable-dp-attention")
        optional = {
            "--max-running-requests": self.max_running_requests,
            "--chunked-prefill-size": self.chunked_prefill_size,
            "--max-prefill-tokens": self.max_prefill_tokens,
            # sglang's scheduler knows no "priority" policy (its parser would pass it, its start would
            # fail): priority ordering is fcfs with the switch below
            "--schedule-policy": "fcfs" if self.schedule_policy == "priority" else self.schedule_policy,
            "--kv-cache-dtype": self.kv_cache_dtype,
            "--quantization": self.quantization,
            spell("--cuda-graph-max-bs"): self.cuda_graph_max_bs,
            "--page-size": self.page_size,
            "--mem-fraction-static": self.mem_fraction_static,
            "--speculative-algorithm": self.speculative_algorithm,
            "--speculative-num-steps": self.speculative_num_steps,
            "--speculative-num-draft-tokens": self.speculative_num_draft_tokens,
            "--speculative-draft-model-path": draft_model_path if self.speculative_algorithm in ("EAGLE", "EAGLE3") else None,
            "--max-total-tokens": self.max_total_tokens,
        }
        for flag, value in optional.items():
            if value is not None:
                args += [flag, str(value)]
        if self.disable_cuda_graph:
            args.append("--disable-cuda-graph")
        if not self.enable_prefix_caching:
            args.append("--disable-radix-cache")
        if self.schedule_policy == "priority":
            # sglang orders by the request's `priority` only with this switch, and by default runs
            # higher values first; Polymorph's tiers and vLLM run lower values first, so flip it
            args += ["--enable-priority-scheduling", "--schedule-low-priority-values-first"]
        return args

    @classmethod
    def from_sglang_args(cls, args: Sequence[str] | str) -> EngineConfig:
        """Parse sglang launch_server flags of any release (both spellings of a renamed flag; unknown
        flags such as --port are ignored)."""
        values: dict[str, object] = {}
        for flag, value in _flag_pairs(args, _SGLANG_SWITCHES):
            if flag in _SGLANG_SWITCHES:
                values[_SGLANG_SWITCHES[flag][0]] = _SGLANG_SWITCHES[flag][1]
            elif flag in _SGLANG_VALUED:
                values[_SGLANG_VALUED[flag]] = value
        values.pop("_low_priority_values_first", None)  # the direction: Polymorph always renders lower-first
        if values.pop("_priority_scheduling", False) and values.get("schedule_policy", "fcfs") == "fcfs":
            values["schedule_policy"] = "priority"  # sglang's fcfs with priority scheduling orders by priority
        return cls.from_dict(values)

    def to_vllm_args(self, model_path: str) -> list[str]:
        """Arguments for `vllm serve`: `serve MODEL` and `vllm_flags()`."""
        return ["serve", model_path, *self.vllm_flags()]

    def vllm_flags(self) -> list[str]:
        """vLLM's engine flags, without the model (`vllm serve` takes it positionally, the api_server
        module as `--model`). sglang-only knobs (max_prefill_tokens, lpm/lof/dfs policies) have no vLLM
        equivalent and are dropped; vLLM's default fcfs is used instead. sglang's default token-sized
        pages (page_size 1) leave vLLM its own block size: no vLLM attention backend takes 1-token
        blocks (its CPU backend refuses to start: blocks are multiples of 32 there, 128 by default;
        CUDA's default is 16). `max_total_tokens` becomes `--num-gpu-blocks-override`, the pool in
        blocks of `--block-size` tokens (rounded up), where page_size names that size: vLLM's only
        bound on its KV pool, which replaces the size it derives from memory (and fails at start when
        that many blocks do not fit). With page_size 1 the block size is vLLM's choice per platform,
        so the bound is left out and vLLM sizes its pool from memory (gpu_memory_utilization, or
        VLLM_CPU_KVCACHE_SPACE on CPU)."""
        args = ["--tensor-parallel-size", str(self.tp), "--data-parallel-size", str(self.dp)]
        if self.ep > 1:
            args.append("--enable-expert-parallel")
        optional = {
            "--max-num-seqs": self.max_running_requests,
            "--max-num-batched-tokens": self.chunked_prefill_size if (self.chunked_prefill_size or 0) > 0 else None,
            "--kv-cache-dtype": _KV_TO_VLLM.get(self.kv_cache_dtype, self.kv_cache_dtype),
            "--quantization": self.quantization,
            "--block-size": self.page_size if self.page_size > 1 else None,
            "--gpu-memory-utilization": self.mem_fraction_static,
            "--scheduling-policy": self.schedule_policy if self.schedule_policy in ("fcfs", "priority") else None,
            "--num-gpu-blocks-override": (-(-self.max_total_tokens // self.page_size)
                                          if self.max_total_tokens is not None and self.page_size > 1 else None),
        }
        for flag, value in optional.items():
            if value is not None:
                args += [flag, str(value)]
        if self.disable_cuda_graph:
            args.append("--enforce-eager")
        elif self.cuda_graph_max_bs is not None:
            args += ["--compilation-config", json.dumps({"max_cudagraph_capture_size": self.cuda_graph_max_bs})]
        args.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.speculative_algorithm is not None:
            spec: dict[str, object] = {"method": _SPEC_TO_VLLM[self.speculative_algorithm]}
            if self.speculative_num_draft_tokens is not None:
                spec["num_speculative_tokens"] = self.speculative_num_draft_tokens - 1
            elif self.speculative_num_steps is not None:
                spec["num_speculative_tokens"] = self.speculative_num_steps
            args += ["--speculative-config", json.dumps(spec, sort_keys=True)]
        return args

    @classmethod
    def from_vllm_args(cls, args: Sequence[str] | str) -> EngineConfig:
        """Parse `vllm serve` flags (the leading `serve MODEL` and unknown flags are ignored)."""
        values: dict[str, object] = {}
        for flag, value in _flag_pairs(args, _VLLM_SWITCHES):
            if flag in _VLLM_SWITCHES:
                values[_VLLM_SWITCHES[flag][0]] = _VLLM_SWITCHES[flag][1]
            elif flag in _VLLM_VALUED:
                key = _VLLM_VALUED[flag]
                values[key] = _KV_FROM_VLLM.get(value, value) if key == "kv_cache_dtype" and value is not None else value
            elif flag == "--compilation-config" and value is not None:
                capture = json.loads(value).get("max_cudagraph_capture_size")
                if capture is not None:
                    values["cuda_graph_max_bs"] = capture
            elif flag == "--speculative-config" and value is not None:
                values.update(_spec_from_vllm(json.loads(value)))
        if values.pop("_expert_parallel", False):
            values["ep"] = int(values.get("tp", 1)) * int(values.get("dp", 1))  # type: ignore[call-overload]
        blocks = values.pop("_num_blocks", None)
        if blocks is not None:
            values["max_total_tokens"] = int(blocks) * int(values.get("page_size", 1))  # type: ignore[call-overload]
        return cls.from_dict(values)

    def to_llamacpp_args(self, model_path: str) -> list[str]:
        """Arguments for `llama-server`. Its slots share one KV pool (`--kv-unified`) of `-c`
        tokens, as sglang's and vLLM's running requests do; `-b`/`-ub` bound a prefill chunk;
        prefix caching keeps its prompt cache and reuses cached chunks by KV shifting
        (`--cache-reuse`), and off is `--no-cache-prompt`. llama-server batches continuously by
        default (`--no-cont-batching` is never rendered) and has no tensor/data parallelism,
        priority scheduling, fp8 KV cache or speculation knob here: those are dropped. Unset
        knobs keep llama-server's defaults (4 slots, the model's context, 2048/512 batches)."""
        args = ["-m", model_path, "--kv-unified"]
        optional = {
            "--parallel": self.max_running_requests,
            "-c": self.max_total_tokens,
            "-b": self.chunked_prefill_size if (self.chunked_prefill_size or 0) > 0 else None,
            "-ub": self.chunked_prefill_size if (self.chunked_prefill_size or 0) > 0 else None,
        }
        for flag, value in optional.items():
            if value is not None:
                args += [flag, str(value)]
        if self.enable_prefix_caching:
            args += ["--cache-reuse", str(_LLAMACPP_CACHE_REUSE_TOKENS)]
        else:
            args.append("--no-cache-prompt")
        return args

    @classmethod
    def from_llamacpp_args(cls, args: Sequence[str] | str) -> EngineConfig:
        """Parse `llama-server` flags (unknown ones ignored); `-c 0` (the model's context) and
        `--parallel -1` (auto) are llama-server's defaults, None here."""
        values: dict[str, object] = {}
        for flag, value in _flag_pairs(args, _LLAMACPP_SWITCHES):
            if flag in _LLAMACPP_SWITCHES:
                values[_LLAMACPP_SWITCHES[flag][0]] = _LLAMACPP_SWITCHES[flag][1]
            elif flag in _LLAMACPP_VALUED and value is not None:
                values[_LLAMACPP_VALUED[flag]] = value if int(value) > 0 else None
        values.pop("_kv_unified", None)
        return cls.from_dict(values)


_SGLANG_VALUED = {
    "--tp-size": "tp", "--tp": "tp", "--tensor-parallel-size": "tp",
    "--dp-size": "dp", "--dp": "dp", "--data-parallel-size": "dp",
    "--ep-size": "ep", "--ep": "ep", "--expert-parallel-size": "ep",
    "--max-running-requests": "max_running_requests",
    "--chunked-prefill-size": "chunked_prefill_size",
    "--max-prefill-tokens": "max_prefill_tokens",
    "--schedule-policy": "schedule_policy",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--quantization": "quantization",
    "--cuda-graph-max-bs": "cuda_graph_max_bs", "--cuda-graph-max-bs-decode": "cuda_graph_max_bs",
    "--page-size": "page_size",
    "--mem-fraction-static": "mem_fraction_static",
    "--speculative-algorithm": "speculative_algorithm",
    "--speculative-num-steps": "speculative_num_steps",
    "--speculative-num-draft-tokens": "speculative_num_draft_tokens",
    "--max-total-tokens": "max_total_tokens",
}
_SGLANG_SWITCHES = {
    "--disable-radix-cache": ("enable_prefix_caching", False),
    "--disable-cuda-graph": ("disable_cuda_graph", True),
    "--enable-dp-attention": ("enable_dp_attention", True),
    "--enable-priority-scheduling": ("_priority_scheduling", True),
    "--schedule-low-priority-values-first": ("_low_priority_values_first", True),
}
_VLLM_VALUED = {
    "--tensor-parallel-size": "tp", "-tp": "tp",
    "--data-parallel-size": "dp", "-dp": "dp",
    "--max-num-seqs": "max_running_requests",
    "--max-num-batched-tokens": "chunked_prefill_size",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--quantization": "quantization", "-q": "quantization",
    "--block-size": "page_size",
    "--gpu-memory-utilization": "mem_fraction_static",
    "--scheduling-policy": "schedule_policy",
    "--num-gpu-blocks-override": "_num_blocks",
}
_VLLM_SWITCHES = {
    "--enable-prefix-caching": ("enable_prefix_caching", True),
    "--no-enable-prefix-caching": ("enable_prefix_caching", False),
    "--enforce-eager": ("disable_cuda_graph", True),
    "--enable-expert-parallel": ("_expert_parallel", True),
}
_LLAMACPP_VALUED = {
    "--parallel": "max_running_requests", "-np": "max_running_requests",
    "-c": "max_total_tokens", "--ctx-size": "max_total_tokens",
    "-b": "chunked_prefill_size", "--batch-size": "chunked_prefill_size",
}
_LLAMACPP_SWITCHES = {
    "--no-cache-prompt": ("enable_prefix_caching", False),
    "--kv-unified": ("_kv_unified", True), "-kvu": ("_kv_unified", True),
}
# The smallest cached chunk llama-server reuses by KV shifting (shorter matches are recomputed):
# a few hundred tokens, so that a reuse saves more prefill than the shift costs.
_LLAMACPP_CACHE_REUSE_TOKENS = 256
_KV_TO_VLLM = {"bf16": "bfloat16"}
_KV_FROM_VLLM = {"fp8": "fp8_e4m3", "bfloat16": "bf16"}
_SPEC_TO_VLLM = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NGRAM": "ngram", "MTP": "mtp"}


def _spec_from_vllm(spec: Mapping[str, object]) -> dict[str, object]:
    method = str(spec.get("method", "")).lower()
    by_method = {v.lower(): k for k, v in _SPEC_TO_VLLM.items()}
    if method.endswith("_mtp"):
        method = "mtp"
    if method not in by_method:
        raise ValueError(f"speculative-config method {method!r} is not one of {sorted(by_method)}")
    values: dict[str, object] = {"speculative_algorithm": by_method[method]}
    num_tokens = spec.get("num_speculative_tokens")
    if num_tokens is not None:
        # A chain draft (top-k 1): one draft step per speculative token, plus the verified bonus token.
        values["speculative_num_steps"] = int(num_tokens)  # type: ignore[call-overload]
        values["speculative_num_draft_tokens"] = int(num_tokens) + 1  # type: ignore[call-overload]
    return values


def _flag_pairs(args: Sequence[str] | str, switches: Mapping[str, object]) -> list[tuple[str, str | None]]:
    """Split a command line into (flag, value) pairs; `--flag=value` and `--flag value` both work."""
    tokens = shlex.split(args) if isinstance(args, str) else list(args)
    pairs: list[tuple[str, str | None]] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        index += 1
        if not token.startswith("-"):
            continue
        if "=" in token:
            flag, value = token.split("=", 1)
            pairs.append((flag, value))
        elif token in switches or index >= len(tokens) or tokens[index].startswith("--"):
            pairs.append((token, None))
        else:
            pairs.append((token, tokens[index]))
            index += 1
    return pairs


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _coerce(key: str, type_text: str, value: object) -> object:
    """Convert strings from command lines and check types from YAML/JSON; errors name the key."""
    optional = "None" in type_text
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if not optional:
            raise ValueError(f"engine config key {key!r} may not be null")
        return None
    base = type_text.replace(" | None", "")
    try:
        if base == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
        elif base == "int":
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, str):
                return int(value)
            if isinstance(value, float) and value.is_integer():
                return int(value)
        elif base == "float":
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str):
                return float(value)
        elif base == "str" and isinstance(value, str):
            return value
    except ValueError:
        pass
    raise ValueError(f"engine config key {key!r} expects {base}, got {value!r}")
