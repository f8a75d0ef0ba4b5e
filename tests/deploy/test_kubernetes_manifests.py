"""Polymorph's Kubernetes manifests: the kustomize base (deploy/kubernetes) and the engine pools that
`polymorph deploy kubernetes` renders, each built by `kubectl kustomize` and every document validated
against the Kubernetes 1.29 and 1.37 schemas (kubernetes-validate, strict: unknown fields fail), then held
to the contract the Kubernetes actuator reads: names, labels, annotations, GPUs, probes, drain, RBAC.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleet.engines.launch import EngineLaunch, launch_argv
from fleet.kubernetes_manifests import EnginePool, KubernetesSettings, deployment_name, pool_slug, render_engines
from fleet.options import config_json
from gateway.config import load_config
from gateway.deploy_cli import engine_pools
from kernels.config import EngineConfig
from kernels.yamlsrc import ConfigError
from tests.conftest import REPO

BASE = REPO / "deploy" / "kubernetes"
# the example configs (examples/ also holds load scenarios: those have no fleet)
EXAMPLES = sorted([REPO / "config.example.yaml", *(p for p in (REPO / "examples").glob("*.yaml") if "fleet" in yaml.safe_load(p.read_text()))],
                  key=lambda p: p.name)
SCHEMA_VERSIONS = ("1.29.0", "1.37.0")
CONTRACT_LABELS = {"app.kubernetes.io/name": "polymorph-engine", "app.kubernetes.io/part-of": "polymorph"}


def _kustomize(kubectl: str, directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _validate(validator: Path, docs: list[dict[str, Any]], tmp_path: Path) -> None:
    """Every document against each schema version; a failure names the object and the field."""
    file = tmp_path / "rendered.yaml"
    file.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    for version in SCHEMA_VERSIONS:
        done = subprocess.run([str(validator), "-k", version, "--strict", "--quiet", str(file)], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, f"Kubernetes {version}: {done.stdout}{done.stderr}"


def _deploy(config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gateway.cli", "deploy", "kubernetes", "--config", str(config), "--out", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, cwd=REPO)


def test_an_out_folder_that_cannot_be_written_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = _deploy(REPO / "config.example.yaml", tmp_path / "a-file" / "manifests")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == f"polymorph deploy kubernetes: cannot write {tmp_path / 'a-file' / 'manifests'}: Not a directory"


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _check_engine_deployment(deployment: dict[str, Any], pool: EnginePool, settings: KubernetesSettings) -> dict[str, Any]:
    """The contract for one pool's Deployment; returns its engine container."""
    labels = {**CONTRACT_LABELS, "polymorph.dev/pool": pool_slug(pool.name)}
    meta, spec = deployment["metadata"], deployment["spec"]
    assert meta["name"] == deployment_name(pool.name) and len(meta["name"]) <= 63
    assert meta["namespace"] == settings.namespace
    assert meta["labels"] == labels and spec["selector"]["matchLabels"] == labels and spec["template"]["metadata"]["labels"] == labels
    assert meta["annotations"]["polymorph.dev/pool-name"] == pool.name
    assert meta["annotations"]["polymorph.dev/config-json"] == config_json(pool.config)
    assert json.loads(meta["annotations"]["polymorph.dev/config-json"]) == json.loads(config_json(pool.config))
    assert spec["replicas"] == pool.num_replicas
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "engine"
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # engines take minutes to load: the startup probe allows far longer than liveness would
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", str(settings.drain_grace_s)]}}
    assert pod["terminationGracePeriodSeconds"] > settings.drain_grace_s
    assert container["command"][-4:] == ["--host", "0.0.0.0", "--port", "8000"]
    assert container["image"] == settings.images[pool.launch.kind]
    return container


def test_base_renders_validates_and_holds_what_the_gateway_and_controller_need(kubectl: str, kubernetes_validate_bin: Path, tmp_path: Path) -> None:
    docs = _kustomize(kubectl, BASE)
    _validate(kubernetes_validate_bin, docs, tmp_path)
    assert all(d["metadata"].get("namespace") == "polymorph" for d in docs if d["kind"] != "Namespace")
    deployments, configmaps = _by_kind(docs, "Deployment"), _by_kind(docs, "ConfigMap")

    # the gateway: --workers, probes, config and tenants as whole directories (hot reload), a PDB
    gateway = deployments["polymorph-gateway"]["spec"]["template"]["spec"]
    (container,) = gateway["containers"]
    argv = container["command"]
    assert argv[:4] == ["polymorph", "serve", "--config", "/etc/polymorph/config.yaml"] and "--workers" in argv
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz" and container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert all("subPath" not in m for m in mounts.values()), "a subPath mount never sees a ConfigMap's update"
    volumes = {v["name"]: v for v in gateway["volumes"]}
    assert mounts["config"]["mountPath"] == "/etc/polymorph" and volumes["config"]["configMap"]["name"] == "polymorph-config"
    assert mounts["tenants"]["mountPath"] == "/etc/polymorph-tenants" and volumes["tenants"]["secret"]["secretName"] == "polymorph-tenants"
    (pdb,) = _by_kind(docs, "PodDisruptionBudget").values()
    assert pdb["spec"]["selector"]["matchLabels"] == deployments["polymorph-gateway"]["spec"]["selector"]["matchLabels"]
    assert _by_kind(docs, "Service")["polymorph-gateway"]["spec"]["ports"][0]["targetPort"] == "http"

    # the config the pods mount is the file in the repository, unhashed (an edit updates it in place), and it loads
    config_file = BASE / "polymorph" / "config.yaml"
    assert configmaps["polymorph-config"]["data"]["config.yaml"] == config_file.read_text()
    config = load_config(config_file)
    assert config.actuator == "kubernetes" and config.controller.mode == "external"
    assert config.tenants_dir == (BASE / "polymorph-tenants").resolve()
    secret = _by_kind(docs, "Secret")["polymorph-tenants"]
    assert set(secret["data"]) == {p.name for p in config.tenants_dir.glob("*.yaml")}
    # the demo tenant is the repository's (a copy: kustomize reads only files below its folder)
    assert (BASE / "polymorph-tenants" / "demo.yaml").read_text() == (REPO / "tenants" / "demo.yaml").read_text()

    # the controller: two pods (leader and standby) electing with a Lease, their state on one ReadWriteMany volume,
    # its own service account
    controller = deployments["polymorph-controller"]
    assert controller["spec"]["replicas"] == 2 and controller["spec"]["strategy"]["type"] == "Recreate"
    pod = controller["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "polymorph-controller"
    assert pod["containers"][0]["command"][:2] == ["polymorph", "controller"]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert config.controller.leader_election == "kubernetes" and config.controller.lease_name == "polymorph-controller"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # the Lease's holder names the pod
    claim = _by_kind(docs, "PersistentVolumeClaim")[pod["volumes"][2]["persistentVolumeClaim"]["claimName"]]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert config.controller.decision_log is not None and str(config.controller.decision_log).startswith(pod["containers"][0]["volumeMounts"][2]["mountPath"])
    assert {h for a in pod["hostAliases"] for h in a["hostnames"]} == {"polymorph-controller"} and config.controller.url == "http://polymorph-controller:9090"

    # RBAC: exactly the actuator's verbs, in its namespace, no wildcard
    (role,) = _by_kind(docs, "Role").values()
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): r["verbs"] for r in role["rules"]}
    assert rules == {
        (("apps",), ("deployments", "deployments/scale")): ["get", "list", "watch", "create", "patch", "update"],
        (("",), ("pods",)): ["get", "list", "watch", "patch"],
        (("discovery.k8s.io",), ("endpointslices",)): ["get", "list", "watch"],
        (("coordination.k8s.io",), ("leases",)): ["get", "create", "update"],
    }
    assert not _by_kind(docs, "ClusterRole") and not _by_kind(docs, "ClusterRoleBinding")
    (binding,) = _by_kind(docs, "RoleBinding").values()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "polymorph-controller", "namespace": "polymorph"}]
    assert not gateway.get("serviceAccountName") and gateway["automountServiceAccountToken"] is False

    # Prometheus: pod discovery on our labels; Grafana: the repository's dashboard
    scrape = yaml.safe_load(configmaps["polymorph-prometheus-scrape"]["data"]["prometheus.yml"])
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert set(jobs) == {"polymorph-gateway", "polymorph-engine", "polymorph-controller"}
    for name, job in jobs.items():
        assert job["kubernetes_sd_configs"][0]["role"] == "pod"
        keep = job["relabel_configs"][0]
        assert keep["action"] == "keep" and keep["regex"] == f"{name};http"
    # the controller's standby serves nothing: only the ready (leading) pod is scraped
    assert {"source_labels": ["__meta_kubernetes_pod_ready"], "regex": "true", "action": "keep"} in jobs["polymorph-controller"]["relabel_configs"]
    dashboard = configmaps["polymorph-grafana-dashboard"]
    assert dashboard["data"]["polymorph.json"] == (REPO / "deploy" / "grafana" / "polymorph.json").read_text()
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_servicemonitor_overlay_adds_only_its_monitor(kubectl: str) -> None:
    base, overlay = _kustomize(kubectl, BASE), _kustomize(kubectl, REPO / "deploy" / "kubernetes-servicemonitor")
    extra = [d for d in overlay if d not in base]
    assert [d["kind"] for d in extra] == ["ServiceMonitor"] and len(overlay) == len(base) + 1


def test_the_base_configs_pools_render_and_validate(kubectl: str, kubernetes_validate_bin: Path, tmp_path: Path) -> None:
    """`polymorph deploy kubernetes` on the config the base mounts: emulated pools, no GPU asked for."""
    config_file = BASE / "polymorph" / "config.yaml"
    done = _deploy(config_file, tmp_path / "engines")
    assert done.returncode == 0, done.stderr
    docs = _kustomize(kubectl, tmp_path / "engines")
    _validate(kubernetes_validate_bin, docs, tmp_path)
    config = load_config(config_file)
    for pool in engine_pools(config):
        container = _check_engine_deployment(_by_kind(docs, "Deployment")[deployment_name(pool.name)], pool, config.kubernetes)
        assert container["command"][:2] == ["polymorph", "emulate"] and "resources" not in container


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_and_validates(example: Path, kubectl: str, kubernetes_validate_bin: Path, tmp_path: Path) -> None:
    """Emulated pools render as they are. A real engine's pool must name the checkpoint its container
    loads (the local default model exists only here): the CLI says so, and with one named it renders."""
    config = load_config(example)
    pools = engine_pools(config)
    assert pools, "every example launches replicas"
    done = _deploy(example, tmp_path / "engines")
    if all(p.launch.kind == "emulated" or p.launch.model_path for p in pools):
        assert done.returncode == 0, done.stderr
        docs = _kustomize(kubectl, tmp_path / "engines")
    else:
        assert done.returncode == 2 and "engine.model_path" in done.stderr, done.stderr
        named = [dataclasses.replace(p, launch=dataclasses.replace(p.launch, model_path=p.launch.model_path or f"/models/{p.model}")) for p in pools]
        out = tmp_path / "named"
        out.mkdir()
        for name, file_docs in render_engines(named, config.kubernetes).items():
            (out / name).write_text(yaml.safe_dump_all(file_docs, sort_keys=False))
        docs = _kustomize(kubectl, out)
        pools = named
    _validate(kubernetes_validate_bin, docs, tmp_path)
    deployments, services = _by_kind(docs, "Deployment"), _by_kind(docs, "Service")
    assert set(deployments) == set(services) == {deployment_name(p.name) for p in pools}
    for pool in pools:
        _check_engine_deployment(deployments[deployment_name(pool.name)], pool, config.kubernetes)
        service = services[deployment_name(pool.name)]["spec"]
        assert service["clusterIP"] == "None" and service["selector"] == deployments[deployment_name(pool.name)]["spec"]["selector"]["matchLabels"]


def test_gpu_pools_request_their_engines_gpus_on_nodes_of_their_kind(kubectl: str, kubernetes_validate_bin: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants"
    tenants.mkdir()
    (tenants / "demo.yaml").write_text((REPO / "tenants" / "demo.yaml").read_text())
    config_file = tmp_path / "gpus.yaml"
    config_file.write_text(f"""
tenants_dir: {tenants}
fleet:
  pools:
    - name: Chat_vLLM@H100-SXM
      model: llama-3.1-8b
      gpu: H100-SXM
      engine: {{ kind: vllm, tp: 2, max_running_requests: 128, model_path: meta-llama/Llama-3.1-8B-Instruct, env: {{ HF_HOME: /models }} }}
      replicas: {{ launch: 3 }}
    - name: long-sglang
      model: llama-3.1-70b
      gpu: H200
      engine: {{ kind: sglang, tp: 4, dp: 2, model_path: /models/llama-70b, served_model_name: llama-70b }}
      replicas: {{ launch: 1 }}
    - name: tiny-llamacpp
      model: tiny-llama
      gpu: L40S
      engine: {{ kind: llamacpp, model_path: /models/tiny.gguf }}
      replicas: {{ launch: 0 }}
    - name: outside
      model: llama-3.1-8b
      replicas: {{ urls: ["http://10.0.0.1:8000"] }}
  actuator: kubernetes
  kubernetes:
    namespace: inference
    gpu_label: cloud.example.com/accelerator
    gpu_products: {{ H100-SXM: h100-80gb, H200: h200-141gb, L40S: l40s }}
    images: {{ vllm: registry.example.com/vllm:v0.11.0 }}
    drain_grace_s: 120
""")
    done = _deploy(config_file, tmp_path / "engines")
    assert done.returncode == 0, done.stderr
    docs = _kustomize(kubectl, tmp_path / "engines")
    _validate(kubernetes_validate_bin, docs, tmp_path)
    config = load_config(config_file)
    settings = config.kubernetes
    assert settings.namespace == "inference" and settings.images["sglang"] == "lmsysorg/sglang:v0.5.3"  # defaults stay for the kinds not named
    deployments = _by_kind(docs, "Deployment")
    assert set(deployments) == {"polymorph-engine-chat-vllm-h100-sxm", "polymorph-engine-long-sglang", "polymorph-engine-tiny-llamacpp"}
    expected = {"Chat_vLLM@H100-SXM": (2, "h100-80gb"), "long-sglang": (8, "h200-141gb"), "tiny-llamacpp": (1, "l40s")}
    for pool in engine_pools(config):
        deployment = deployments[deployment_name(pool.name)]
        container = _check_engine_deployment(deployment, pool, settings)
        gpus, product = expected[pool.name]
        pod = deployment["spec"]["template"]["spec"]
        assert container["resources"] == {"limits": {"nvidia.com/gpu": gpus}}
        assert pod["nodeSelector"] == {"cloud.example.com/accelerator": product}
        assert pod["terminationGracePeriodSeconds"] >= 120
        # the engine's own command line, as the local actuator would launch it, with the image's interpreter or binary
        launch = dataclasses.replace(pool.launch, command=pool.launch.command or (("/app/llama-server",) if pool.launch.kind == "llamacpp" else ("python3",)))
        assert container["command"] == [*launch_argv(launch, pool.config, pool.gpu, probe=False), "--host", "0.0.0.0", "--port", "8000"]
    vllm = deployments["polymorph-engine-chat-vllm-h100-sxm"]
    command = shlex.join(vllm["spec"]["template"]["spec"]["containers"][0]["command"])
    assert command.startswith("python3 -m vllm.entrypoints.openai.api_server --model meta-llama/Llama-3.1-8B-Instruct")
    assert "--tensor-parallel-size 2" in command and "--served-model-name llama-3.1-8b" in command
    assert {"name": "HF_HOME", "value": "/models"} in vllm["spec"]["template"]["spec"]["containers"][0]["env"]
    assert vllm["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/vllm:v0.11.0"
    assert deployments["polymorph-engine-tiny-llamacpp"]["spec"]["replicas"] == 0  # a pool the controller's moves fill
    assert "--n-gpu-layers" in deployments["polymorph-engine-tiny-llamacpp"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "outside" in done.stderr  # named as left out: its replicas run elsewhere


def test_the_validator_rejects_a_broken_manifest(kubernetes_validate_bin: Path, tmp_path: Path) -> None:
    """The schema check can fail: a replica count that is not a number does not pass."""
    pool = EnginePool("p", "llama-3.1-8b", "H100-SXM", EngineConfig(), EngineLaunch("emulated"), 1)
    deployment = render_engines([pool], KubernetesSettings())["polymorph-engine-p.yaml"][0]
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(AssertionError, match="replicas"):
        _validate(kubernetes_validate_bin, [deployment], tmp_path)


def test_pool_names_become_dns_labels() -> None:
    assert deployment_name("short-chat@H100-SXM") == "polymorph-engine-short-chat-h100-sxm"
    assert pool_slug("Chat_vLLM.v2") == "chat-vllm-v2"
    long_name = "a" * 63
    slug = pool_slug(long_name)
    assert len(deployment_name(long_name)) == 63 and slug != pool_slug("a" * 62) and slug[-1].isalnum()
    assert pool_slug("pool.")[-1].isalnum()  # a label may not end in '-'
    pools = [EnginePool(name, "llama-3.1-8b", "H100-SXM", EngineConfig(), EngineLaunch("emulated"), 1) for name in ("chat_a", "chat-a")]
    with pytest.raises(ValueError, match="both become the Kubernetes name 'polymorph-engine-chat-a'"):
        render_engines(pools, KubernetesSettings())


def test_a_gpu_kind_without_a_node_label_value_is_an_error() -> None:
    pool = EnginePool("b300", "llama-3.1-8b", "B300", EngineConfig(), EngineLaunch("vllm", model_path="/m"), 1)
    with pytest.raises(ValueError, match="gpu_products names no nvidia.com/gpu.product value for GPU kind 'B300'"):
        render_engines([pool], KubernetesSettings())


@pytest.mark.parametrize(("section", "message"), [
    ("actuator: nomad", "fleet.actuator: must be 'local'"),
    ("kubernetes: { namespace: Polymorph }", "fleet.kubernetes.namespace: must be a DNS label"),
    ("kubernetes: { images: { tgi: ghcr.io/huggingface/tgi } }", "fleet.kubernetes.images.tgi: unknown engine kind 'tgi'"),
    ("kubernetes: { gpu_products: { H100: nvidia-h100 } }", "fleet.kubernetes.gpu_products.H100: unknown GPU kind"),
    ("kubernetes: { gpu_products: { H200: 'NVIDIA H200' } }", "is not a label value"),
    ("kubernetes: { gpu_label: 'nvidia.com/gpu product' }", "fleet.kubernetes.gpu_label: must be a node label key"),
    ("kubernetes: { drain_grace_s: 2.5 }", "fleet.kubernetes.drain_grace_s: must be an integer"),
    ("kubernetes: { replicas: 3 }", "fleet.kubernetes.replicas: unknown field"),
])
def test_fleet_kubernetes_mistakes_name_their_line(section: str, message: str, tmp_path: Path) -> None:
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(f"""tenants_dir: {REPO / 'tenants'}
fleet:
  pools:
    - {{ name: p, model: llama-3.1-8b, gpu: H100-SXM, replicas: {{ launch: 1 }} }}
  {section}
""")
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(config_file)
    assert caught.value.line == 5


def test_fleet_kubernetes_defaults_and_kubeconfig_relative_to_the_config(tmp_path: Path) -> None:
    config_file = tmp_path / "ok.yaml"
    config_file.write_text(f"""tenants_dir: {REPO / 'tenants'}
fleet:
  pools:
    - {{ name: p, model: llama-3.1-8b, gpu: H100-SXM, replicas: {{ launch: 1 }} }}
  actuator: kubernetes
  kubernetes: {{ kubeconfig: kube/config, gpu_products: {{ H100-SXM: my-h100 }} }}
""")
    config = load_config(config_file)
    assert config.actuator == "kubernetes"
    assert config.kubernetes.kubeconfig == str(tmp_path / "kube" / "config")
    assert config.kubernetes.gpu_products["H100-SXM"] == "my-h100" and config.kubernetes.gpu_products["H200"] == "NVIDIA-H200"
    assert config.kubernetes.drain_grace_s == 330 and config.kubernetes.namespace == "polymorph"
    assert load_config(REPO / "config.example.yaml").kubernetes == KubernetesSettings()
