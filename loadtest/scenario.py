"""Declarative scenarios (YAML) and the generator that turns one into a ``Workload``.

A scenario is a set of streams over a duration. Each stream has an arrival process, optional
start/end times, tenants, and phases; a phase is a weighted mix of request classes (domain, input
and output length distributions, tier, optional shared prefix), and a phase with ``ramp_s`` blends
in from the previous one over that time. Phase starts and late stream starts are the drift onsets
the plots mark. See README.md for the schema and the built-in scenarios in ``scenarios/``.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kernels.domains import DOMAINS, unknown_domain
from kernels.yamlsrc import ConfigError, YamlDoc, parse_yaml
from loadtest.arrivals import PROCESS_PARAMS, ArrivalProcess, arrival_times
from loadtest.lengths import LengthDist, fitted_data, parse_length
from loadtest.spec import HASH_BLOCK_TOKENS, RequestSpec, Workload, make_workload


class ScenarioError(ValueError):
    """A scenario file that cannot be used: names the file, the field and the reason."""


@dataclass(frozen=True, slots=True)
class RequestClass:
    name: str
    weight: float
    domain: str
    input: LengthDist
    output: LengthDist
    tier_to_fraction: tuple[tuple[str, float], ...]
    prefix_tokens: int = 0  # a shared system prompt every request of the class starts with


@dataclass(frozen=True, slots=True)
class Phase:
    at_s: float
    ramp_s: float
    classes: tuple[RequestClass, ...]


@dataclass(frozen=True, slots=True)
class Stream:
    name: str
    arrival: ArrivalProcess
    start_s: float
    end_s: float | None
    tenant_to_fraction: tuple[tuple[str, float], ...]
    phases: tuple[Phase, ...]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    duration_s: float
    seed: int
    streams: tuple[Stream, ...]

    def active_s(self, stream: Stream, duration_s: float) -> float:
        end_s = duration_s if stream.end_s is None else min(stream.end_s, duration_s)
        return max(0.0, end_s - stream.start_s)

    def mean_rate_rps(self, duration_s: float) -> float:
        """Expected requests per second over ``duration_s``, all streams together."""
        total = sum(stream.arrival.mean_rate_rps * self.active_s(stream, duration_s) for stream in self.streams)
        return total / duration_s if duration_s > 0 else 0.0


def builtin_names() -> tuple[str, ...]:
    folder = resources.files("loadtest").joinpath("scenarios")
    return tuple(sorted(item.name[:-5] for item in folder.iterdir() if item.name.endswith(".yaml")))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name, or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ScenarioError(f"cannot read scenario file {path}: {exc.strerror or exc}") from None
        return parse_scenario(text, str(path))
    if str(name_or_path) not in builtin_names():
        raise ScenarioError(
            f"unknown scenario {str(name_or_path)!r}: not a file, and not a built-in ({', '.join(builtin_names())})"
        )
    text = resources.files("loadtest").joinpath(f"scenarios/{name_or_path}.yaml").read_text(encoding="utf-8")
    return parse_scenario(text, f"{name_or_path}.yaml")


def parse_scenario(text: str, source: str) -> Scenario:
    try:
        doc = parse_yaml(text, source)
    except ConfigError as exc:  # invalid YAML, or a key given twice
        raise ScenarioError(str(exc)) from None
    return _Parser(doc).scenario(doc.data)


_PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


class _Parser:
    """Validates the YAML tree, naming the field and line of every error."""

    def __init__(self, doc: YamlDoc) -> None:
        self._doc = doc

    def fail(self, where: str, reason: str) -> ScenarioError:
        """``where`` (``streams[0].phases[1].at_s``) is also the path of its line in the file, or of its
        nearest ancestor's."""
        path = tuple(int(index) if index else key for key, index in _PATH_PART.findall(where))
        line = self._doc.line_of(path)
        return ScenarioError(f"{self._doc.file}:{line}: {where}: {reason}" if line else f"{self._doc.file}: {where}: {reason}")

    def mapping(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected a mapping, got {value!r}")
        return value

    def known_keys(self, data: dict[str, Any], where: str, allowed: tuple[str, ...]) -> None:
        """A misspelt key (``wieght``, ``ends_s``) is an error: ignored, it would leave its default in force."""
        unknown = sorted(str(key) for key in data if key not in allowed)
        if unknown:
            raise self.fail(where, f"unknown keys {unknown} (allowed: {', '.join(allowed)})")

    def number(self, value: Any, where: str, minimum: float = 0.0) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
            raise self.fail(where, f"expected a finite number >= {minimum:g}, got {value!r}")
        return float(value)

    def fractions(self, value: Any, where: str) -> tuple[tuple[str, float], ...]:
        if isinstance(value, str):
            return ((value, 1.0),)
        shares = self.mapping(value, where)
        pairs = tuple((str(name), self.number(share, f"{where}.{name}")) for name, share in shares.items())
        if not pairs or sum(share for _, share in pairs) <= 0:
            raise self.fail(where, "fractions must not all be zero")
        return pairs

    def scenario(self, data: Any) -> Scenario:
        root = self.mapping(data, "scenario")
        self.known_keys(root, "scenario", ("name", "description", "duration_s", "seed", "streams"))
        streams = root.get("streams")
        if not isinstance(streams, list) or not streams:
            raise self.fail("streams", "expected a non-empty list of streams")
        return Scenario(
            name=str(root.get("name", Path(self._doc.file).stem)),
            description=str(root.get("description", "")).strip(),
            duration_s=self.number(root.get("duration_s", 600), "duration_s", 1e-9),
            seed=int(self.number(root.get("seed", 0), "seed")),
            streams=tuple(self.stream(item, index) for index, item in enumerate(streams)),
        )

    def stream(self, value: Any, index: int) -> Stream:
        where = f"streams[{index}]"
        data = self.mapping(value, where)
        self.known_keys(data, where, ("name", "arrival", "start_s", "end_s", "tenants", "tenant", "phases", "classes"))
        if "phases" in data:
            phases_data = data["phases"]
        elif "classes" in data:
            phases_data = [{"at_s": 0, "classes": data["classes"]}]
        else:
            raise self.fail(where, "needs `classes:` or `phases:`")
        if not isinstance(phases_data, list) or not phases_data:
            raise self.fail(f"{where}.phases", "expected a non-empty list")
        # a lone `classes:` is its stream's one phase, and its errors are named where the file has them
        phases = tuple(self.phase(item, f"{where}.phases[{index}]" if "phases" in data else where)
                       for index, item in enumerate(phases_data))
        if [phase.at_s for phase in phases] != sorted(phase.at_s for phase in phases):
            raise self.fail(f"{where}.phases", "phases must be in order of at_s")
        end = data.get("end_s")
        return Stream(
            name=str(data.get("name", f"stream{index}")),
            arrival=self.arrival(data.get("arrival"), f"{where}.arrival"),
            start_s=self.number(data.get("start_s", 0), f"{where}.start_s"),
            end_s=None if end is None else self.number(end, f"{where}.end_s"),
            tenant_to_fraction=self.fractions(data.get("tenants", data.get("tenant", "default")), f"{where}.tenants"),
            phases=phases,
        )

    def arrival(self, value: Any, where: str) -> ArrivalProcess:
        data = dict(self.mapping(value, where))
        fitted = data.pop("fitted", None)
        if fitted is not None:
            shapes = fitted_data()["arrivals"]
            if fitted not in shapes:
                raise self.fail(f"{where}.fitted", f"unknown fitted arrival shape {fitted!r}; known: {', '.join(shapes)}")
            data = {"process": "gamma", "rate_rps": shapes[fitted]["rate_rps"], "cv": shapes[fitted]["iat_cv"], **data}
        process = data.pop("process", None)
        if process not in PROCESS_PARAMS:
            raise self.fail(f"{where}.process", f"unknown arrival process {process!r}; choose one of {', '.join(PROCESS_PARAMS)}")
        params = PROCESS_PARAMS[process]
        unknown = sorted(str(key) for key in data if key not in params)
        if unknown:  # a `cv` given to poisson would be ignored, and the stream not as bursty as written
            raise self.fail(where, f"{process} takes {', '.join(params)}, not {', '.join(unknown)}")
        if "rate_rps" not in data:
            raise self.fail(where, f"{process} needs rate_rps")
        values = {key: self.number(value, f"{where}.{key}") for key, value in data.items()}
        try:
            return ArrivalProcess(process, **values)
        except ValueError as exc:
            raise self.fail(where, str(exc)) from None

    def phase(self, value: Any, where: str) -> Phase:
        data = self.mapping(value, where)
        self.known_keys(data, where, ("at_s", "ramp_s", "classes"))
        classes = data.get("classes")
        if not isinstance(classes, list) or not classes:
            raise self.fail(f"{where}.classes", "expected a non-empty list of request classes")
        return Phase(
            at_s=self.number(data.get("at_s", 0), f"{where}.at_s"),
            ramp_s=self.number(data.get("ramp_s", 0), f"{where}.ramp_s"),
            classes=tuple(self.request_class(item, f"{where}.classes[{index}]") for index, item in enumerate(classes)),
        )

    def request_class(self, value: Any, where: str) -> RequestClass:
        data = self.mapping(value, where)
        self.known_keys(data, where, ("name", "weight", "domain", "input", "output", "lengths", "tier", "prefix_tokens"))
        domain = data.get("domain", "chat")
        if domain not in DOMAINS:
            raise self.fail(f"{where}.domain", unknown_domain(domain))
        lengths = data.get("lengths")
        try:
            input_dist = parse_length(data.get("input", lengths), "input")
            output_dist = parse_length(data.get("output", lengths), "output")
        except ValueError as exc:
            raise self.fail(where, str(exc)) from None
        return RequestClass(
            name=str(data.get("name", domain)),
            weight=self.number(data.get("weight", 1.0), f"{where}.weight"),
            domain=domain,
            input=input_dist,
            output=output_dist,
            tier_to_fraction=self.fractions(data.get("tier", "standard"), f"{where}.tier"),
            prefix_tokens=int(self.number(data.get("prefix_tokens", 0), f"{where}.prefix_tokens")),
        )


def build_workload(
    scenario: Scenario, duration_s: float | None = None, rate_rps: float | None = None, seed: int | None = None
) -> Workload:
    """Generate the scenario's requests; ``rate_rps`` scales every stream so the mean rate is that."""
    duration_s = scenario.duration_s if duration_s is None else duration_s
    seed = scenario.seed if seed is None else seed
    streams = scenario.streams
    if rate_rps is not None:
        factor = rate_rps / scenario.mean_rate_rps(duration_s)
        streams = tuple(replace(s, arrival=_scaled(s.arrival, factor)) for s in streams)
    specs: list[RequestSpec] = []
    onsets: set[float] = set()
    for index, stream in enumerate(streams):
        rng = np.random.default_rng([seed, index])
        specs.extend(_stream_specs(stream, duration_s, rng, _id_base(scenario.name, index)))
        onsets.update(phase.at_s for phase in stream.phases if 0 < phase.at_s < duration_s)
        if 0 < stream.start_s < duration_s:
            onsets.add(stream.start_s)
    return make_workload(scenario.name, specs, duration_s, tuple(sorted(onsets)))


def _scaled(arrival: ArrivalProcess, factor: float) -> ArrivalProcess:
    return replace(arrival, rate_rps=arrival.rate_rps * factor, burst_rate_rps=arrival.burst_rate_rps * factor)


def _id_base(name: str, stream_index: int) -> int:
    """Hash-id space of one stream: stable across runs, disjoint between streams in practice."""
    return (zlib.crc32(f"{name}/{stream_index}".encode()) & 0xFFFF) << 32


def _phase_indices(stream: Stream, times: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    starts = np.array([phase.at_s for phase in stream.phases])
    indices = np.maximum(0, np.searchsorted(starts, times, side="right") - 1)
    ramps = np.array([phase.ramp_s for phase in stream.phases])[indices]
    progress = np.where(ramps > 0, (times - starts[indices]) / np.where(ramps > 0, ramps, 1.0), 1.0)
    still_old = (indices > 0) & (rng.uniform(size=times.size) >= progress)
    return indices - still_old.astype(int)


def _stream_specs(stream: Stream, duration_s: float, rng: np.random.Generator, id_base: int) -> list[RequestSpec]:
    end_s = duration_s if stream.end_s is None else min(stream.end_s, duration_s)
    times = stream.start_s + arrival_times(stream.arrival, end_s - stream.start_s, rng)
    tenants = [name for name, _ in stream.tenant_to_fraction]
    tenant_weights = np.array([share for _, share in stream.tenant_to_fraction])
    tenant_picks = rng.choice(len(tenants), size=times.size, p=tenant_weights / tenant_weights.sum())
    phase_picks = _phase_indices(stream, times, rng)
    specs: list[RequestSpec | None] = [None] * times.size
    next_id = id_base + (1 << 31)  # request-unique blocks live above the shared-prefix ids
    for phase_index, phase in enumerate(stream.phases):
        members = np.flatnonzero(phase_picks == phase_index)
        weights = np.array([cls.weight for cls in phase.classes])
        class_picks = rng.choice(len(phase.classes), size=members.size, p=weights / weights.sum())
        for class_index, cls in enumerate(phase.classes):
            chosen = members[class_picks == class_index]
            inputs = cls.input.sample(rng, chosen.size)
            outputs = cls.output.sample(rng, chosen.size)
            tiers = [name for name, _ in cls.tier_to_fraction]
            tier_weights = np.array([share for _, share in cls.tier_to_fraction])
            tier_picks = rng.choice(len(tiers), size=chosen.size, p=tier_weights / tier_weights.sum())
            num_prefix_blocks = cls.prefix_tokens // HASH_BLOCK_TOKENS
            prefix = tuple(id_base + zlib.crc32(f"{cls.name}/{block}".encode()) for block in range(num_prefix_blocks))
            for slot, position in enumerate(chosen.tolist()):
                num_tokens = max(int(inputs[slot]), cls.prefix_tokens + 1)
                hash_ids: tuple[int, ...] = ()
                if prefix:
                    num_blocks = -(-num_tokens // HASH_BLOCK_TOKENS)
                    own = tuple(range(next_id, next_id + num_blocks - len(prefix)))
                    next_id += len(own)
                    hash_ids = prefix + own
                specs[position] = RequestSpec(
                    arrival_s=float(times[position]),
                    input_tokens=num_tokens,
                    output_tokens=int(outputs[slot]),
                    domain=cls.domain,
                    tenant=tenants[tenant_picks[position]],
                    tier=tiers[tier_picks[slot]],
                    hash_ids=hash_ids,
                    label=cls.name,
                )
    return [spec for spec in specs if spec is not None]
