"""CLI: `pipeline report` — the rollout health report (one self-contained HTML file).

    pipeline report --lake ./lake                          # every run -> ./report.html
    pipeline report --lake ./lake --run-id exp-7 --out exp7.html --bucket day

Plots over policy versions and time (quality, comparability, efficiency,
freshness), the latest receipts with reasons, and the lineage of the newest
checkpoint; each section is built from a named query in sql/ (`pipeline sql
--list`). Tables a lake lacks yet show "no data yet".
"""

from __future__ import annotations

import argparse
from typing import Any

# --help text: the docstring without its first line (the module's name, which --help's usage line already says)
DESCRIPTION = "The rollout health report: one self-contained HTML file with plots.\n\n" + \
    (__doc__ or "").split("\n", 1)[1].strip("\n")


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import common

    p = common(sub.add_parser(
        "report", help="the rollout health report: one self-contained HTML file with plots",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--run-id", default=None, help="only this experiment (default: every run)")
    p.add_argument("--out", default="report.html", metavar="FILE", help="HTML file to write (default: report.html)")
    p.add_argument("--bucket", default="auto", choices=["auto", "second", "minute", "hour", "day", "week"],
                   help="time bucket of the over-time plots (default: auto, from the data's time span)")
    p.add_argument("--train-x", default="step", choices=["step", "time", "samples"],
                   help="x axis of the training plots: optimizer step (default), wall time or samples")
    p.add_argument("--pass-k", type=int, default=4, help="k of the second pass@k curve (default: 4)")
    p.add_argument("--receipts", type=int, default=25, help="rows in the latest-receipts table (default: 25)")
    p.add_argument("--alert-bound", action="append", default=[], metavar="NAME=VALUE",
                   help="override one alert threshold (repeatable; names and defaults: "
                        "docs/report-alerts.md)")
    p.add_argument("--check", action="store_true",
                   help=f"exit {EXIT_ALERT} when any alert fires (for cron or CI; the report is still written, and "
                        "--json lists the alerts as alert_checks: [{check, message}])")
    p.set_defaults(handler=_report)


EXIT_ALERT = 4   # `report --check`: the report was written and at least one alert fired (docs/reference/cli.md "Output and exit codes")


def _report(args: argparse.Namespace) -> int | None:
    from pipeline.clikit import emit, open_lake
    from pipeline.errors import PipelineError
    from pipeline.report.build import ReportOptions, write_report

    if args.pass_k < 1 or args.receipts < 1:
        raise PipelineError("--pass-k and --receipts must be >= 1")
    bounds = _alert_bounds(args.alert_bound)
    lake = open_lake(args)
    if args.run_id is not None:
        _require_run(lake, args.run_id)
    result = write_report(lake, args.out, ReportOptions(
        run_id=args.run_id, bucket=args.bucket, pass_k=args.pass_k, receipts=args.receipts, train_x=args.train_x,
        alert_bounds=bounds))
    emit(result, args, text=_text)
    if args.check and result.get("alerts"):
        from pipeline.clikit import note

        note(f"{len(result['alerts'])} alert(s) fired (report --check exits {EXIT_ALERT})")
        return EXIT_ALERT
    return None


def _alert_bounds(items: list[str]) -> tuple[tuple[str, float], ...]:
    """``--alert-bound NAME=VALUE`` pairs, checked (unknown name, not a number: a one-line error)."""
    from pipeline.errors import ConfigError
    from pipeline.report.alerts import bounds

    pairs = []
    for item in items:
        name, eq, value = item.partition("=")
        try:
            pairs.append((name.strip(), float(value)))
        except ValueError:
            raise ConfigError(f"--alert-bound {item!r}: expected NAME=VALUE with a number"
                              + ("" if eq else " (no '=')")) from None
    bounds(tuple(pairs))   # raises on an unknown name or a non-finite value
    return tuple(pairs)


def _require_run(lake, run_id: str) -> None:
    """A --run-id the lake has no trajectory of is a typo, not an empty report (exit 0 on nothing)."""
    from pipeline.config import did_you_mean
    from pipeline.errors import NotFoundError
    from pipeline.query.duck import query

    runs: list[str] = []
    if lake.exists("trajectories"):
        runs = [r for r in query(lake, "SELECT DISTINCT run_id FROM trajectories ORDER BY 1").column(0).to_pylist() if r]
    if run_id in runs:
        return
    close = did_you_mean(run_id, runs)
    listed = ", ".join(runs[:5]) + (f" (and {len(runs) - 5} more)" if len(runs) > 5 else "")
    if close:
        hint = close
    elif runs:
        hint = f"the lake's runs: {listed}"
    else:
        hint = "the lake has no trajectories yet"
    raise NotFoundError(f"run {run_id} has no trajectories in {lake.uri}", hint=hint)


def _text(r: dict[str, Any]) -> str:
    lines = [f"report: {r['out']} ({r['bytes'] / 1e3:.0f} kB, {r['plots']} plots, {r['tables']} tables)"]
    for t in r["no_data"]:
        lines.append(f"  no data: {t}")
    for t in r["errors"]:
        lines.append(f"  error: {t}")
    for t in r.get("alerts", []):
        lines.append(f"  alert: {t}")
    return "\n".join(lines)
