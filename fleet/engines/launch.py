"""How a pool's replicas are launched: the engine kind, its command and model, rendered per engine.

``launch_argv`` is a replica's command line without ``--host H --port P`` (the actuator appends them;
llama-server, vLLM's api_server and sglang's launch_server all take both): the engine's command, the
pool's ``EngineConfig`` rendered by ``kernels.config`` for that engine, the launch settings (served
model name, LoRA adapters, metrics, threads), the device's choices, then the operator's ``extra_args`` (last, so
they win where a flag repeats). ``launch_env`` is its environment; ``argument_problems`` asks the
engine's own parser (vLLM, sglang) or ``llama-server --help`` whether it takes the command line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from fleet.engines import install
from kernels.compiler.gates import GateResult, LlamacppFlagGate, ParserGate
from kernels.config import EngineConfig

_VLLM_MODULE = ("-m", "vllm.entrypoints.openai.api_server")
_SGLANG_MODULE = ("-m", "sglang.launch_server")
# What a vLLM replica on CPU needs (each unless the operator's args set it): no CUDA graphs, the dtype
# its CPU kernels run, and a context the 1 GiB KV space (launch_env) holds a full sequence of.
_VLLM_CPU_ARGS: tuple[tuple[str, ...], ...] = (("--enforce-eager",), ("--dtype", "bfloat16"), ("--max-model-len", "2048"))
# On GPUs llama-server keeps every layer in VRAM; a CPU build has no such choice.
_LLAMACPP_GPU_ARGS: tuple[tuple[str, ...], ...] = (("--n-gpu-layers", "all"),)
_VLLM_CPU_KVCACHE_GIB = 1
# Defaults a pool's ``env`` may override (launch_env).
_POOL_ENV_DEFAULTS: dict[str, dict[str, str]] = {"vllm": {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}}


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """A pool's ``engine:`` launch settings (the rest of that mapping is its ``EngineConfig``).

    ``command``: the engine's binary (llamacpp) or interpreter (vllm, sglang: the module is added);
    empty: the kind's default (the installed llama-server or vLLM CPU venv; sglang: ``python3``, as
    sglang is never installed beside Polymorph). ``model_path`` None: the kind's default (the tiny
    test model for the CPU engines; sglang has none). ``threads``: llama-server's ``-t`` (default 1)."""

    kind: str
    command: tuple[str, ...] = ()
    model_path: str | None = None
    served_model_name: str = ""
    threads: int | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters the engine loads: (name requests select it by, PEFT folder)


def launch_argv(launch: EngineLaunch, config: EngineConfig, device_kind: str, *, probe: bool = True) -> tuple[str, ...]:
    """The replica's full command line, without ``--host``/``--port``. Installs the default engine
    and tiny model on first use; ValueError for the emulated kind or an sglang pool without a model.
    ``probe`` False renders for another host (a container image: give ``command`` and ``model_path``)
    without running anything here; llama-server's optional ``--no-webui`` is then left out."""
    command, engine_args = _command_and_args(launch, config, device_kind, probe=probe)
    return (*command, *engine_args)


def launch_env(launch: EngineLaunch, device_kind: str, device_ids: tuple[str, ...]) -> dict[str, str]:
    """The replica's environment: ours, the pool's ``env``, then what its devices and engine need.
    GPUs: ``CUDA_VISIBLE_DEVICES``. vLLM: telemetry and hub lookups off; on CPU a 1 GiB KV space and
    its OpenMP threads bound to the given CPU ids (two replicas never share a core). vLLM also keeps
    the Responses it answers, unless the pool's ``env`` says otherwise: without its store a follow-up's
    ``previous_response_id`` and ``GET /v1/responses/{id}`` are 404 there (vLLM keeps them in memory
    without eviction: a pool serving heavy Responses traffic may set ``VLLM_ENABLE_RESPONSES_API_STORE: 0``)."""
    env = {**os.environ, **pool_env_defaults(launch.kind), **dict(launch.env)}
    if device_kind != "cpu" and device_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(device_ids)
    if launch.kind == "vllm":
        env.update(install.QUIET_ENV)
        if device_kind == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(_VLLM_CPU_KVCACHE_GIB)
            if device_ids:
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(device_ids)
    return env


def pool_env_defaults(kind: str) -> dict[str, str]:
    """What an engine of ``kind`` gets in its environment unless its pool's ``env`` sets it (a replica
    process here, or a pod's container: fleet.kubernetes_manifests)."""
    return dict(_POOL_ENV_DEFAULTS.get(kind, {}))


def argument_problems(launch: EngineLaunch, config: EngineConfig, device_kind: str) -> list[str]:
    """What the engine's own parser rejects in ``launch_argv``: none for an accepted command line
    (and for the emulated kind). vLLM and sglang run their parser in their interpreter (tens of
    seconds: it imports the engine); llama-server's flags are checked against its ``--help``.
    RuntimeError when the engine's interpreter or binary cannot run at all."""
    if launch.kind == "emulated":
        return []
    command, engine_args = _command_and_args(launch, config, device_kind)
    result: GateResult
    if launch.kind == "llamacpp":
        result = LlamacppFlagGate(command[0]).check_many([engine_args])[0]
    else:
        with ParserGate(python=command[0], env=launch_env(launch, device_kind, ()), engine=launch.kind) as gate:
            result = gate.check_many([engine_args])[0]
    return [result.reason] if result.rejected else []


def _command_and_args(launch: EngineLaunch, config: EngineConfig, device_kind: str, *, probe: bool = True) -> tuple[tuple[str, ...], list[str]]:
    """(what runs: binary, or interpreter and module; the arguments its parser reads)."""
    name = launch.served_model_name
    if launch.kind == "llamacpp":
        command = launch.command or (str(install.llamacpp_server()),)
        args = config.to_llamacpp_args(launch.model_path or str(install.tiny_model_gguf()))
        args += ["-t", str(launch.threads or 1), "--metrics", *(["--alias", name] if name else [])]
        if probe and "--no-webui" in LlamacppFlagGate(command[0]).option_strings():  # not in builds before the flag existed
            args.append("--no-webui")
        device = () if device_kind == "cpu" else _LLAMACPP_GPU_ARGS
    elif launch.kind == "vllm":
        command = (*(launch.command or (str(install.vllm_python()),)), *_VLLM_MODULE)
        args = ["--model", launch.model_path or str(install.tiny_model_hf()), *config.vllm_flags()]
        args += ["--served-model-name", name] if name else []
        args += _vllm_lora_args(launch.adapters, name)
        device = _VLLM_CPU_ARGS if device_kind == "cpu" else ()
    elif launch.kind == "sglang":
        if launch.model_path is None:
            raise ValueError("an sglang pool names its engine's model_path (sglang has no default model)")
        command = (*(launch.command or ("python3",)), *_SGLANG_MODULE)
        args = config.to_sglang_args(launch.model_path) + ["--enable-metrics", *(["--served-model-name", name] if name else [])]
        if launch.adapters:
            args += ["--enable-lora", "--lora-paths", *(f"{adapter}={path}" for adapter, path in launch.adapters)]
        device = ()
    else:
        raise ValueError(f"a {launch.kind!r} replica is not launched from a command line")
    for choice in device:
        if not _sets(args, choice[0]) and not _sets(launch.extra_args, choice[0]):
            args += choice
    return command, [*args, *launch.extra_args]


def _vllm_lora_args(adapters: tuple[tuple[str, str], ...], base: str) -> list[str]:
    """vLLM's LoRA flags: each adapter as a JSON item (a ``name=path`` item cannot carry a path with a comma, nor
    the base model name its /v1/models lists as ``parent``); ``--max-loras``: every adapter may run in one batch
    (vLLM's default is 1). ``--max-lora-rank`` depends on the adapters' weights: the operator's ``args``."""
    if not adapters:
        return []
    items = [orjson.dumps({"name": adapter, "path": path, **({"base_model_name": base} if base else {})}).decode() for adapter, path in adapters]
    return ["--enable-lora", "--lora-modules", *items, "--max-loras", str(len(adapters))]


def _sets(args: Sequence[str], flag: str) -> bool:
    """Whether an argument list passes ``flag`` (as ``--flag value`` or ``--flag=value``)."""
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)
