"""`pipeline lake verify`: is everything the lake's current versions reference
there and readable?

For every table, each data file of its latest version must exist with the
size its add action records and have a readable Parquet footer whose row
count matches the action's statistics (when it has them); every snapshot the
``snapshots`` table registers must verify (:func:`verify_snapshot`: every file
rehashed against its manifest). `lake maintain` runs it after compaction,
checking snapshot files by size instead of rehashing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.errors import PipelineError
from pipeline.schema import ALL_TABLES

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


def verify_tables(lake: Lake, tables: list[str] | None = None) -> dict[str, Any]:
    """table -> {version, files, problems: [...]} for the latest version of each table."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    from urllib.parse import unquote

    fs, root = lake.filesystem()
    out: dict[str, Any] = {}
    for name in tables or list(ALL_TABLES):
        if not lake.exists(name):
            continue
        problems: list[str] = []
        try:
            dt = lake.table(name)
            t = pa.table(dt.get_add_actions(flatten=True))
            adds = t.select([c for c in ("path", "size_bytes", "num_records") if c in t.column_names]).to_pylist()
        except Exception as exc:  # noqa: BLE001 - an unreadable log is a finding, reported with the rest
            out[name] = {"version": None, "files": 0, "problems": [f"the log does not load: {exc}"]}
            continue
        paths = [f"{root}/{name}/{unquote(a['path'])}" for a in adds]
        infos = fs.get_file_info(paths) if paths else []
        for a, path, info in zip(adds, paths, infos):
            rel = f"{name}/{unquote(a['path'])}"
            if info.type != pafs.FileType.File:
                problems.append(f"{rel}: missing")
                continue
            if a.get("size_bytes") is not None and info.size != a["size_bytes"]:
                problems.append(f"{rel}: {info.size} bytes, the log says {a['size_bytes']}")
                continue
            try:
                with fs.open_input_file(path) as f:
                    rows = pq.ParquetFile(f).metadata.num_rows
            except Exception as exc:  # noqa: BLE001 - whatever Arrow says, the file does not read
                problems.append(f"{rel}: does not read as Parquet ({exc})")
                continue
            want = a.get("num_records")
            if want is not None and rows != want:
                problems.append(f"{rel}: {rows} rows, the log says {want}")
        out[name] = {"version": dt.version(), "files": len(adds), "problems": problems}
    return out


def verify_snapshots(lake: Lake, *, rehash: bool = True) -> dict[str, Any]:
    """{checked, problems: [...]} over every snapshot the ``snapshots`` table registers:
    each verifies (``rehash``: every file rehashed against its manifest), or, without
    ``rehash``, its manifest opens and names files present with their recorded sizes."""
    from pipeline.snapshots.format import open_snapshot, verify_snapshot

    if not lake.exists("snapshots"):
        return {"checked": 0, "problems": []}
    ids = sorted(set(lake.read("snapshots", columns=["snapshot_id"]).column(0).to_pylist()))
    problems = []
    for sid in ids:
        try:
            if rehash:
                verify_snapshot(lake, sid)
            else:
                snap = open_snapshot(lake, sid)
                lake.check_files({f"{snap.path}/{n}": int(i["bytes"]) for n, i in snap.manifest["files"].items()},
                                 what=f"snapshot {sid}")
        except PipelineError as exc:
            problems.append(f"snapshot {sid}: {exc.message}")
        except Exception as exc:  # noqa: BLE001 - a payload that does not read at all
            problems.append(f"snapshot {sid}: {type(exc).__name__}: {exc}")
    return {"checked": len(ids), "problems": problems}


def verify(lake: Lake, tables: list[str] | None = None, *, snapshots: bool = True,
           rehash: bool = True) -> dict[str, Any]:
    """The whole check: ``ok`` is False when anything is missing or unreadable;
    ``problems`` lists each finding as one line. ``rehash=False`` checks snapshot
    files by size instead of rehashing them (what ``lake maintain`` runs)."""
    t = verify_tables(lake, tables)
    s: dict[str, Any] = verify_snapshots(lake, rehash=rehash) if snapshots else {"checked": 0, "problems": []}
    problems = [p for v in t.values() for p in v["problems"]] + s["problems"]
    return {"ok": not problems, "tables": t, "snapshots": s, "problems": problems}
