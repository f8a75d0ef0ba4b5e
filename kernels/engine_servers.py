"""How each engine runs a configuration, where that differs from sglang's, which the performance model
(kernels.perf) follows: the knobs a configuration leaves unset are filled by the engine's own defaults
before the model judges it. The controller's choice of configuration, the compile probe's prediction
and the gateway's saturation mark all read them here.

- llama-server (`LlamacppServer`): 4 slots sharing one KV pool of the model's context; a request that
  finds the pool full fails where sglang waits.
- vLLM (`VllmServer`): its api_server's `max_num_seqs` and `max_num_batched_tokens` for the device and
  its `gpu_memory_utilization`, where sglang sizes its running batch from the KV pool (2,048-4,096 on an
  80 GB GPU, where vLLM runs 1,024; on an A100 or L40S vLLM runs 256 and batches 2,048 tokens a step,
  where sglang chunks 8,192 or 4,096).
- sglang and the emulator (which emulates sglang): None, the model resolves its defaults itself."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from kernels.catalog import GpuSpec, ModelSpec
from kernels.config import EngineConfig

LLAMACPP_DEFAULT_SLOTS = 4  # llama-server's `--parallel -1` (auto)
# vLLM 0.32's api_server defaults (vllm/engine/arg_utils.py, `EngineArgs.get_batch_defaults` for the
# OPENAI_API_SERVER usage context, and CacheConfig.gpu_memory_utilization). It reads the device's
# memory and name; where it cannot (no device known here either) it takes the row for other GPUs.
VLLM_GPU_MEMORY_UTILIZATION = 0.92
_VLLM_LARGE_GPU_GB = 160.0  # B200, MI300X and up: (1024, 16384)
_VLLM_H100_CLASS_GB = 70.0  # H100, H200, GH200 (an 80 GB A100 is named out): (1024, 8192)
_VLLM_BIG = (1024, 8192)
_VLLM_LARGEST = (1024, 16384)
_VLLM_OTHER_GPU = (256, 2048)  # A100 (batching more tokens slowed it, vLLM PR #17885), L40S, unknown
_VLLM_CPU_PER_WORKER = (128, 2048)  # times the world size (tensor parallel)


class EngineServer(Protocol):
    """An engine as a pool's capacity must be judged: the configuration it runs, and whether all its
    running requests fit at once (llama-server fails those that do not; sglang and vLLM queue them)."""

    def runs(self, config: EngineConfig) -> EngineConfig: ...

    def holds(self, config: EngineConfig, request_tokens: float) -> bool: ...

    def sized_for(self, request_tokens: float) -> EngineConfig | None: ...


@dataclass(frozen=True, slots=True)
class LlamacppServer:
    """llama-server. Judged as sglang, a candidate that left the slots and the KV pool unset looked 1.7x
    faster on 1,080-token prompts than the one slot a pool declared, the controller restarted the pool
    with it, and llama-server's 4 slots in a 2,048-token pool failed 43 streams with "Context size has
    been exceeded" (tests/gateway/test_real_drift.py)."""

    max_context: int  # the model's: the KV pool llama-server allocates when `-c` is unset

    def runs(self, config: EngineConfig) -> EngineConfig:
        """``config`` as llama-server runs it: where it leaves them unset, 4 slots (`--parallel` auto)
        sharing one KV pool of the model's context (`-c 0`), where sglang sizes both from memory."""
        return replace(config, max_running_requests=config.max_running_requests or LLAMACPP_DEFAULT_SLOTS,
                       max_total_tokens=config.max_total_tokens or self.max_context)

    def holds(self, config: EngineConfig, request_tokens: float) -> bool:
        """Whether all of ``config``'s slots can hold a request of ``request_tokens`` at once: llama-server
        gives a request any free slot and fails it when the shared pool runs out, where sglang waits."""
        run = self.runs(config)
        assert run.max_running_requests is not None and run.max_total_tokens is not None
        return run.max_running_requests * request_tokens <= run.max_total_tokens

    def sized_for(self, request_tokens: float) -> EngineConfig | None:
        """The configuration with the most slots that all hold a request of ``request_tokens`` at once in
        the model's context (None: not even one slot does): what a pool runs when llama-server's 4 default
        slots cannot hold its longest requests and no other candidate names fewer."""
        slots = int(self.max_context // max(request_tokens, 1.0))
        return EngineConfig(max_running_requests=slots) if slots >= 1 else None


@dataclass(frozen=True, slots=True)
class VllmServer:
    """vLLM's api_server on ``device`` (None: a device not known here, as vLLM treats one it cannot read)."""

    device: GpuSpec | None

    def runs(self, config: EngineConfig) -> EngineConfig:
        """``config`` as vLLM runs it: its batch limits for the device where the configuration leaves them
        unset, and its share of device memory (weights, activations and KV; sglang's static fraction is
        0.88 on one 80 GB GPU). On CPU the KV space is an environment setting, so the fraction is left."""
        seqs, tokens = vllm_batch_defaults(self.device, config.tp)
        on_gpu = self.device is not None and self.device.vendor != "cpu"
        return replace(config, max_running_requests=config.max_running_requests or seqs,
                       chunked_prefill_size=config.chunked_prefill_size or tokens,
                       mem_fraction_static=config.mem_fraction_static or (VLLM_GPU_MEMORY_UTILIZATION if on_gpu else None))

    def holds(self, config: EngineConfig, request_tokens: float) -> bool:
        """Always: vLLM preempts or queues a request its KV cannot hold yet, and chunks a long prompt."""
        return True

    def sized_for(self, request_tokens: float) -> EngineConfig | None:
        """None: every configuration holds (``holds``), so none is sized for a length."""
        return None


def vllm_batch_defaults(device: GpuSpec | None, world_size: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM's api_server runs on ``device`` with ``world_size``
    workers when the flags are absent."""
    if device is None:
        return _VLLM_OTHER_GPU
    if device.vendor == "cpu":
        seqs, tokens = _VLLM_CPU_PER_WORKER
        return seqs * world_size, tokens * world_size
    if device.hbm_gb >= _VLLM_LARGE_GPU_GB:
        return _VLLM_LARGEST
    if device.hbm_gb >= _VLLM_H100_CLASS_GB and "a100" not in device.name.lower():
        return _VLLM_BIG
    return _VLLM_OTHER_GPU


def running_by_default(kind: str, device: GpuSpec | None, world_size: int = 1) -> int | None:
    """Requests engine ``kind`` runs at once on ``device`` when its configuration leaves that unset;
    None: it sizes the batch from its KV pool (sglang, and the emulator, which emulates it)."""
    if kind == "llamacpp":
        return LLAMACPP_DEFAULT_SLOTS
    if kind == "vllm":
        return vllm_batch_defaults(device, world_size)[0]
    return None


def engine_server(kind: str, device: GpuSpec | None, model: ModelSpec) -> EngineServer | None:
    """How engine ``kind`` serving ``model`` on ``device`` runs its configurations; None: as sglang does,
    which the performance model follows."""
    if kind == "llamacpp":
        return LlamacppServer(model.max_context)
    if kind == "vllm":
        return VllmServer(device)
    return None
