"""Hardware and model catalogs: lookups, parameter counts, HF config parsing, calibration coverage."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kernels.calibration import scenario_for
from kernels.catalog import get_gpu, get_model, list_gpus, list_models


@pytest.mark.parametrize(
    ("alias", "name"),
    [("H200-SXM-141GB", "H200"), ("H100-SXM-80GB", "H100-SXM"), ("B200-180GB (DGX B200)", "B200"),
     ("GB200 (NVL72; doc lists 192GB)", "GB200"), ("a100-sxm4-80gb", "A100-80GB"), ("MI300X-192GB", "MI300X"), ("L40S-48GB", "L40S")],
)
def test_gpu_aliases_resolve(alias: str, name: str) -> None:
    assert get_gpu(alias).name == name


def test_unknown_gpu_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="known GPUs: .*H100-SXM"):
        get_gpu("TPU-v5e")
    with pytest.raises(ValueError, match="several GPUs"):
        get_gpu("H100/A100-80GB/L40S")


def test_every_gpu_has_a_source_and_price() -> None:
    for name in list_gpus():
        spec = get_gpu(name)
        assert spec.source and spec.price_per_gpu_hour > 0 and spec.hbm_tb_s > 0, name


def test_fp4_falls_back_to_fp8_on_hopper() -> None:
    h100 = get_gpu("H100")
    assert h100.peak_flops("fp4") == h100.peak_flops("fp8") == 1979e12
    assert get_gpu("A100").native_precision("fp8") == "bf16"


def test_parameter_counts_match_published_figures() -> None:
    for name in list_models():
        model = get_model(name)
        assert model.total_params / 1e9 == pytest.approx(model.published_params_b, rel=0.02), name
        if model.published_active_params_b:
            assert model.active_params / 1e9 == pytest.approx(model.published_active_params_b, rel=0.10), name


def test_deepseek_uses_compressed_mla_cache() -> None:
    deepseek = get_model("deepseek-ai/DeepSeek-R1-0528")
    assert deepseek.is_mla and deepseek.kv_elements_per_token == 61 * (512 + 64)


@pytest.mark.parametrize("alias", ["meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", "Llama-3.1-8B-Instruct (per paper)"])
def test_model_aliases_resolve(alias: str) -> None:
    assert get_model(alias).name == "Llama-3.1-8B"


def test_unknown_model_raises() -> None:
    with pytest.raises(ValueError, match="known models"):
        get_model("gpt-5")


def test_hf_config_json_is_parsed(tmp_path: Path) -> None:
    config = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
              "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
              "max_position_embeddings": 40960, "tie_word_embeddings": False}
    path = tmp_path / "my-moe" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    parsed = get_model(path.parent)
    reference = get_model("Qwen/Qwen3-30B-A3B")
    assert parsed.name == "my-moe"
    assert parsed.total_params == reference.total_params
    assert parsed.active_params == reference.active_params
    assert parsed.kv_elements_per_token == reference.kv_elements_per_token


def test_catalogs_cover_the_calibration_csv(shared_dir: Path) -> None:
    with (shared_dir / "calibration" / "calibration.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    unknown = set()
    for row in rows:
        if row["engine"].startswith("(simulator)") or "/" in row["gpu"] or "not stated" in row["gpu"]:
            continue  # not one model on one GPU
        for lookup, value in ((get_gpu, row["gpu"]), (get_model, row["model"])):
            try:
                lookup(value)
            except ValueError:
                unknown.add(value)
    assert not unknown
    assert sum(1 for row in rows if not isinstance(scenario_for(row), str)) > 450
