"""`pipeline lake maintain | verify | info | migrate`: lake maintenance, inspection and upgrades."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import common

    lake = sub.add_parser("lake", help="lake maintenance and inspection")
    lsub = lake.add_subparsers(dest="lake_command", metavar="ACTION")
    m = common(lsub.add_parser("maintain", help="compact small files, write checkpoints, vacuum what no snapshot needs"))
    m.add_argument("--retention-hours", type=int, default=168,
                   help="vacuum files removed from the log longer ago than this (default 168 = 7 days)")
    m.add_argument("--dry-run", action="store_true", help="report what vacuum would delete")
    m.add_argument("--table", action="append", default=None, metavar="NAME",
                   help="only these tables (repeatable; default: every table)")
    m.add_argument("--orphan-age-minutes", type=float, default=None,
                   help="remove data files no commit references (and _snapshots/.tmp-* directories) once they "
                        "are this old (default 60: a live writer never commits a file older than 30 minutes)")
    m.add_argument("--keep-checkpoints", type=int, default=None, metavar="N",
                   help="sets the keep_checkpoints key: DeepSpeed states of all but the newest N policy versions "
                        "are removed (hf/ models stay)")
    from pipeline.clikit import add_config_options

    add_config_options(m)
    m.set_defaults(handler=_maintain)
    v = common(lsub.add_parser("verify", help="check that every file of every table's current version exists and "
                                              "reads, that every snapshot verifies and that every published "
                                              "checkpoint's files match their sha256 (exit 1 otherwise)"))
    v.add_argument("--table", action="append", default=None, metavar="NAME",
                   help="only these tables (repeatable; default: every table)")
    v.add_argument("--no-snapshots", action="store_true", help="skip rehashing the snapshots' files")
    v.set_defaults(handler=_verify)
    i = common(lsub.add_parser("info", help="tables, versions, row and file counts, sizes"))
    i.set_defaults(handler=_info)
    g = common(lsub.add_parser(
        "migrate", help="upgrade a lake written by an earlier version in place (backfill derived columns)",
        description="Backfill the derived columns (row_key, oldest_version, response_len, prompt_hash) that "
                    "lakes written by earlier versions lack, rewriting their files with dataChange=false under "
                    "the write protocol. Resumable after a kill; a no-op on a current lake. Stop writers first."))
    g.add_argument("--dry-run", action="store_true", help="report the tables and files it would rewrite")
    g.set_defaults(handler=_migrate)
    lake.set_defaults(handler=lambda a: lake.print_help())


def _maintain(args: argparse.Namespace) -> None:
    from pipeline.clikit import emit, open_lake
    from pipeline.errors import ConfigError
    from pipeline.maintain import maintain
    from pipeline.schema import ALL_TABLES

    if args.retention_hours < 0:
        raise ConfigError(f"--retention-hours {args.retention_hours}: must be >= 0")
    if args.orphan_age_minutes is not None and args.orphan_age_minutes < 0:
        raise ConfigError(f"--orphan-age-minutes {args.orphan_age_minutes}: must be >= 0")
    unknown = sorted(set(args.table or ()) - set(ALL_TABLES))
    if unknown:
        raise ConfigError(f"unknown table(s) {', '.join(unknown)}", hint=f"tables: {', '.join(ALL_TABLES)}")
    from pipeline.config import load_config, parse_set
    from pipeline.maintain import MaintainConfig

    over = parse_set(args.set)
    if args.keep_checkpoints is not None:
        over["keep_checkpoints"] = args.keep_checkpoints
    cfg = load_config(MaintainConfig, args.config, over)
    age = None if args.orphan_age_minutes is None else args.orphan_age_minutes * 60
    out = maintain(open_lake(args), retention_hours=args.retention_hours, dry_run=args.dry_run, tables=args.table,
                   orphan_min_age_s=age, keep_checkpoints=cfg.keep_checkpoints)
    emit(out, args, _maintain_text)
    ver = out.get("verify")
    if ver is not None and not ver["ok"]:   # maintenance itself succeeded: its exit code stays 0
        import sys

        print(f"warning: lake verify found {len(ver['problems'])} problem(s) (listed in the report); "
              "`pipeline lake verify` exits non-zero on them", file=sys.stderr)


def _verify(args: argparse.Namespace) -> int | None:
    from pipeline.clikit import emit, open_lake
    from pipeline.errors import ConfigError
    from pipeline.maintain import verify
    from pipeline.schema import ALL_TABLES

    unknown = sorted(set(args.table or ()) - set(ALL_TABLES))
    if unknown:
        raise ConfigError(f"unknown table(s) {', '.join(unknown)}", hint=f"tables: {', '.join(ALL_TABLES)}")
    out = verify(open_lake(args), args.table, snapshots=not args.no_snapshots)
    emit(out, args, _verify_text)
    from pipeline.clikit import EXIT_NOTHING_DONE

    return None if out["ok"] else EXIT_NOTHING_DONE


def _verify_text(r: dict[str, Any]) -> str:
    lines = [f"{t}: version {v['version']}, {v['files']} files, "
             + ("ok" if not v["problems"] else f"{len(v['problems'])} problem(s)") for t, v in r["tables"].items()]
    lines.append(f"snapshots: {r['snapshots']['checked']} checked, "
                 + ("ok" if not r["snapshots"]["problems"] else f"{len(r['snapshots']['problems'])} problem(s)"))
    ck = r.get("checkpoints") or {"checked": 0, "problems": []}
    lines.append(f"checkpoints: {ck['checked']} published version(s) rehashed, "
                 + ("ok" if not ck["problems"] else f"{len(ck['problems'])} problem(s)"))
    lines += [f"  {p}" for p in r["problems"]]
    lines.append("ok: every referenced file is there and reads" if r["ok"] else
                 "FAILED: restore the files listed from a copy (or time-travel to a version that has them)"
                 + ("; damaged checkpoints: pipeline policy repair" if ck["problems"] else ""))
    return "\n".join(lines)


def _write_path_text(v: dict[str, Any]) -> str:
    """What maintenance found of the write path's damage (docs/write-protocol.md), if anything."""
    out = ""
    if v.get("future_dated_orphans_waiting"):
        out += (f"; {v['future_dated_orphans_waiting']} orphan file(s) dated in the future wait out the age guard "
                "from their first sighting")
    if v.get("damaged_intents_set_aside") or v.get("damaged_intents_removed"):
        out += (f"; damaged commit intents: {v.get('damaged_intents_set_aside', 0)} set aside, "
                f"{v.get('damaged_intents_removed', 0)} removed")
    return out


def _maintain_text(r: dict[str, Any]) -> str:
    lines = []
    for t, v in r["tables"].items():
        kept = f" (kept versions {', '.join(map(str, v['kept_versions']))})" if v.get("kept_versions") else ""
        if r.get("dry_run"):
            lines.append(f"{t}: {v['files_before']} files; compaction would rewrite {v['would_compact_files']} "
                         f"(~{v['files_after_estimate']} files after); a checkpoint would be written at the next "
                         f"version; vacuum would now delete {v['would_vacuum']} file(s); "
                         f"{v['would_remove_orphans']} orphan file(s) would be removed{kept}")
        else:
            lines.append(f"{t}: files {v['files_before']} -> {v['files_after']}, checkpoint at version "
                         f"{v['version']}, vacuum deleted {v['vacuumed']} file(s), removed {v['orphans_removed']} "
                         f"orphan file(s){kept}{_write_path_text(v)}")
    temps = r.get("snapshot_temp_dirs_removed") or []
    if temps:
        lines.append(f"_snapshots: {'would remove' if r.get('dry_run') else 'removed'} {len(temps)} temporary "
                     f"director{'y' if len(temps) == 1 else 'ies'}")
    dirs = r.get("checkpoint_dirs_removed") or []
    if dirs:
        lines.append(f"_checkpoints: {'would remove' if r.get('dry_run') else 'removed'} {len(dirs)} unpublished "
                     f"run director{'y' if len(dirs) == 1 else 'ies'}")
    ck = r.get("checkpoints")
    if ck:
        verb = "would remove" if r.get("dry_run") else "removed"
        lines.append(f"checkpoints: {verb} the DeepSpeed state of {len(ck['retired'])} old version(s) "
                     f"({ck['files_removed']} files, {ck['bytes_removed'] / 2**20:.1f} MiB); kept the newest "
                     f"{ck['keep_checkpoints']} and every hf/ model")
    ver = r.get("verify")
    if ver is not None:
        lines.append("verify: ok" if ver["ok"] else
                     "verify: FAILED\n" + "\n".join(f"  {p}" for p in ver["problems"]))
    if r.get("dry_run") and lines:
        lines.append("dry run: nothing was changed")
    return "\n".join(lines) or "no tables"


def _migrate(args: argparse.Namespace) -> None:
    from pipeline.clikit import emit, open_lake
    from pipeline.lake.migrate import migrate

    emit(migrate(open_lake(args, check_layout=False), dry_run=args.dry_run), args, _migrate_text)


def _migrate_text(r: dict[str, Any]) -> str:
    if not r["tables"]:
        return f"lake {r['lake']} is current: nothing to migrate"
    verb = "would rewrite" if r["dry_run"] else "rewrote"
    lines = [f"{t}: {verb} {v['outdated_files'] if r['dry_run'] else v['rewritten']} file(s) to backfill "
             f"{', '.join(v['missing'])}" + ("" if r["dry_run"] else f" in {v['commits']} commit(s)")
             for t, v in r["tables"].items()]
    lines.append("dry run: nothing was changed" if r["dry_run"] else
                 ("the lake is current" if r["current"] else "not current yet: run it again"))
    return "\n".join(lines)


def _info(args: argparse.Namespace) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipeline.clikit import emit, open_lake
    from pipeline.schema import ALL_TABLES

    lake = open_lake(args, check_layout=False)   # inspection works on any layout
    tables = {}
    for name in ALL_TABLES:
        if not lake.exists(name):
            continue
        dt = lake.table(name)
        adds = pa.table(dt.get_add_actions(flatten=True))
        size = int(pc.sum(adds.column("size_bytes")).as_py() or 0) if adds.num_rows else 0
        tables[name] = {"version": dt.version(), "files": adds.num_rows, "rows": dt.count(), "bytes": size}
    emit({"lake": lake.uri, "tables": tables, "bytes": sum(v["bytes"] for v in tables.values())}, args, _info_text)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _info_text(r: dict[str, Any]) -> str:
    lines = [f"lake {r['lake']}"]
    lines += [f"  {t}: version {v['version']}, {v['rows']} rows in {v['files']} files, {human_bytes(v['bytes'])}"
              for t, v in r["tables"].items()]
    lines.append(f"  total: {human_bytes(r['bytes'])} in live data files" if r["tables"] else "  no tables yet")
    return "\n".join(lines)
