"""`polymorph kernels add-model --hf-config config.json`: a model in the user's catalog, usable by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

POLYMORPH = [sys.executable, "-m", "gateway.cli"]
# Qwen3-30B-A3B's published config.json (the keys the parser reads), under a name the built-in catalog does not have.
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
             "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
             "tie_word_embeddings": False}


def _polymorph(catalog: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "POLYMORPH_MODEL_CATALOG": str(catalog)}
    return subprocess.run([*POLYMORPH, *args], capture_output=True, text=True, timeout=60, check=False, env=env)


def test_an_added_model_is_kept_in_the_user_catalog_and_predicted_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "acme-moe-30b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_MOE))
    catalog = tmp_path / "models.yaml"
    done = _polymorph(catalog, "kernels", "add-model", "--hf-config", str(folder), "--json")
    assert done.returncode == 0, done.stderr
    added = json.loads(done.stdout)
    assert added["name"] == "acme-moe-30b" and added["catalog"] == str(catalog)  # the folder's name by default
    assert (added["num_layers"], added["hidden_size"], added["num_heads"], added["num_kv_heads"], added["head_dim"]) == (48, 2048, 32, 4, 128)
    assert (added["vocab_size"], added["num_experts"], added["num_experts_per_tok"], added["moe_intermediate_size"]) == (151936, 128, 8, 768)
    stored = yaml.safe_load(catalog.read_text())
    assert stored["acme-moe-30b"]["num_experts"] == 128 and "add-model" in stored["acme-moe-30b"]["source"]

    done = _polymorph(catalog, "kernels", "add-model", "--hf-config", str(folder / "config.json"), "--name", "my-moe")
    assert done.returncode == 0, done.stderr
    assert "added my-moe" in done.stdout and "128 experts" in done.stdout and "30.5B parameters" in done.stdout
    assert set(yaml.safe_load(catalog.read_text())) == {"acme-moe-30b", "my-moe"}

    done = _polymorph(catalog, "kernels", "predict", "--model", "my-moe", "--gpu", "H100", "--isl", "512", "--osl", "32",
                      "--concurrency", "2", "--json")
    assert done.returncode == 0, done.stderr
    predicted = json.loads(done.stdout)
    assert predicted["model"] == "my-moe" and predicted["tpot_p50_s"] > 0


def test_add_model_refuses_what_it_cannot_add(tmp_path: Path) -> None:
    catalog = tmp_path / "models.yaml"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_MOE))
    done = _polymorph(catalog, "kernels", "add-model", "--hf-config", str(config), "--name", "llama-3.1-8b")
    assert done.returncode != 0 and "built-in model" in done.stderr and "Traceback" not in done.stderr
    config.write_text(json.dumps({"vocab_size": 32000}))
    done = _polymorph(catalog, "kernels", "add-model", "--hf-config", str(config), "--name", "broken")
    assert done.returncode != 0 and "lacks hidden_size" in done.stderr and "Traceback" not in done.stderr
    # before: a ZeroDivisionError traceback, int()'s "invalid literal" without the key, and a context of -5 added
    for change, says in (({"num_attention_heads": 0}, "num_attention_heads must be at least 1, not 0"),
                         ({"hidden_size": "wide"}, "hidden_size must be a whole number, not 'wide'"),
                         ({"max_position_embeddings": -5}, "max_position_embeddings must be at least 1"),
                         ({"num_key_value_heads": 2.5}, "num_key_value_heads must be a whole number")):
        config.write_text(json.dumps({**QWEN3_MOE, **change}))
        done = _polymorph(catalog, "kernels", "add-model", "--hf-config", str(config), "--name", "broken")
        assert done.returncode != 0 and f"{config}: {says}" in done.stderr and "Traceback" not in done.stderr, done.stderr
    config.write_text("[1, 2]")
    done = _polymorph(catalog, "kernels", "add-model", "--hf-config", str(config), "--name", "broken")
    assert done.returncode != 0 and f"{config}: the config is not a JSON object" in done.stderr and "Traceback" not in done.stderr, done.stderr
    config.write_text("{")
    done = _polymorph(catalog, "kernels", "add-model", "--hf-config", str(config), "--name", "broken")
    assert done.returncode != 0 and f"{config} is not JSON" in done.stderr and "Traceback" not in done.stderr, done.stderr
    done = _polymorph(catalog, "kernels", "add-model", "--hf-config", str(tmp_path / "absent"))
    assert done.returncode != 0 and "no config.json" in done.stderr
    assert not catalog.exists()  # nothing was written
    done = _polymorph(catalog, "kernels", "predict", "--model", "my-moe", "--gpu", "H100", "--isl", "8", "--osl", "8")
    assert done.returncode != 0 and "add-model" in done.stderr


def test_a_hand_edited_entry_with_a_wrong_field_is_an_error_with_its_line(tmp_path: Path) -> None:
    catalog = tmp_path / "models.yaml"
    for text, says in (("my-model:\n  num_layers: 32\n  hidden_size: lots\n", ":3: my-model.hidden_size: must be an integer"),
                       ("my-model:\n  num_layers: 32\n", ":1: my-model.hidden_size: required"),
                       ("my-model:\n  num_layers: 0\n", ":2: my-model.num_layers: must be between 1 and inf"),
                       ("my-model:\n  colour: red\n", ":2: my-model.colour: unknown field"),
                       ("- my-model\n", ":1: the user model catalog must be a mapping")):
        catalog.write_text(text)  # each was a TypeError from ModelSpec, wherever the model was first used
        done = _polymorph(catalog, "kernels", "predict", "--model", "my-model", "--gpu", "H100", "--isl", "8", "--osl", "8")
        assert done.returncode != 0 and f"{catalog}{says}" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_predict_warns_of_a_configuration_an_engine_would_refuse_and_of_requests_past_the_context(tmp_path: Path) -> None:
    base = ("kernels", "predict", "--model", "llama-3.1-8b", "--gpu", "H100", "--osl", "8", "--json")
    done = _polymorph(tmp_path / "none.yaml", *base, "--isl", "8", "--set", "tp=3")
    assert done.returncode == 0 and json.loads(done.stdout)["num_gpus"] == 3  # predicted all the same
    assert "warning: tp 3 does not divide the 32 attention heads" in done.stderr
    done = _polymorph(tmp_path / "none.yaml", *base, "--isl", "200000")
    assert done.returncode == 0 and "exceed Llama-3.1-8B's context of 131072 tokens" in done.stderr
    done = _polymorph(tmp_path / "none.yaml", *base, "--isl", "8")
    assert done.returncode == 0 and "warning" not in done.stderr


def test_predict_reads_set_over_config_under_any_spelling_and_refuses_a_knob_set_twice_or_a_misspelt_domain(tmp_path: Path) -> None:
    catalog = tmp_path / "models.yaml"
    config = tmp_path / "engine.yaml"
    config.write_text("tp: 2\n")
    base = ("kernels", "predict", "--model", "llama-3.1-8b", "--gpu", "H100", "--isl", "64", "--osl", "8", "--json")
    done = _polymorph(catalog, *base, "--config", str(config), "--set", "tp_size=1")  # --set overrides, in vLLM's spelling too
    assert done.returncode == 0, done.stderr
    # before: the last of two --set tp won silently, and a misspelt domain was predicted as chat
    for extra, says in ((("--set", "tp=2", "--set", "tp=4"), "--set tp is tp, set already"),
                        (("--domain", "cdoe"), "argument --domain: invalid choice: 'cdoe'")):
        done = _polymorph(catalog, *base, *extra)
        assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
