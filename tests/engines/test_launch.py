"""Replica command lines: a pool's EngineConfig rendered for each engine, on CPU and GPU, with its
environment; checked by llama-server's --help and vLLM's own parser, and started for real."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path

import openai
import pytest

from fleet.engines import install
from fleet.engines.launch import EngineLaunch, argument_problems, launch_argv, launch_env
from kernels.catalog import get_gpu, list_gpus
from kernels.catalog.models import get_model
from kernels.compiler.gates import LlamacppFlagGate
from kernels.config import EngineConfig
from kernels.engine_servers import VLLM_GPU_MEMORY_UTILIZATION, LlamacppServer, vllm_batch_defaults
from tests.conftest import free_port
from tests.support.engines import LLAMA_START_TIMEOUT_S, VLLM_START_TIMEOUT_S, chat_both_ways
from tests.support.procs import start, start_gateway, write_tenant

pytestmark = pytest.mark.xdist_group("vllm")  # one vLLM (3 GB, two cores' worth) at a time: the vLLM tests keep to one xdist worker

VLLM_MODULE = ("-m", "vllm.entrypoints.openai.api_server")
CONFIG = EngineConfig(max_running_requests=4, chunked_prefill_size=256, schedule_policy="priority")
ADAPTERS = (("sql-lora", "/adapters/sql"), ("chat-lora", "/adapters/chat,v2"))


def _value(argv: tuple[str, ...], flag: str) -> str:
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]


def test_vllm_command_line_names_the_model_once_and_adds_the_cpu_choices_only_on_cpu() -> None:
    launch = EngineLaunch("vllm", command=("/venvs/vllm/bin/python",), model_path="/models/tiny", served_model_name="tiny-llama")
    cpu, gpu = launch_argv(launch, CONFIG, "cpu"), launch_argv(launch, CONFIG, "H100")
    assert cpu[:4] == ("/venvs/vllm/bin/python", *VLLM_MODULE, "--model") and _value(cpu, "--model") == "/models/tiny"
    assert "serve" not in cpu and cpu.count("/models/tiny") == 1  # the api_server module takes --model, not `serve MODEL`
    assert _value(cpu, "--served-model-name") == "tiny-llama" and _value(cpu, "--scheduling-policy") == "priority"
    assert "--enforce-eager" in cpu and _value(cpu, "--dtype") == "bfloat16" and _value(cpu, "--max-model-len") == "2048"
    assert not {"--enforce-eager", "--dtype", "--max-model-len"} & set(gpu)
    # the rest is the config's own rendering: it reads back (CPU runs eager: no CUDA graphs there)
    assert EngineConfig.from_vllm_args(gpu) == CONFIG
    assert EngineConfig.from_vllm_args(cpu) == EngineConfig.from_dict({**CONFIG.to_dict(), "disable_cuda_graph": True})


def test_operator_args_come_last_and_replace_the_cpu_defaults() -> None:
    launch = EngineLaunch("vllm", command=("python",), model_path="/m", extra_args=("--max-model-len=4096", "--dtype", "float32", "--seed", "7"))
    argv = launch_argv(launch, EngineConfig(), "cpu")
    assert "--max-model-len" not in argv and "--max-model-len=4096" in argv and _value(argv, "--dtype") == "float32"
    assert argv[-len(launch.extra_args):] == launch.extra_args and "--enforce-eager" in argv
    # a config that already runs eager renders the flag once
    assert launch_argv(launch, EngineConfig(disable_cuda_graph=True), "cpu").count("--enforce-eager") == 1


def test_sglang_runs_in_the_operators_interpreter_and_exports_metrics() -> None:
    launch = EngineLaunch("sglang", model_path="meta-llama/Llama-3.1-8B-Instruct", served_model_name="llama")
    argv = launch_argv(launch, CONFIG, "H100")
    assert argv[:3] == ("python3", "-m", "sglang.launch_server")  # never Polymorph's own interpreter
    assert "--enable-metrics" in argv and _value(argv, "--served-model-name") == "llama"
    assert {"--enable-priority-scheduling", "--schedule-low-priority-values-first"} <= set(argv)
    assert EngineConfig.from_sglang_args(argv) == CONFIG
    named = launch_argv(EngineLaunch("sglang", command=("/opt/sglang/bin/python",), model_path="m"), CONFIG, "H100")
    assert named[:3] == ("/opt/sglang/bin/python", "-m", "sglang.launch_server") and "--served-model-name" not in named
    with pytest.raises(ValueError, match="model_path"):
        launch_argv(EngineLaunch("sglang"), CONFIG, "H100")


def test_emulated_replicas_have_no_command_line_and_nothing_to_parse() -> None:
    with pytest.raises(ValueError, match="emulated"):
        launch_argv(EngineLaunch("emulated"), CONFIG, "H100")
    assert argument_problems(EngineLaunch("emulated"), CONFIG, "H100") == []


def test_environment_names_the_devices_and_quiets_vllm() -> None:
    pool_env = (("POLYMORPH_POOL", "chat"), ("HF_HUB_OFFLINE", "0"))
    gpu = launch_env(EngineLaunch("sglang", env=pool_env), "H100", ("2", "3"))
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3" and gpu["POLYMORPH_POOL"] == "chat" and gpu["PATH"] == os.environ["PATH"]
    assert gpu["HF_HUB_OFFLINE"] == "0" and "VLLM_CPU_OMP_THREADS_BIND" not in gpu  # sglang's env is the operator's
    vllm_cpu = launch_env(EngineLaunch("vllm", env=pool_env), "cpu", ("0", "1"))
    assert vllm_cpu["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and vllm_cpu["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert {k: vllm_cpu[k] for k in ("VLLM_NO_USAGE_STATS", "HF_HUB_OFFLINE", "DO_NOT_TRACK")} == dict.fromkeys(
        ("VLLM_NO_USAGE_STATS", "HF_HUB_OFFLINE", "DO_NOT_TRACK"), "1")
    assert vllm_cpu.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # CPU ids are no GPU ids
    vllm_gpu = launch_env(EngineLaunch("vllm"), "H100", ("5",))
    assert vllm_gpu["CUDA_VISIBLE_DEVICES"] == "5" and "VLLM_CPU_KVCACHE_SPACE" not in vllm_gpu
    llama = launch_env(EngineLaunch("llamacpp", env=pool_env), "cpu", ("1",))
    assert llama == {**os.environ, **dict(pool_env)}  # llama-server needs nothing more


def test_llamacpp_command_line_passes_only_flags_llama_server_lists(llama_server_bin: Path, tiny_gguf: Path) -> None:
    launch = EngineLaunch("llamacpp", served_model_name="tiny-llama", threads=2)
    argv = launch_argv(launch, EngineConfig(max_running_requests=2, max_total_tokens=1024), "cpu")
    assert argv[:3] == (str(llama_server_bin), "-m", str(tiny_gguf))
    assert _value(argv, "-t") == "2" and _value(argv, "--alias") == "tiny-llama" and "--metrics" in argv
    assert "--no-webui" in argv and "--no-cont-batching" not in argv and "--n-gpu-layers" not in argv
    assert _value(launch_argv(launch, CONFIG, "H100"), "--n-gpu-layers") == "all"
    assert _value(launch_argv(EngineLaunch("llamacpp"), CONFIG, "cpu"), "-t") == "1"
    gate = LlamacppFlagGate(str(llama_server_bin))
    rendered = [c.to_llamacpp_args("m") for c in (EngineConfig(), CONFIG, EngineConfig(enable_prefix_caching=False, max_total_tokens=512))]
    assert [r.status for r in gate.check_many([*rendered, list(argv[1:])])] == ["passed"] * 4
    assert argument_problems(launch, CONFIG, "cpu") == []
    problems = argument_problems(EngineLaunch("llamacpp", extra_args=("--no-such-flag", "1", "--flash-attn=on")), CONFIG, "cpu")
    assert len(problems) == 1 and "--no-such-flag" in problems[0] and "--flash-attn" not in problems[0]


def _llama_server_answers(config: EngineConfig, tmp_path: Path, paths: tuple[str, ...]) -> list[bytes]:
    """What a llama-server started with ``config``'s rendered command line answers on ``paths``."""
    launch = EngineLaunch("llamacpp", served_model_name="tiny-llama")
    argv = launch_argv(launch, config, "cpu")
    port = free_port()
    proc = start([*argv[1:], "--host", "127.0.0.1", "--port", str(port)], port, tmp_path / "llama.log", "/health",
                 command=argv[:1], timeout_s=LLAMA_START_TIMEOUT_S, env=launch_env(launch, "cpu", ("0",)))
    try:
        answers = []
        for path in paths:
            with urllib.request.urlopen(proc.url + path, timeout=10) as resp:
                answers.append(resp.read())
        return answers
    finally:
        proc.stop()


def test_llama_server_runs_the_rendered_command_line(llama_server_bin: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    config = EngineConfig(max_running_requests=2, max_total_tokens=1024, chunked_prefill_size=128)
    props_json, models_json, metrics_text = _llama_server_answers(config, tmp_path, ("/props", "/v1/models", "/metrics"))
    props, models, metrics = json.loads(props_json), json.loads(models_json), metrics_text.decode()
    assert props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == 1024  # one pool: each slot may use all of it
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    assert "llamacpp:requests_processing" in metrics


def test_llama_server_runs_an_unset_configuration_as_llamacppserver_says(
        llama_server_bin: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    # the capacity model judges a llama.cpp pool's candidates as this (fleet.capacity), not as sglang runs them
    defaults = LlamacppServer(get_model("tiny-llama").max_context).runs(EngineConfig())
    props = json.loads(_llama_server_answers(EngineConfig(), tmp_path, ("/props",))[0])
    assert props["total_slots"] == defaults.max_running_requests
    assert props["default_generation_settings"]["n_ctx"] == defaults.max_total_tokens


# vLLM's own batch defaults (EngineArgs.get_batch_defaults, for its api_server) in its interpreter: on this
# CPU build as it is, then with the platform's device queries answering for each catalog GPU as a GPU
# platform does (memory in GiB, the catalog's name, which keeps "A100" where vLLM looks for it).
_VLLM_DEFAULTS = """
import json, sys
from vllm.config import CacheConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext

def defaults(world_size):
    tokens, seqs = EngineArgs.get_batch_defaults(world_size)
    return [seqs[UsageContext.OPENAI_API_SERVER], tokens[UsageContext.OPENAI_API_SERVER]]

found = {"cpu": [defaults(1), defaults(2)],
         "gpu_memory_utilization": CacheConfig.__dataclass_fields__["gpu_memory_utilization"].default.default}
platform = type(current_platform)
platform.is_cpu = lambda self: False
for name, gib in json.loads(sys.argv[1]).items():
    platform.get_device_total_memory = classmethod(lambda cls, device_id=0, gib=gib: int(gib * 2**30))
    platform.get_device_name = classmethod(lambda cls, device_id=0, name=name: name)
    found[name] = defaults(1)
print(json.dumps(found))
"""


def test_vllms_own_code_picks_the_batch_limits_engine_servers_names_for_every_catalog_device(vllm_python: Path) -> None:
    # the controller judges a vLLM pool's candidates, and the gateway marks its replicas saturated, as these
    gpus = [gpu for gpu in map(get_gpu, list_gpus()) if gpu.vendor != "cpu"]
    done = subprocess.run([str(vllm_python), "-c", _VLLM_DEFAULTS, json.dumps({gpu.name: gpu.hbm_gb for gpu in gpus})],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **install.QUIET_ENV}, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    cpu = get_gpu("cpu")
    assert found["cpu"] == [list(vllm_batch_defaults(cpu, 1)), list(vllm_batch_defaults(cpu, 2))]
    assert {gpu.name: list(vllm_batch_defaults(gpu, 1)) for gpu in gpus} == {gpu.name: found[gpu.name] for gpu in gpus}
    assert found["gpu_memory_utilization"] == VLLM_GPU_MEMORY_UTILIZATION
    assert {tuple(found[gpu.name]) for gpu in gpus} == {(256, 2048), (1024, 8192), (1024, 16384)}  # every row is used


def test_vllm_pool_arguments_pass_vllms_own_parser(vllm_python: Path, tiny_hf: Path) -> None:
    """vLLM's parser (each call imports vLLM: tens of seconds) takes a pool's command line with LoRA adapters
    and the operator's flags, and names the flag it rejects."""
    launch = EngineLaunch("vllm", served_model_name="tiny-llama", adapters=ADAPTERS, extra_args=("--seed", "7", "--max-lora-rank", "8"))
    assert argument_problems(launch, CONFIG, "cpu") == []
    problems = argument_problems(EngineLaunch("vllm", extra_args=("--max-model-len", "many")), CONFIG, "cpu")
    assert len(problems) == 1 and "--max-model-len" in problems[0] and problems[0].startswith("vllm rejects the arguments")


def test_vllm_runs_the_rendered_command_line_on_its_cores_with_its_pool(vllm_python: Path, tiny_hf: Path, tmp_path: Path) -> None:
    """The pool's command line starts a real vLLM that serves the SDK, and the Responses API through a gateway
    (one vLLM start for both: each takes 40 s to minutes here)."""
    launch = EngineLaunch("vllm", served_model_name="tiny-llama")
    config = EngineConfig(max_running_requests=4, page_size=32, max_total_tokens=4000)  # 125 blocks of 32 tokens
    argv = launch_argv(launch, config, "cpu")
    assert argv[0] == str(install.vllm_python())
    port = free_port()
    log = tmp_path / "vllm.log"
    proc = start([*argv[1:], "--host", "127.0.0.1", "--port", str(port)], port, log, "/health",
                 command=argv[:1], timeout_s=VLLM_START_TIMEOUT_S, env=launch_env(launch, "cpu", ("0",)))
    try:
        chat_both_ways(proc.url)  # the pool's command line serves the tiny model through the SDK, plain and streamed
        _responses_through_a_gateway(proc.url, tmp_path)
        with urllib.request.urlopen(proc.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    finally:
        proc.stop()
    assert "vllm:num_requests_running" in metrics
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'num_gpu_blocks="125"' in info and 'block_size="32"' in info and 'kv_cache_size_tokens="4000"' in info
    assert "core ids=[0]" in log.read_text()  # its OpenMP threads stay on the replica's core


def _responses_through_a_gateway(vllm_url: str, tmp_path: Path) -> None:
    """A gateway in front of the real vLLM: the SDK's Responses API, plain and streamed, a follow-up naming the
    previous response and its retrieval reach it with routing headers; embeddings, which a generating model does
    not serve, get vLLM's own answer."""
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    write_tenant(tenants, "main", "sk-launch", rate_limits={"requests_per_min": 100000})
    config = {"server": {"host": "127.0.0.1"}, "tenants_dir": "tenants",
              "fleet": {"pools": [{"name": "vllm", "model": "tiny-llama", "engine": {"kind": "vllm"}, "replicas": {"urls": [vllm_url]}}]}}
    (tmp_path / "gateway.yaml").write_text(json.dumps(config))
    gateway = start_gateway(tmp_path, ["--config", str(tmp_path / "gateway.yaml")])
    try:
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-launch", max_retries=0, timeout=120) as client:
            first = client.responses.with_raw_response.create(model="tiny-llama", input="Name a colour.", max_output_tokens=8)
            assert first.headers["x-polymorph-pool"] == "vllm" and first.headers["x-polymorph-replica"] == "vllm-0"
            answer = first.parse()
            assert answer.usage is not None and answer.usage.output_tokens > 0
            events = [e.type for e in client.responses.create(model="tiny-llama", input="And another?", previous_response_id=answer.id,
                                                               max_output_tokens=8, stream=True)]
            assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
            assert client.responses.retrieve(answer.id).id == answer.id
            with pytest.raises(openai.NotFoundError):
                client.embeddings.create(model="tiny-llama", input="a text")
    finally:
        gateway.stop()


def test_a_pools_adapters_are_rendered_as_each_engine_loads_lora_modules() -> None:
    vllm = launch_argv(EngineLaunch("vllm", command=("python",), model_path="/m", served_model_name="base", adapters=ADAPTERS), CONFIG, "H100")
    assert "--enable-lora" in vllm and _value(vllm, "--max-loras") == "2"
    modules = [json.loads(item) for item in vllm[vllm.index("--lora-modules") + 1:vllm.index("--max-loras")]]
    assert modules == [{"name": "sql-lora", "path": "/adapters/sql", "base_model_name": "base"},
                       {"name": "chat-lora", "path": "/adapters/chat,v2", "base_model_name": "base"}]  # JSON carries the comma
    sglang = launch_argv(EngineLaunch("sglang", model_path="/m", adapters=ADAPTERS), CONFIG, "H100")
    paths = sglang.index("--lora-paths")
    assert "--enable-lora" in sglang and sglang[paths + 1:paths + 3] == ("sql-lora=/adapters/sql", "chat-lora=/adapters/chat,v2")
    assert EngineConfig.from_sglang_args(sglang) == CONFIG  # the adapters leave the engine configuration as it was
    assert "--enable-lora" not in launch_argv(EngineLaunch("vllm", command=("python",), model_path="/m"), CONFIG, "H100")


def test_sglang_pool_with_adapters_passes_sglangs_own_parser() -> None:
    from tests.kernels.compiler.test_compiler_sglang_parser import MODEL_PATH, _sglang_python

    python = _sglang_python()
    if python is None:
        pytest.skip("no sglang environment (see tests/kernels/compiler/test_compiler_sglang_parser.py)")
    launch = EngineLaunch("sglang", command=(python,), model_path=MODEL_PATH, adapters=ADAPTERS)
    assert argument_problems(launch, CONFIG, "H100") == []
