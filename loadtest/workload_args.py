"""The workload a load test's flags name (``polymorph loadtest``'s scenario or trace and its transforms),
for a plain run (loadtest.main) and for every point of a capacity search (loadtest.live_capacity)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kernels.domains import DOMAINS, unknown_domain
from kernels.yamlsrc import FieldReader, load_yaml
from loadtest.spec import Workload
from loadtest.transform import ASSIGNABLE_FIELDS, AssignRule


def build_workload_from_args(args: argparse.Namespace) -> Workload:
    """Scenario or trace, then rate/time scaling, windowing and assignments, in that order."""
    from loadtest import transform

    if bool(args.scenario) == bool(args.trace):
        raise ValueError("give exactly one of --scenario NAME|FILE or --trace FILE --format FORMAT")
    if args.scenario:
        from loadtest.scenario import build_workload, load_scenario

        if args.speedup is not None:
            raise ValueError("--speedup applies to traces; scale a scenario with --rate")
        scenario = load_scenario(args.scenario)
        duration_s = args.duration if args.duration is not None else scenario.duration_s
        workload = build_workload(scenario, duration_s + args.start, args.rate, args.seed)
        workload = transform.window(workload, args.start, duration_s)
    else:
        from loadtest.traces import read_trace

        if not args.format:
            raise ValueError("--trace needs --format (azure, burstgpt, mooncake or native)")
        workload = read_trace(args.trace, args.format)
        if args.speedup is not None:
            workload = transform.speed_up(workload, args.speedup)
        if args.rate is not None:
            workload = transform.scale_to_rate(workload, args.rate)
        workload = transform.window(workload, args.start, args.duration)
    seed = args.seed if args.seed is not None else 0
    for number, (field, text) in enumerate((("domain", args.domains), ("tenant", args.tenants), ("tier", args.tiers))):
        if text:
            fractions = transform.parse_fractions(text)
            unknown = sorted(set(fractions) - set(DOMAINS)) if field == "domain" else []
            if unknown:
                raise ValueError(f"--domains: {unknown_domain(unknown[0])}")
            workload = transform.assign_fractions(workload, field, fractions, seed + number)
    if args.assign:
        workload = transform.assign_by_rules(workload, _rules(Path(args.assign)))
    return workload


_BOUNDS = ("min_input_tokens", "max_input_tokens", "min_output_tokens", "max_output_tokens")
_RULE_FIELDS = {"set", "to", *_BOUNDS, "domains", "tenants"}


def _rules(path: Path) -> list[AssignRule]:
    doc = load_yaml(path)  # a ConfigError (a ValueError) names the file and line, as every error below
    if not isinstance(doc.data, list):
        raise doc.error((), "expected a list of rules like {set: tier, to: batch, min_input_tokens: 4096}")
    rules = []
    for index, item in enumerate(doc.data):
        fields = FieldReader(doc, (index,), item, _RULE_FIELDS)
        field, value = fields.text("set", None), fields.text("to", None)
        if field is None or value is None:
            raise doc.error((index,), "a rule needs `set:` (tenant, tier or domain) and `to:`")
        if field not in ASSIGNABLE_FIELDS:
            raise fields.error("set", f"cannot assign {field!r}; assignable fields: {', '.join(ASSIGNABLE_FIELDS)}")
        if field == "domain" and value not in DOMAINS:
            raise fields.error("to", unknown_domain(value))
        bounds = {key: fields.number(key, 0, integer=True) for key in _BOUNDS if key in item}
        domains, tenants = fields.names("domains", None, DOMAINS), fields.names("tenants", None)
        rules.append(AssignRule(field, value, **bounds, domains=None if domains is None else frozenset(domains),
                                tenants=None if tenants is None else frozenset(tenants)))
    return rules
