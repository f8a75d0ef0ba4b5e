"""`polymorph loadtest`: build the workload from the flags, run it, write results and plots."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from kernels.tiers import TierSlo
from kernels.traces import report_skipped_rows
from kernels.yamlsrc import load_yaml
from loadtest.spec import Workload
from loadtest.workload_args import build_workload_from_args

EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


def main_loadtest(args: argparse.Namespace) -> int:
    try:
        workload = build_workload_from_args(args)
        tier_to_slo = _slos_from_args(args)
        tenant_to_key = _tenant_keys(args.tenant_keys)
    except ValueError as exc:  # TraceFormatError and ScenarioError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.trace:
        report_skipped_rows(args.trace, workload.issues)
    if args.capacity:
        from loadtest.live_capacity import main_capacity

        return main_capacity(args, tier_to_slo, tenant_to_key)
    out_dir = Path(args.out)
    if args.dry_run:
        from loadtest.traces import write_native

        out_dir.mkdir(parents=True, exist_ok=True)
        write_native(workload, out_dir / "workload.jsonl")
        print(f"{workload.name}: {workload.num_requests} requests over {workload.duration_s:.1f} s "
              f"({workload.target_rate_rps:.2f} req/s) written to {out_dir / 'workload.jsonl'}")
        return 0
    if not args.target:
        print("error: --target URL is required (or --dry-run)", file=sys.stderr)
        return EXIT_USAGE
    return _run_and_report(args, workload, tier_to_slo, tenant_to_key, out_dir)


def _run_and_report(
    args: argparse.Namespace,
    workload: Workload,
    tier_to_slo: Mapping[str, TierSlo],
    tenant_to_key: dict[str, str],
    out_dir: Path,
) -> int:
    from loadtest.metrics import RunFacts, summarize
    from loadtest.report import text_summary, write_results
    from loadtest.runner import RunnerConfig, TargetUnreachable, run

    config = RunnerConfig(
        target_url=args.target,
        model=args.model,
        api_key=args.api_key,
        tenant_to_api_key=tenant_to_key,
        stream=not args.no_stream,
        concurrency=args.concurrency,
        request_timeout_s=args.timeout,
        drain_timeout_s=args.drain_timeout,
        admin_token=args.admin_token,
        progress=not args.no_progress,
    )
    print(f"{workload.name}: {workload.num_requests} requests over {workload.duration_s:.1f} s "
          f"({workload.target_rate_rps:.2f} req/s offered) -> {config.base_url}", file=sys.stderr)
    try:
        result = run(workload, config, tier_to_slo)
    except TargetUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    facts = RunFacts(workload.name, config.base_url, result.model, result.mode, config.stream,
                     result.duration_s, workload.drift_onsets_s, result.gateway_events)
    summary = summarize(result.records, facts, tier_to_slo)
    write_results(out_dir, summary, result.records)
    if not args.no_plots:
        from loadtest.plots import write_plots

        write_plots(out_dir, summary, result.records)
    print(text_summary(summary))
    print(f"wrote {out_dir}/results.json, requests.jsonl{'' if args.no_plots else ' and plots'}")
    return 0


def _slos_from_args(args: argparse.Namespace) -> dict[str, TierSlo]:
    from kernels.tiers import DEFAULT_TIERS
    from loadtest.slo import load_slos, override_slos

    tier_to_slo = load_slos(args.slo) if args.slo else dict(DEFAULT_TIERS)
    tier_to_slo = override_slos(tier_to_slo, "ttft_p99_s", args.slo_ttft or [])
    return override_slos(tier_to_slo, "tpot_p99_s", args.slo_tpot or [])


def _tenant_keys(value: str | None) -> dict[str, str]:
    """``acme=sk-1,globex=sk-2`` or a YAML/JSON file mapping tenant -> API key."""
    if not value:
        return {}
    path = Path(value)
    if path.is_file():
        doc = load_yaml(path)
        if not isinstance(doc.data, dict):
            raise doc.error((), "expected a mapping of tenant -> API key")
        for tenant, key in doc.data.items():
            if not isinstance(key, str) or not key:  # a list or a number here is a mistake, not a key
                raise doc.error((tenant,), f"an API key must be a non-empty string (quote one of digits), not {key!r}")
        return {str(tenant): key for tenant, key in doc.data.items()}
    pairs = [part.partition("=") for part in value.split(",") if part.strip()]
    if any(not sep or not tenant for tenant, sep, _ in pairs):
        raise ValueError(f"--tenant-keys {value!r}: expected TENANT=KEY[,TENANT=KEY] or a file")
    return {tenant.strip(): key.strip() for tenant, _, key in pairs}
