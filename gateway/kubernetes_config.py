"""``fleet.kubernetes``: the cluster the engine pools run on (``fleet.actuator: kubernetes`` and
``polymorph deploy kubernetes``), parsed with file and line like the rest of the config.

The settings object itself is ``fleet.kubernetes_manifests.KubernetesSettings`` (the actuator and the
manifests under fleet/ read it, and fleet may not import the gateway); it is re-exported here.
"""

from __future__ import annotations

import re
from pathlib import Path

from fleet.engines.load import ENGINE_KINDS
from fleet.kubernetes_manifests import DEFAULT_GPU_PRODUCTS, DEFAULT_IMAGES, KubernetesSettings
from kernels.catalog import list_gpus
from kernels.yamlsrc import FieldReader, YamlDoc

__all__ = ["KubernetesSettings", "parse_kubernetes"]

_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS-1123 label
# a label key: an optional DNS-subdomain prefix and '/', then a name of up to 63 characters
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def parse_kubernetes(doc: YamlDoc, raw: object, base: Path) -> KubernetesSettings:
    """``fleet.kubernetes``; ``images`` and ``gpu_products`` extend the defaults (an entry replaces the
    default of its key), ``kubeconfig`` is relative to the config file."""
    path = ("fleet", "kubernetes")
    r = FieldReader(doc, path, raw, set(KubernetesSettings.__dataclass_fields__))
    d = KubernetesSettings()
    namespace = r.text("namespace", d.namespace) or ""
    if not _NAMESPACE.match(namespace):
        raise r.error("namespace", f"must be a DNS label (lowercase letters, digits, '-'; at most 63), not {namespace!r}")
    gpu_label = r.text("gpu_label", d.gpu_label) or ""
    if not _LABEL_KEY.match(gpu_label):
        raise r.error("gpu_label", f"must be a node label key such as nvidia.com/gpu.product, not {gpu_label!r}")
    kubeconfig = r.text("kubeconfig", None)
    products = _mapping(doc, r, "gpu_products", tuple(g for g in list_gpus() if g != "cpu"), "GPU kind")
    for kind, value in products.items():
        if not _LABEL_VALUE.match(value):
            raise doc.error((*path, "gpu_products", kind), f"{value!r} is not a label value (letters, digits, '-', '_', '.'; at most 63)")
    return KubernetesSettings(
        namespace=namespace,
        kubeconfig=str((base / Path(kubeconfig).expanduser()).resolve()) if kubeconfig else None,
        gpu_label=gpu_label,
        gpu_products={**DEFAULT_GPU_PRODUCTS, **products},
        images={**DEFAULT_IMAGES, **_mapping(doc, r, "images", ENGINE_KINDS, "engine kind")},
        drain_grace_s=r.number("drain_grace_s", d.drain_grace_s, lo=0, hi=86400, integer=True),
    )


def _mapping(doc: YamlDoc, r: FieldReader, key: str, allowed: tuple[str, ...], what: str) -> dict[str, str]:
    """A mapping of ``allowed`` names to non-empty strings."""
    raw = r.data.get(key) or {}
    if not isinstance(raw, dict):
        raise r.error(key, f"must map each {what} to a string")
    for name, value in raw.items():
        if name not in allowed:
            raise doc.error((*r.path, key, str(name)), f"unknown {what} {name!r} (known: {', '.join(allowed)})")
        if not isinstance(value, str) or not value:
            raise doc.error((*r.path, key, name), f"must be a non-empty string, not {value!r}")
    return dict(raw)

