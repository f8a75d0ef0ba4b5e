"""Hardware catalog: per-GPU peak FLOP/s, memory, bandwidth, interconnect and price, loaded from gpus.yaml."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

from kernels.yamlsrc import parse_yaml

_PRECISIONS = ("bf16", "fp8", "fp4")


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU as the performance model sees it. All figures are per GPU; FLOP/s are dense peaks."""

    name: str
    vendor: str
    bf16_tflops: float
    fp8_tflops: float | None
    fp4_tflops: float | None
    hbm_gb: float
    hbm_tb_s: float
    interconnect_gb_s: float
    price_per_gpu_hour: float
    source: str
    aliases: tuple[str, ...] = ()

    @property
    def hbm_bytes(self) -> float:
        # Vendor "GB" capacities of these parts match the driver's GiB figure, see gpus.yaml.
        return self.hbm_gb * 2**30

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tb_s * 1e12

    @property
    def interconnect_bytes_per_s(self) -> float:
        return self.interconnect_gb_s * 1e9

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for `precision` ("bf16", "fp8", "fp4"), falling back to the next wider
        format the tensor cores support (fp4 work runs as fp8 on Hopper, fp8 as bf16 on Ampere)."""
        if precision not in _PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; expected one of {_PRECISIONS}")
        order = _PRECISIONS[: _PRECISIONS.index(precision) + 1][::-1]
        for candidate in order:
            tflops = getattr(self, f"{candidate}_tflops")
            if tflops:
                return float(tflops) * 1e12
        raise AssertionError("bf16 is always present")  # pragma: no cover

    def native_precision(self, precision: str) -> str:
        """The precision the tensor cores actually execute for requested `precision`."""
        order = _PRECISIONS[: _PRECISIONS.index(precision) + 1][::-1]
        return next(p for p in order if getattr(self, f"{p}_tflops"))


def _normalise(name: str) -> str:
    """Lower-case, drop parenthesised remarks and separators so "H200-SXM-141GB" ~ "h200 sxm 141gb"."""
    text = re.sub(r"\(.*?\)", " ", name.lower())
    return re.sub(r"[^a-z0-9]+", "", text)


@functools.cache
def _catalog() -> dict[str, GpuSpec]:
    raw = parse_yaml(resources.files("kernels.catalog").joinpath("gpus.yaml").read_text(), "kernels/catalog/gpus.yaml").data
    specs: dict[str, GpuSpec] = {}
    for name, entry in raw.items():
        specs[name] = GpuSpec(
            name=name,
            vendor=entry["vendor"],
            bf16_tflops=float(entry["bf16_tflops"]),
            fp8_tflops=entry["fp8_tflops"],
            fp4_tflops=entry["fp4_tflops"],
            hbm_gb=float(entry["hbm_gb"]),
            hbm_tb_s=float(entry["hbm_tb_s"]),
            interconnect_gb_s=float(entry["interconnect_gb_s"]),
            price_per_gpu_hour=float(entry["price_per_gpu_hour"]),
            source=entry["source"],
            aliases=tuple(entry.get("aliases", ())),
        )
    return specs


@functools.cache
def _alias_to_name() -> dict[str, str]:
    table: dict[str, str] = {}
    for name, spec in _catalog().items():
        for alias in (name, *spec.aliases):
            table[_normalise(alias)] = name
    return table


def list_gpus() -> tuple[str, ...]:
    """Canonical names of every catalogued GPU."""
    return tuple(_catalog())


def get_gpu(name: str) -> GpuSpec:
    """Look up a GPU by canonical name or alias (case, separators and parenthesised remarks ignored).

    Raises ValueError listing the known GPUs when nothing matches."""
    if "/" in name:
        # "H100/A100-80GB/L40S" names several GPUs; no single spec models it.
        raise ValueError(f"{name!r} names several GPUs; known GPUs: {', '.join(list_gpus())}")
    key = _normalise(name)
    table = _alias_to_name()
    if key in table:
        return _catalog()[table[key]]
    # Strings like "B200-180GB (DGX B200)" or "H100 (per paper)": try the name without its memory
    # suffix, then the longest catalogue name that prefixes it.
    stripped = re.sub(r"(sxm\d?|pcie)?\d+gb$", "", key)
    if stripped in table:
        return _catalog()[table[stripped]]
    prefixes = [alias for alias in table if key.startswith(alias) and len(alias) >= 4]
    if prefixes:
        return _catalog()[table[max(prefixes, key=len)]]
    raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(list_gpus())}")
