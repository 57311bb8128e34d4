"""`pipeline snapshots list | show ID | verify ID`: the lake's training-batch snapshots.

    pipeline snapshots verify SNAPSHOT_ID              # rehash the snapshot's files
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.cli import common

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

    from pipeline.snapshots.format import open_snapshot
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


def _verify(args: argparse.Namespace) -> None:
    from pipeline.snapshots.format import verify_snapshot
    from pipeline.cli import emit, open_lake

    out = verify_snapshot(open_lake(args), args.snapshot_id)
    emit(out, args, lambda d: f"ok: snapshot {d['snapshot_id']} verifies ({d['members']} members, "
                              f"{d['files']} file(s), registered={d['registered']})\n{d['snapshot_id']}")
    return None
