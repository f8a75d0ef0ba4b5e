"""Config and tenant files: the example loads; every mistake names file, line, field and reason."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fleet.drift import DriftSettings
from gateway.config import load_config, sha256_hex
from kernels.yamlsrc import ConfigError
from loadtest.demo_credentials import DEMO_API_KEY
from tests.conftest import REPO


def _copy_example(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "config.example.yaml", tmp_path / "config.yaml")
    shutil.copytree(REPO / "tenants", tmp_path / "tenants")
    return tmp_path / "config.yaml"


def test_example_config_loads_with_demo_tenant_and_shapes() -> None:
    config = load_config(REPO / "config.example.yaml")
    demo = {t.name: t for t in config.tenants}["demo"]
    assert sha256_hex(DEMO_API_KEY) in demo.key_sha256
    assert config.server.admin_token_sha256 == sha256_hex("polymorph-admin-demo")
    assert {"short-chat", "long-context", "reasoning", "batch"} <= set(config.shapes.names)
    assert [p.name for p in config.pools] == ["chat-h100", "long-h200"]
    assert all(p.num_launched > 0 for p in config.pools)


def _error_for(tmp_path: Path, old: str, new: str) -> ConfigError:
    path = _copy_example(tmp_path / old.strip().replace(" ", "_").replace(":", "").replace("/", ""))
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value


def _line_of(path: Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def test_wrong_type_names_file_line_and_field(tmp_path: Path) -> None:
    err = _error_for(tmp_path, "max_attempts: 3", "max_attempts: three")
    assert err.file.endswith("config.yaml")
    assert err.field == "upstream.max_attempts"
    assert err.line == _line_of(Path(err.file), "max_attempts: three")
    assert "integer" in err.reason


def test_unknown_field_is_rejected_with_its_line(tmp_path: Path) -> None:
    err = _error_for(tmp_path, "  connect_timeout_s: 2.0", "  connect_timeout: 2.0")
    assert err.field == "upstream.connect_timeout"
    assert err.line == _line_of(Path(err.file), "connect_timeout: 2.0")
    assert "unknown field" in err.reason


def test_yaml_syntax_error_has_a_line(tmp_path: Path) -> None:
    err = _error_for(tmp_path, "server:\n", "server: [\n")
    assert err.line is not None and "invalid YAML" in err.reason


def test_a_key_given_twice_names_both_lines_in_the_config_and_in_a_tenant_file(tmp_path: Path) -> None:
    # PyYAML keeps the last of two equal keys silently: a second `max_attempts` would win unseen
    err = _error_for(tmp_path, "  max_attempts: 3", "  max_attempts: 3\n  max_attempts: 1")
    assert err.field == "upstream.max_attempts"
    assert err.line == _line_of(Path(err.file), "max_attempts: 1")
    assert err.reason == f"duplicate key (first given on line {_line_of(Path(err.file), 'max_attempts: 3')})"
    path = _copy_example(tmp_path / "tenant")
    tenant = tmp_path / "tenant" / "tenants" / "demo.yaml"
    tenant.write_text(tenant.read_text() + "default_tier: batch\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.file.endswith("demo.yaml") and info.value.field == "default_tier"
    assert info.value.line == _line_of(tenant, "default_tier: batch")


def test_recursive_anchors_and_deep_nesting_are_config_errors_not_a_crash(tmp_path: Path) -> None:
    err = _error_for(tmp_path, "upstream:\n", "upstream: &up\n  itself: *up\n")
    assert err.field == "upstream.itself" and "unknown field" in err.reason
    path = tmp_path / "deep.yaml"
    path.write_text("server: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(path)


def test_unknown_shape_in_pool_and_unknown_gpu(tmp_path: Path) -> None:
    err = _error_for(tmp_path, "shapes: [short-chat, batch]", "shapes: [short-chat, tiny]")
    assert err.field == "fleet.pools[0].shapes[1]" and "'tiny'" in str(err)
    err = _error_for(tmp_path, "gpu: H100-SXM", "gpu: Z9000")
    assert err.field == "fleet.pools[0].gpu"


def test_bad_engine_setting_is_reported_at_the_pool(tmp_path: Path) -> None:
    err = _error_for(tmp_path, "max_running_requests: 256", "max_running_requests: lots")
    assert err.field == "fleet.pools[0].engine"
    assert "max_running_requests" in err.reason


def test_tenant_file_errors_name_the_tenant_file(tmp_path: Path) -> None:
    path = _copy_example(tmp_path)
    tenant = tmp_path / "tenants" / "demo.yaml"
    tenant.write_text(tenant.read_text().replace("default_tier: standard", "default_tier: gold"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.file.endswith("demo.yaml")
    assert info.value.field == "default_tier"
    assert info.value.line == _line_of(tenant, "default_tier: gold")


def test_plaintext_key_instead_of_hash_is_refused(tmp_path: Path) -> None:
    path = _copy_example(tmp_path)
    tenant = tmp_path / "tenants" / "demo.yaml"
    tenant.write_text(tenant.read_text().replace(sha256_hex(DEMO_API_KEY), DEMO_API_KEY))
    with pytest.raises(ConfigError, match="SHA-256"):
        load_config(path)


def test_duplicate_key_hash_across_tenants(tmp_path: Path) -> None:
    path = _copy_example(tmp_path)
    text = (tmp_path / "tenants" / "demo.yaml").read_text().replace("name: demo", "name: other")
    (tmp_path / "tenants" / "other.yaml").write_text(text)
    with pytest.raises(ConfigError, match="also listed by tenant"):
        load_config(path)


def test_real_engine_pools_and_devices_load() -> None:
    config = load_config(REPO / "examples" / "cpu-llamacpp.yaml")
    assert [(p.name, p.engine_kind, p.num_launched, p.launch.threads, p.launch.served_model_name) for p in config.pools] == [
        ("chat-cpu", "llamacpp", 1, 1, "tiny-llama"), ("long-cpu", "llamacpp", 1, 1, "tiny-llama")]
    assert "kind" not in config.pools[0].engine  # launch keys are not engine knobs
    assert config.devices == {"cpu": ("0", "1", "2", "3")}
    vllm = load_config(REPO / "examples" / "cpu-vllm.yaml")
    assert {p.engine_kind for p in vllm.pools} == {"vllm"}


def _example_with(tmp_path: Path, old: str, new: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = (REPO / "examples" / "cpu-llamacpp.yaml").read_text()
    assert old in text, old
    path = tmp_path / "cpu.yaml"
    path.write_text(text.replace(old, new, 1).replace("tenants_dir: ../tenants", f"tenants_dir: {REPO / 'tenants'}"))
    return path


@pytest.mark.parametrize(("old", "new", "field", "reason", "line_with"), [
    ("kind: llamacpp, threads: 1, max_running_requests: 4", "kind: tgi, max_running_requests: 4",
     "fleet.pools[0].engine.kind", "must be one of", "kind: tgi"),
    ("replicas: { launch: 1 }", "replicas: { emulated: 1 }", "fleet.pools[0].replicas.emulated", "launch: N", "emulated: 1"),
    ("cpu: { count: 4 }", "cpu: { count: 1 }", "fleet.devices", "2 cpu devices; 1 declared", "devices:"),
    ("cpu: { count: 4 }", "cpu: { ids: [] }", "fleet.devices.cpu.ids", "non-empty", "ids: []"),
    ("threads: 1, max_running_requests: 4", "threads: 0, max_running_requests: 4", "fleet.pools[0].engine.threads", "between", "threads: 0"),
])
def test_bad_engine_launch_settings_name_file_line_and_field(tmp_path: Path, old: str, new: str, field: str, reason: str, line_with: str) -> None:
    path = _example_with(tmp_path, old, new)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == field
    assert reason in info.value.reason
    assert info.value.line == _line_of(path, line_with)


@pytest.mark.parametrize("url", ["ftp://10.0.0.5:30000", "http://10.0.0.5:port", "10.0.0.5:30000"])
def test_a_replica_url_that_is_not_http_names_its_line(tmp_path: Path, url: str) -> None:
    """The same check as `serve --upstream`'s (kernels.argtypes.is_http_url): a port that is not a number
    is refused here, not at the first request."""
    err = _error_for(tmp_path, "replicas: { emulated: 2 }", f"replicas: {{ urls: ['{url}'] }}")
    assert err.field == "fleet.pools[0].replicas.urls[0]"
    assert err.line == _line_of(Path(err.file), url) and "not an http(s) URL" in err.reason


def test_a_gpu_alias_is_its_catalog_kind_in_pools_and_devices(tmp_path: Path) -> None:
    """Before, a pool on `H100` and one on `H100-SXM` were two kinds to the controller, and `devices: {H100: ...}`
    did not count for a pool on `H100-SXM`."""
    path = _copy_example(tmp_path / "alias")
    text = path.read_text().replace("gpu: H200", "gpu: h100").replace("  emulator_speed: 1.0", "  devices: { H100: { count: 4 } }\n  emulator_speed: 1.0", 1)
    path.write_text(text)
    config = load_config(path)
    assert {p.gpu for p in config.pools} == {"H100-SXM"} and config.devices == {"H100-SXM": ("0", "1", "2", "3")}
    path.write_text(text.replace("devices: { H100: { count: 4 } }", "devices: { H100: { count: 4 }, H100-SXM: { count: 4 } }"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == "fleet.devices.H100-SXM" and "already declared" in info.value.reason
    path.write_text(text.replace("devices: { H100: { count: 4 } }", "devices: { Z80: { count: 4 } }"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == "fleet.devices.Z80" and "Z80" in info.value.reason


def test_router_settings_are_read_and_a_bad_one_names_its_line(tmp_path: Path) -> None:
    assert load_config(REPO / "config.example.yaml").router.good_chance == 0.9
    err = _error_for(tmp_path, "  good_chance: 0.9", "  good_chance: 1.5")
    assert err.field == "router.good_chance" and "between 0 and 1" in err.reason
    assert err.line == _line_of(Path(err.file), "good_chance: 1.5")
    err = _error_for(tmp_path, "  urgent_reserve: 0.0", "  urgent_reserve: 1.0")
    assert err.field == "router.urgent_reserve" and "between 0 and 0.9" in err.reason


def test_rebalance_min_gain_out_of_range_names_its_field(tmp_path: Path) -> None:
    err = _error_for(tmp_path, "    tick_s: 5.0\n", "    tick_s: 5.0\n    rebalance_min_gain: 1.5\n")
    assert err.field == "fleet.controller.rebalance_min_gain"
    assert err.line == _line_of(Path(err.file), "rebalance_min_gain: 1.5")
    assert "0.99" in err.reason


def test_the_controllers_timings_are_read_and_a_strong_dwell_or_a_warmup_longer_than_the_window_names_its_line(tmp_path: Path) -> None:
    path = _copy_example(tmp_path / "ok")
    path.write_text(path.read_text().replace("    tick_s: 5.0\n", "    tick_s: 5.0\n    window_s: 30\n    verify_after_s: 10\n    backoff_s: 60\n"
                                             "    drift: {warmup_s: 10, dwell_s: 6, strong_dwell_s: 4, min_interval_s: 20}\n", 1))
    settings = load_config(path).controller
    assert (settings.window_s, settings.verify_after_s, settings.backoff_s) == (30, 10, 60)
    drift = settings.drift
    assert (drift.warmup_s, drift.dwell_s, drift.strong_dwell_s, drift.min_interval_s) == (10, 6, 4, 20)
    assert drift.divergence_threshold == DriftSettings().divergence_threshold  # what is not given keeps its default
    err = _error_for(tmp_path, "    tick_s: 5.0\n", "    tick_s: 5.0\n    drift:\n      dwell_s: 5\n      strong_dwell_s: 8\n")
    assert err.field == "fleet.controller.drift.strong_dwell_s" and "at most dwell_s" in err.reason
    assert err.line == _line_of(Path(err.file), "strong_dwell_s: 8")
    err = _error_for(tmp_path / "window", "    tick_s: 5.0\n", "    tick_s: 5.0\n    window_s: 2\n")
    assert err.field == "fleet.controller.window_s" and "between 5 and" in err.reason
    # a window holds at most window_s of traffic: a longer warm-up would never end, and nothing would be planned
    err = _error_for(tmp_path / "warmup", "    tick_s: 5.0\n", "    tick_s: 5.0\n    window_s: 30\n    drift: {warmup_s: 45}\n")
    assert err.field == "fleet.controller.drift.warmup_s" and "at most fleet.controller.window_s (30" in err.reason
    assert err.line == _line_of(Path(err.file), "drift: {warmup_s: 45}")
    short = _copy_example(tmp_path / "short")
    short.write_text(short.read_text().replace("    tick_s: 5.0\n", "    tick_s: 5.0\n    window_s: 30\n", 1))
    assert load_config(short).controller.drift.warmup_s == 30  # the default warm-up (60 s) shortened to the window
