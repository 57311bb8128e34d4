"""CLI: `pipeline admit …` and `pipeline snapshots list|show ID|verify ID`.

    pipeline admit --lake ./lake                       # decide, write receipts, print the snapshot id
    pipeline admit --dry-run --json                    # the receipts it would write
    pipeline admit --set max_policy_lag=2 --set "update_if=['max(task_success) >= 0.5']"
    pipeline admit --engine dask --dask-scheduler tcp://host:8786
    PIPELINE_DASK_SCHEDULER=tcp://host:8786 pipeline admit   # auto: dask on that cluster
    pipeline snapshots verify SNAPSHOT_ID              # rehash the snapshot's files
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.admission.config import AdmissionConfig
    from pipeline.cli import add_config_options, common
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
    p.set_defaults(handler=_admit)

    s = sub.add_parser("snapshots", help="list, show and verify batch snapshots")
    ssub = s.add_subparsers(dest="snapshots_command", metavar="ACTION")
    ls = common(ssub.add_parser("list", help="every snapshot of the lake, newest first"))
    ls.set_defaults(handler=_list)
    sh = common(ssub.add_parser("show", help="a snapshot's row, manifest and decision counts"))
    sh.add_argument("snapshot_id", help="the 64-character id `pipeline admit` printed")
    sh.set_defaults(handler=_show)
    vf = common(ssub.add_parser("verify", help="rehash a snapshot's files against its manifest and the table"))
    vf.add_argument("snapshot_id", help="the 64-character id `pipeline admit` printed")
    vf.set_defaults(handler=_verify)
    s.set_defaults(handler=lambda args: s.print_help() or 0)


def _admit(args: argparse.Namespace) -> int | None:
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.cli import emit, open_lake
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

    res = admit(open_lake(args), cfg, current_policy_version=args.current_policy_version, dry_run=args.dry_run,
                engine=engine, dask_scheduler=scheduler, target_groups=args.target_groups,
                scope=Scope(args.run_id, args.env, args.task))
    out = res.as_dict(with_receipts=args.dry_run)
    emit(out, args, _admit_text)
    return None


def resolve_engine(engine: str, scheduler: str | None) -> tuple[str, str | None]:
    """``auto`` is dask when a scheduler is configured (the flag or
    $PIPELINE_DASK_SCHEDULER: compose and Kubernetes set it, so the scheduled
    admission job runs on the cluster), else duckdb."""
    import os

    scheduler = scheduler or os.environ.get("PIPELINE_DASK_SCHEDULER") or None
    if engine == "auto":
        engine = "dask" if scheduler else "duckdb"
    return engine, scheduler


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
        t = d["target"]
        lines.append(f"target {t['target_groups']} groups: {t['missing_groups']} missing, admit rate "
                     f"{t['observed_admit_rate']}, sample ~{t['groups_to_sample']} more groups")
    if d.get("snapshot_id"):
        lines.append(f"snapshot {d['snapshot_id']}: {d['admitted_groups']} groups, {d['admitted_members']} members"
                     + ("" if d.get("dry_run") else f", {d['num_tokens']} tokens"))
        lines.append(d["snapshot_id"])
    else:
        lines.append("no snapshot (nothing admitted)")
    return "\n".join(lines)


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _list(args: argparse.Namespace) -> None:
    from pipeline.cli import emit, open_lake, out

    lake = open_lake(args)
    cols = ["snapshot_id", "created_at", "advantage_estimator", "num_groups", "num_members", "num_tokens",
            "current_policy_version"]
    rows = sorted(lake.read("snapshots", columns=cols).to_pylist(), key=lambda r: r["created_at"], reverse=True)
    if args.json:
        emit({"snapshots": rows}, args)
        return
    for r in rows:
        out(f"{r['snapshot_id']}  {r['created_at']:%Y-%m-%d %H:%M:%S}  {r['advantage_estimator']:<20} "
              f"groups={r['num_groups']} members={r['num_members']} tokens={r['num_tokens']} "
              f"policy={r['current_policy_version']}")
    out(f"({len(rows)} snapshot{'s' if len(rows) != 1 else ''})")


def _show(args: argparse.Namespace) -> None:
    import json

    import pyarrow.compute as pc

    from pipeline.admission.snapshot import open_snapshot
    from pipeline.cli import emit, open_lake

    lake = open_lake(args)
    snap = open_snapshot(lake, args.snapshot_id)
    rows = [r for r in lake.read("snapshots").to_pylist() if r["snapshot_id"] == args.snapshot_id]
    rec = lake.read("receipts", columns=["decision", "snapshot_id"])
    rec = rec.filter(pc.equal(rec.column("snapshot_id"), args.snapshot_id))
    out = {"snapshot_id": snap.snapshot_id, "path": snap.path, "manifest_sha256": snap.manifest_sha256,
           "manifest": snap.manifest, "registered": bool(rows), "receipted_groups": rec.num_rows}
    if rows:
        row = rows[0]
        row["source_versions"] = dict(row["source_versions"])
        row["quality"] = json.loads(row.pop("quality_json") or "null")
        row.pop("config_json", None)
        out["row"] = row
    emit(out, args, lambda d: json.dumps(d, indent=1, default=str, sort_keys=True))


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline.admission.snapshot import verify_snapshot
    from pipeline.cli import emit, open_lake

    out = verify_snapshot(open_lake(args), args.snapshot_id)
    emit(out, args, lambda d: f"ok: snapshot {d['snapshot_id']} verifies ({d['members']} members, "
                              f"{d['files']} file(s), registered={d['registered']})\n{d['snapshot_id']}")
    return None
