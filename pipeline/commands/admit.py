"""`pipeline admit`: decide groups, write receipts, materialize one snapshot.

    pipeline admit --lake ./lake                       # decide, write receipts, print the snapshot id
    pipeline admit --dry-run --json                    # the receipts it would write
    pipeline admit --set max_policy_lag=2 --set "update_if=['max(task_success) >= 0.5']"
    pipeline admit --engine dask --dask-scheduler tcp://host:8786
    PIPELINE_DASK_SCHEDULER=tcp://host:8786 pipeline admit   # auto: dask on that cluster
    pipeline admit --follow --interval 10              # resident: admit groups as they complete, until SIGTERM
"""

from __future__ import annotations

import argparse
from typing import Any, Literal


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.admission.config import AdmissionConfig
    from pipeline.clikit import add_config_options, common
    from pipeline.config import keys_epilog

    keys = keys_epilog(AdmissionConfig)
    p = common(sub.add_parser(
        "admit", help="run admission: receipts per group, one immutable snapshot of the admitted members",
        description="Decide every complete (or timed-out) undecided group with the checks in sql/admission_*.sql; "
                    "write one receipt per group and materialize one content-addressed snapshot.\n"
                    "Prints the snapshot id on its last line (nothing to decide: exit code 0, no snapshot).",
        epilog=keys,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    add_config_options(p)
    p.add_argument("--current-policy-version", type=int, default=None, metavar="V",
                   help="measure freshness against V (default: newest published policy, else newest in trajectories)")
    p.add_argument("--dry-run", action="store_true", help="print the receipts it would write; write nothing")
    p.add_argument("--engine", choices=("auto", "duckdb", "dask"), default="auto",
                   help="duckdb (one machine) or dask (a distributed cluster); auto (default): dask when a "
                        "scheduler is given (--dask-scheduler or $PIPELINE_DASK_SCHEDULER), else duckdb")
    p.add_argument("--dask-scheduler", default=None, metavar="ADDRESS",
                   help="dask scheduler address (default: $PIPELINE_DASK_SCHEDULER, else a LocalCluster)")
    p.add_argument("--dask-worker-timeout", type=float, default=None, metavar="SECONDS",
                   help="stop with an error when no Dask worker is alive this long "
                        "(default: $PIPELINE_DASK_WORKER_TIMEOUT_S, else 120)")
    p.add_argument("--target-groups", type=int, default=None, metavar="N",
                   help="report how many admitted groups are missing to reach N and the observed admit rate")
    p.add_argument("--run-id", default=None, help="decide only groups of this rollout run")
    p.add_argument("--env", default=None, help="decide only groups of this environment (e.g. arithmetic-tool)")
    p.add_argument("--task", default=None, metavar="TASK_ID", help="decide only groups of this task")
    p.add_argument("--follow", action="store_true",
                   help="stay resident: admit every --interval seconds in one process (quality suites built "
                        "once), one report per pass that ran; SIGTERM/SIGINT end it after the current pass")
    p.add_argument("--interval", type=float, default=10.0, metavar="SECONDS",
                   help="with --follow: seconds between passes (default 10)")
    p.add_argument("--max-passes", type=int, default=None, metavar="N", help="with --follow: stop after N passes")
    p.add_argument("--max-seconds", type=float, default=None, metavar="SECONDS",
                   help="with --follow: stop (after the current pass) once this long has passed; the admission "
                        "job uses it to end before its timeout")
    p.add_argument("--max-idle-seconds", type=float, default=None, metavar="SECONDS",
                   help="with --follow: stop once no pass decided anything for this long")
    p.set_defaults(handler=_admit)


def _admit(args: argparse.Namespace) -> int | None:
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.clikit import emit, open_lake
    from pipeline.config import load_config, parse_set

    cfg = load_config(AdmissionConfig, args.config, parse_set(args.set))
    engine, scheduler = resolve_engine(args.engine, args.dask_scheduler)
    if args.dask_worker_timeout is not None:
        import os

        from pipeline.errors import ConfigError

        if args.dask_worker_timeout <= 0:
            raise ConfigError("--dask-worker-timeout must be a positive number of seconds")
        os.environ["PIPELINE_DASK_WORKER_TIMEOUT_S"] = str(args.dask_worker_timeout)  # read by the Dask engine
    from pipeline.admission.scope import Scope

    if args.follow:
        return _follow(args, cfg, engine, scheduler, Scope(args.run_id, args.env, args.task))
    if args.max_passes is not None or args.max_seconds is not None or args.max_idle_seconds is not None:
        from pipeline.errors import ConfigError

        raise ConfigError("--max-passes / --max-seconds / --max-idle-seconds apply to --follow only",
                          hint="add --follow")
    res = admit(open_lake(args), cfg, current_policy_version=args.current_policy_version, dry_run=args.dry_run,
                engine=engine, dask_scheduler=scheduler, target_groups=args.target_groups,
                scope=Scope(args.run_id, args.env, args.task))
    out = res.as_dict(with_receipts=args.dry_run)
    emit(out, args, _admit_text)
    return None


def _follow(args: argparse.Namespace, cfg, engine, scheduler, scope) -> int | None:
    import json
    import sys

    from pipeline.admission.follow import StopFlag, follow
    from pipeline.clikit import open_lake, out
    from pipeline.errors import ConfigError

    if args.dry_run:
        raise ConfigError("--follow cannot be combined with --dry-run", hint="drop one of them")
    if args.interval <= 0:
        raise ConfigError(f"--interval {args.interval}: must be a positive number of seconds")
    if args.max_passes is not None and args.max_passes < 1:
        raise ConfigError(f"--max-passes {args.max_passes}: must be >= 1")
    stop = StopFlag()
    stop.install()

    def report(rep) -> None:
        d = rep.as_dict()
        if not (rep.result.receipts.num_rows or rep.n == 1):
            return       # the passes that decided something (and the first): the last line is the last decision
        if getattr(args, "json", False):
            out(json.dumps(d, default=str, sort_keys=True))   # JSON lines: one document per such pass
        else:
            lat = rep.latency_s
            tail = (f"; last member landed -> snapshot: p50 {lat['p50']:.2f}s, max {lat['max']:.2f}s "
                    f"({lat['groups']} groups)" if lat.get("groups") else "")
            out(f"pass {rep.n} ({rep.wall_s:.2f}s): decided {d['decided_groups']} group(s): {_counts(d['counts'])}"
                + (f", snapshot {d['snapshot_id']}" if d.get("snapshot_id") else "")
                + f", {rep.pending_rows} pending row(s){tail}")

    reports = follow(open_lake(args), cfg, interval_s=args.interval, stop=stop, max_passes=args.max_passes,
                     max_seconds=args.max_seconds, max_idle_s=args.max_idle_seconds, on_pass=report, current_policy_version=args.current_policy_version,
                     engine=engine, dask_scheduler=scheduler, target_groups=args.target_groups, scope=scope)
    why = f"{stop.signal}: " if stop.signal else ""
    print(f"follow: {why}stopped after {len(reports)} pass(es)", file=sys.stderr, flush=True)
    return 130 if stop.signal == "SIGINT" else None   # docs/signals.md: SIGTERM 0, SIGINT 130


def resolve_engine(engine: str, scheduler: str | None) -> tuple[Literal["duckdb", "dask"], str | None]:
    """``auto`` is dask when a scheduler is configured (the flag or
    $PIPELINE_DASK_SCHEDULER: compose and Kubernetes set it, so the scheduled
    admission job runs on the cluster), else duckdb."""
    import os

    from pipeline.errors import ConfigError

    scheduler = scheduler or os.environ.get("PIPELINE_DASK_SCHEDULER") or None
    if engine == "auto":
        return ("dask" if scheduler else "duckdb"), scheduler
    if engine == "duckdb":
        return "duckdb", scheduler
    if engine == "dask":
        return "dask", scheduler
    raise ConfigError(f"--engine {engine!r}: expected auto, duckdb or dask")


def _admit_text(d: dict[str, Any]) -> str:
    lines = []
    if d.get("dry_run"):
        for r in d.get("receipts", []):
            excl = ", ".join(f"{k}={v}" for k, v in r["excluded_members"]) or "-"
            lines.append(f"{r['group_id']}: {r['decision']}  valid={len(r['valid_members'])}/{r['arrived_members']}"
                         f"  excluded: {excl}")
        lines.append(f"dry run: {d['decided_groups']} group(s) would be decided: {_counts(d['counts'])}")
    else:
        lines.append(f"decided {d['decided_groups']} group(s): {_counts(d['counts'])}")
    if d.get("target"):
        lines.append(target_text(d["target"]))
    for rev, n in sorted(((d.get("quality") or {}).get("deferred_groups") or {}).items()):
        lines.append(f"{n} group(s) of tokenizer {rev} left undecided: they wait for a policy of that tokenizer "
                     f"(pipeline policy import), and the next admission scans them again")
    if d.get("snapshot_id"):
        lines.append(f"snapshot {d['snapshot_id']}: {d['admitted_groups']} groups, {d['admitted_members']} members"
                     + ("" if d.get("dry_run") else f", {d['num_tokens']} tokens"))
        lines.append(d["snapshot_id"])
    else:
        lines.append("no snapshot (nothing admitted)")
    return "\n".join(lines)


def target_text(t: dict[str, Any]) -> str:
    """The --target-groups line; no decided group (rate None) or none admitted (rate 0) says so in words."""
    rate = t["observed_admit_rate"]
    head = f"target {t['target_groups']} groups: {t['missing_groups']} missing"
    if rate is None:
        return head + ", admit rate unknown (no group decided in this run): sample and admit again"
    head += f", admit rate {rate:.1%}"
    if not t["missing_groups"]:
        return head + ", target met"
    if t["groups_to_sample"] is None:
        return head + ": nothing admitted to size the next rollout by; sample more groups"
    return head + f", sample ~{t['groups_to_sample']} more groups"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
