"""EngineConfig: validation, dict and command-line round trips."""

from __future__ import annotations

import pytest

from kernels.config import EngineConfig, SglangTarget

_RICH = EngineConfig(
    tp=4, dp=2, max_running_requests=256, chunked_prefill_size=4096, max_prefill_tokens=8192, schedule_policy="lpm",
    kv_cache_dtype="fp8_e4m3", quantization="fp8", cuda_graph_max_bs=128, page_size=16, mem_fraction_static=0.85,
    enable_prefix_caching=False, speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_num_draft_tokens=4,
    max_total_tokens=65536,
)


def test_defaults_are_sglangs() -> None:
    config = EngineConfig()
    assert (config.tp, config.max_prefill_tokens, config.schedule_policy, config.kv_cache_dtype, config.page_size) == (1, 16384, "fcfs", "auto", 1)
    assert config.enable_prefix_caching and config.speculative_algorithm is None


def test_from_dict_accepts_aliases_and_strings() -> None:
    config = EngineConfig.from_dict({"tp_size": "2", "max-num-seqs": 64, "enable_prefix_caching": "false"})
    assert (config.tp, config.max_running_requests, config.enable_prefix_caching) == (2, 64, False)


@pytest.mark.parametrize(("values", "key"), [({"tpp": 2}, "tpp"), ({"tp": "two"}, "tp"), ({"tp": True}, "tp"), ({"mem_fraction_static": "x"}, "mem_fraction_static")])
def test_from_dict_names_the_bad_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        EngineConfig.from_dict(values)


def test_one_knob_given_under_two_spellings_is_refused() -> None:
    for values in ({"tp": 2, "tp_size": 4}, {"max_running_requests": 8, "max-num-seqs": 16}):  # before, the later won
        with pytest.raises(ValueError, match="already given as"):
            EngineConfig.from_dict(values)


def test_invalid_choice_is_rejected() -> None:
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(schedule_policy="sjf")


def test_dict_round_trip() -> None:
    assert EngineConfig.from_dict(_RICH.to_dict()) == _RICH


def test_sglang_round_trip() -> None:
    args = _RICH.to_sglang_args("meta-llama/Llama-3.1-8B-Instruct")
    assert args[:2] == ["--model-path", "meta-llama/Llama-3.1-8B-Instruct"]
    assert "--disable-radix-cache" in args and args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert EngineConfig.from_sglang_args(args) == _RICH
    assert EngineConfig.from_sglang_args(" ".join(EngineConfig().to_sglang_args("m")) + " --port 30000") == EngineConfig()


@pytest.mark.parametrize(("target", "flag"), [
    (None, "--cuda-graph-max-bs"),  # no release known: the widely deployed spelling
    (SglangTarget(version="0.4.6.post5"), "--cuda-graph-max-bs"),
    (SglangTarget(version="0.5.23"), "--cuda-graph-max-bs-decode"),
    (SglangTarget(version="0.6.0rc1"), "--cuda-graph-max-bs-decode"),
    (SglangTarget(version="nightly"), "--cuda-graph-max-bs"),
    # the parser's own flags outrank the version
    (SglangTarget(version="0.5.23", option_strings=frozenset({"--cuda-graph-max-bs"})), "--cuda-graph-max-bs"),
    (SglangTarget(option_strings=frozenset({"--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill"})), "--cuda-graph-max-bs-decode"),
])
def test_sglang_rendering_follows_the_target_release(target: SglangTarget | None, flag: str) -> None:
    config = EngineConfig(max_running_requests=128, cuda_graph_max_bs=96)
    args = config.to_sglang_args("m", target)
    assert args[args.index(flag) + 1] == "96"
    assert [a for a in args if a.startswith("--cuda-graph")] == [flag]
    assert EngineConfig.from_sglang_args(args) == config
    # flags no release renamed are spelled the same for every target
    assert [a for a in args if not a.startswith("--cuda-graph")] == [a for a in config.to_sglang_args("m") if not a.startswith("--cuda-graph")]


def test_vllm_round_trip_of_what_vllm_can_express() -> None:
    config = EngineConfig.from_dict({**_RICH.to_dict(), "schedule_policy": "fcfs"})
    args = config.to_vllm_args("m")
    assert args[:2] == ["serve", "m"] and "--no-enable-prefix-caching" in args
    back = EngineConfig.from_vllm_args(args)
    assert back == EngineConfig.from_dict({**config.to_dict(), "max_prefill_tokens": 16384})


def test_max_total_tokens_renders_as_each_engines_pool_bound() -> None:
    config = EngineConfig(max_total_tokens=1000, page_size=16)
    sglang = config.to_sglang_args("m")
    assert sglang[sglang.index("--max-total-tokens") + 1] == "1000"
    vllm = config.vllm_flags()
    assert vllm[vllm.index("--num-gpu-blocks-override") + 1] == "63"  # 1000 tokens in 16-token blocks, rounded up
    assert EngineConfig.from_vllm_args(config.to_vllm_args("m")).max_total_tokens == 1008
    assert "--num-gpu-blocks-override" not in EngineConfig().vllm_flags()  # unset: vLLM sizes the pool from memory
    # sglang's 1-token pages: vLLM picks its block size per platform (none takes 1), so no block count either
    assert not {"--block-size", "--num-gpu-blocks-override"} & set(EngineConfig(max_total_tokens=1000).vllm_flags())
    assert EngineConfig.from_vllm_args(EngineConfig().to_vllm_args("m")) == EngineConfig()
    with pytest.raises(ValueError, match="max_total_tokens"):
        EngineConfig(max_total_tokens=0)


def test_vllm_flags_are_the_serve_arguments_without_the_model() -> None:
    assert _RICH.to_vllm_args("org/model") == ["serve", "org/model", *_RICH.vllm_flags()]
    assert "org/model" not in _RICH.vllm_flags()


def test_priority_scheduling_runs_lower_values_first_on_every_engine() -> None:
    config = EngineConfig(schedule_policy="priority")
    vllm = config.vllm_flags()
    assert vllm[vllm.index("--scheduling-policy") + 1] == "priority"  # vLLM: lower values first
    sglang = config.to_sglang_args("m")
    # sglang orders by priority only with the switch (under fcfs: its scheduler has no "priority"
    # policy), higher values first unless told otherwise
    assert sglang[sglang.index("--schedule-policy") + 1] == "fcfs"
    assert {"--enable-priority-scheduling", "--schedule-low-priority-values-first"} <= set(sglang)
    assert EngineConfig.from_sglang_args(sglang) == config
    assert not {"--enable-priority-scheduling", "--schedule-low-priority-values-first"} & set(EngineConfig().to_sglang_args("m"))
    # an operator's sglang line: fcfs with the switch is priority scheduling; lpm ignores priorities
    assert EngineConfig.from_sglang_args("--model-path m --enable-priority-scheduling --port 1").schedule_policy == "priority"
    assert EngineConfig.from_sglang_args("--enable-priority-scheduling --schedule-policy lpm").schedule_policy == "lpm"


def test_llamacpp_round_trip_of_what_llama_server_can_express() -> None:
    config = EngineConfig(max_running_requests=8, chunked_prefill_size=256, max_total_tokens=4096, enable_prefix_caching=False)
    args = config.to_llamacpp_args("/models/tiny.gguf")
    assert args[:2] == ["-m", "/models/tiny.gguf"] and "--kv-unified" in args  # one pool the slots share
    assert [args[args.index(f) + 1] for f in ("--parallel", "-c", "-b", "-ub")] == ["8", "4096", "256", "256"]
    assert "--no-cache-prompt" in args and "--cache-reuse" not in args
    assert "--no-cont-batching" not in args
    assert EngineConfig.from_llamacpp_args(args) == config
    # knobs llama-server has no equivalent for are dropped, not mistranslated
    assert EngineConfig.from_llamacpp_args(_RICH.to_llamacpp_args("m")) == EngineConfig(
        max_running_requests=256, chunked_prefill_size=4096, max_total_tokens=65536, enable_prefix_caching=False)


def test_llamacpp_defaults_are_llama_servers() -> None:
    args = EngineConfig().to_llamacpp_args("m")
    assert args == ["-m", "m", "--kv-unified", "--cache-reuse", "256"]
    assert EngineConfig.from_llamacpp_args(args) == EngineConfig()
    assert EngineConfig.from_llamacpp_args("-m m -c 0 -np -1 --metrics --port 8080") == EngineConfig()  # 0 and -1: llama's auto
    assert "-b" not in EngineConfig(chunked_prefill_size=-1).to_llamacpp_args("m")  # no chunking: its default batch
