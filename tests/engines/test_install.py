"""The cached CPU engines and the tiny model: installed once, and really served by llama.cpp (vLLM serves
it through the SDK in tests/engines/test_launch.py, started from the command line a pool renders)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

from fleet.engines import install
from fleet.engines.tiny_model import TinyLlamaShape, read_tokenizer, write_tiny_llama
from tests.conftest import REPO
from tests.support.engines import chat_both_ways, llama_server
from tests.support.procs import POLYMORPH


def test_installers_return_the_cached_path_and_do_nothing_the_second_time(llama_server_bin: Path, tiny_gguf: Path) -> None:
    lines: list[str] = []
    assert install.llamacpp_server(lines.append) == llama_server_bin
    assert install.tiny_model_gguf(lines.append) == tiny_gguf
    assert lines == []  # no phase ran: nothing was built, downloaded or waited for
    assert llama_server_bin.is_file() and tiny_gguf.is_file()
    assert not list(tiny_gguf.parent.parent.glob(".*.tmp-*"))  # no staging folder left beside the model


def test_vllm_installers_return_the_cached_path_and_do_nothing_the_second_time(vllm_python: Path, tiny_hf: Path) -> None:
    lines: list[str] = []
    assert install.vllm_python(lines.append) == vllm_python
    assert install.tiny_model_hf(lines.append) == tiny_hf
    assert lines == []
    config = json.loads((tiny_hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (6, 384, 2)
    assert (tiny_hf / "tokenizer.json").is_file() and list(tiny_hf.glob("*.safetensors"))


def test_two_processes_installing_at_once_build_once_and_clear_a_killed_build(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # The source package is already downloaded (the tiny_gguf fixture needed it): copy it into the fresh cache.
    sdist = install.cache_dir() / "downloads" / f"llama_cpp_python-{install.LLAMACPP_VERSION}"
    shutil.copytree(sdist, cache / "downloads" / sdist.name)
    killed = cache / "models" / f".{tiny_gguf.parent.name}.tmp-999999"  # what a build killed mid-way leaves
    killed.mkdir(parents=True)
    (killed / "half-written.gguf").write_bytes(b"GGUF")

    env = {**os.environ, "POLYMORPH_CACHE": str(cache)}
    code = "from fleet.engines import install; print(install.tiny_model_gguf())"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    paths = {Path(out.strip()) for out, _ in outputs}
    assert paths == {cache / "models" / tiny_gguf.parent.name / tiny_gguf.name}
    writers = [err for _, err in outputs if "writing the random-weight GGUF: done" in err]
    assert len(writers) == 1, outputs  # the other waited on the lock and found it done
    assert paths.pop().read_bytes() == tiny_gguf.read_bytes()  # seeded: the same bytes in any process
    assert not killed.exists()
    assert sorted(p.name for p in (cache / "models").iterdir()) == [tiny_gguf.parent.name]


def test_engines_status_command_prints_the_cache_as_json(llama_server_bin: Path, tiny_gguf: Path) -> None:
    out = subprocess.run([*POLYMORPH, "engines", "status", "--json"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    status = json.loads(out)
    assert status["cache_dir"] == str(install.cache_dir())
    by_name = {entry["name"]: entry for entry in status["entries"]}
    for name, path in (("llama-server", llama_server_bin), ("tiny-model-gguf", tiny_gguf)):
        assert by_name[name]["installed"] and by_name[name]["path"] == str(path)
        assert by_name[name]["size_bytes"] >= path.stat().st_size


def test_the_tiny_model_is_the_same_for_a_seed_and_carries_the_llama_tokenizer(tiny_gguf: Path, tmp_path: Path) -> None:
    tokenizer = read_tokenizer(tiny_gguf)  # the tiny model carries the tokenizer fields it was written with
    tokens = next(field.value for field in tokenizer if field.key == "tokenizer.ggml.tokens")
    assert len(tokens) == 32000 and tokens[:3] == ["<unk>", "<s>", "</s>"]
    small = TinyLlamaShape(num_layers=1, width=64, num_heads=2, num_kv_heads=1, ffn_width=128)
    paths = [tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "other-seed.gguf"]
    for path, seed in zip(paths, (0, 0, 1)):
        write_tiny_llama(path, tokenizer, "t", seed=seed, shape=small)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def test_llama_server_serves_the_tiny_model_through_the_openai_sdk(llama_server_bin: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    with llama_server(llama_server_bin, tiny_gguf, "--metrics", log_path=tmp_path / "llama-server.log") as server:
        chat_both_ways(server.url)
        metrics = _metrics(server.url)
    assert "llamacpp:requests_processing" in metrics
    assert "llamacpp:tokens_predicted_total" in metrics
