"""`pipeline snapshots list | show ID | verify ID`: the lake's training-batch snapshots.

    pipeline snapshots verify SNAPSHOT_ID              # rehash the snapshot's files
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import common

    s = sub.add_parser("snapshots", help="list, show and verify batch snapshots")
    ssub = s.add_subparsers(dest="snapshots_command", metavar="ACTION")
    ls = common(ssub.add_parser("list", help="every snapshot of the lake, newest first"))
    ls.set_defaults(handler=_list)
    sh = common(ssub.add_parser("show", help="a snapshot's row, manifest and decision counts"))
    sh.add_argument("snapshot_id", help="the id `pipeline admit` printed, or a unique prefix of it (>= 6 characters)")
    sh.set_defaults(handler=_show)
    vf = common(ssub.add_parser("verify", help="rehash a snapshot's files against its manifest and the table"))
    vf.add_argument("snapshot_id", help="the id `pipeline admit` printed, or a unique prefix of it (>= 6 characters)")
    vf.set_defaults(handler=_verify)
    s.set_defaults(handler=lambda args: s.print_help() or 0)


def _list(args: argparse.Namespace) -> None:
    from pipeline.clikit import emit, open_lake, out

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

    from pipeline.clikit import emit, open_lake
    from pipeline.snapshots.format import open_snapshot, resolve_snapshot_id

    lake = open_lake(args)
    snapshot_id = resolve_snapshot_id(lake, args.snapshot_id)
    snap = open_snapshot(lake, snapshot_id)
    rows = [r for r in lake.read("snapshots").to_pylist() if r["snapshot_id"] == snapshot_id] \
        if lake.exists("snapshots") else []
    rec = lake.read("receipts", columns=["decision", "snapshot_id"])
    rec = rec.filter(pc.equal(rec.column("snapshot_id"), snapshot_id))
    out = {"snapshot_id": snap.snapshot_id, "path": snap.path, "manifest_sha256": snap.manifest_sha256,
           "manifest": snap.manifest, "registered": bool(rows), "receipted_groups": rec.num_rows}
    if rows:
        row = rows[0]
        row["source_versions"] = dict(row["source_versions"])
        row["quality"] = json.loads(row.pop("quality_json") or "null")
        row.pop("config_json", None)
        out["row"] = row
    emit(out, args, _show_text)


def _show_text(d: dict) -> str:
    """The snapshot as a person reads it (``--json`` gives the whole document)."""
    m, row = d["manifest"], d.get("row") or {}
    lines = [f"snapshot {d['snapshot_id']}",
             f"  path:        {d['path']}",
             f"  registered:  {'yes' if d['registered'] else 'no (files only: its snapshots row is missing)'}",
             f"  estimator:   {m.get('advantage_estimator', row.get('advantage_estimator', '-'))}",
             f"  members:     {m.get('num_members', row.get('num_members', '-'))}"
             + (f" in {row['num_groups']} groups, {row['num_tokens']} tokens" if row else ""),
             f"  receipts:    {d['receipted_groups']} group decision(s) point at it"]
    if row:
        lines += [f"  created:     {row.get('created_at')}",
                  f"  policy:      current version {row.get('current_policy_version')} at admission",
                  f"  config:      {row.get('config_hash')}",
                  "  sources:     " + (", ".join(_source(k, v) for k, v in sorted(row.get("source_versions", {}).items()))
                                      or "-")]
        quality = _flat_quality(row.get("quality"))
        if quality:
            lines.append("  quality:     " + ", ".join(f"{k}={v}" for k, v in quality))
    files = m.get("files", {})
    sizes = [f"{name} ({meta['rows']} rows, {meta['bytes']:,} bytes)" if "bytes" in meta else name
             for name, meta in files.items()]
    lines.append(f"  files:       {', '.join(sizes)}")
    lines.append(f"  manifest:    sha256 {d['manifest_sha256']}")
    lines.append("(--json prints the whole manifest and row)")
    return "\n".join(lines)


def _source(table: str, version: int) -> str:
    """``trajectories@v3``; version -1 is a table that did not exist yet when the snapshot was cut."""
    return f"{table}@v{version}" if version >= 0 else f"{table} (not yet created)"


def _flat_quality(quality) -> list[tuple[str, object]]:
    """The quality summary's scalars, nested ones as ``outer.inner``; empty ones left out."""
    if not isinstance(quality, dict):
        return []
    out: list[tuple[str, object]] = []
    for k, v in sorted(quality.items()):
        if isinstance(v, dict):
            out += [(f"{k}.{ik}", iv) for ik, iv in sorted(v.items()) if not isinstance(iv, (dict, list))]
        elif isinstance(v, list):
            if v:
                out.append((k, len(v)))
        elif v is not None:
            out.append((k, v))
    return out


def _verify(args: argparse.Namespace) -> None:
    from pipeline.clikit import emit, open_lake
    from pipeline.snapshots.format import resolve_snapshot_id, verify_snapshot

    lake = open_lake(args)
    out = verify_snapshot(lake, resolve_snapshot_id(lake, args.snapshot_id))
    emit(out, args, lambda d: f"ok: snapshot {d['snapshot_id']} verifies ({d['members']} members, "
                              f"{d['files']} file(s), registered={d['registered']})\n{d['snapshot_id']}")
    return None
