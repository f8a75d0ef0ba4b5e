"""A gateway whose config and tenants are mounted the way the kubelet mounts a ConfigMap and a Secret
(deploy/kubernetes/gateway.yaml) reloads each update: the files are symlinks through ``..data`` into a
timestamped folder, and an update writes a new folder, swaps ``..data`` in one rename and deletes the old
folder. The layout is the base's: the config at <root>/polymorph/config.yaml, the tenants beside it in
<root>/polymorph-tenants (``tenants_dir: ../polymorph-tenants``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.support.procs import running, start_emulator, start_gateway

CONFIG = """
server: {{ host: 127.0.0.1, access_log: false }}
tenants_dir: ../polymorph-tenants
fleet:
  pools:
    - {{ name: chat, model: llama-3.1-8b, gpu: H100-SXM, replicas: {{ urls: ["{url}"] }} }}
"""


class KubeletVolume:
    """A folder as the kubelet's atomic writer keeps a ConfigMap or Secret volume."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True)
        self.generation = 0

    def write(self, files: dict[str, str]) -> None:
        self.generation += 1
        folder = self.root / f"..2025_01_01_00_00_{self.generation:02d}.000000001"
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
        old = (self.root / "..data").resolve() if (self.root / "..data").exists() else None
        (self.root / "..data_tmp").symlink_to(folder.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")
        for name in files:
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")
        for link in self.root.iterdir():  # a key that left the ConfigMap leaves the folder
            if link.is_symlink() and not link.name.startswith("..") and link.name not in files:
                link.unlink()
        if old is not None:
            shutil.rmtree(old)


def _tenant(name: str, key: str) -> str:
    return json.dumps({"name": name, "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]})


def _config_version(url: str) -> int:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        found = re.search(r"^polymorph_config_version (\S+)$", resp.read().decode(), re.M)
    assert found is not None
    return int(float(found.group(1)))


def _models_status(url: str, key: str) -> int:
    request = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


def test_updates_of_kubelet_mounted_config_and_tenants_are_reloaded(tmp_path: Path) -> None:
    replica = start_emulator(tmp_path, "replica")
    config, tenants = KubeletVolume(tmp_path / "etc" / "polymorph"), KubeletVolume(tmp_path / "etc" / "polymorph-tenants")
    config.write({"config.yaml": CONFIG.format(url=replica.url)})
    tenants.write({"first.yaml": _tenant("first", "sk-first")})
    gateway = start_gateway(tmp_path, ["--config", str(config.root / "config.yaml")])
    with running(gateway, replica):
        assert _config_version(gateway.url) == 1
        assert _models_status(gateway.url, "sk-first") == 200 and _models_status(gateway.url, "sk-second") == 401

        # a Secret update: a second tenant's file appears
        tenants.write({"first.yaml": _tenant("first", "sk-first"), "second.yaml": _tenant("second", "sk-second")})
        _until(lambda: _models_status(gateway.url, "sk-second") == 200, "the new tenant's key is accepted")
        assert _config_version(gateway.url) == 2
        time.sleep(2.5)  # two polls: before, the watcher saw the new file as a change of its own and reloaded again
        assert _config_version(gateway.url) == 2

        # a ConfigMap update: the config file's folder is replaced (the one the gateway started from is gone)
        config.write({"config.yaml": CONFIG.format(url=replica.url) + "aliases: { chat-model: llama-3.1-8b }\n"})
        _until(lambda: _config_version(gateway.url) == 3, "the new config version is served")
        assert "config reload rejected" not in gateway.log()
        # and again: each update deletes the folder the previous one wrote
        config.write({"config.yaml": CONFIG.format(url=replica.url)})
        _until(lambda: _config_version(gateway.url) == 4, "the next config version is served")
