"""The storage half of `pipeline lake verify`: is every file the tables' current
versions reference there and readable?

For every table, each data file of its latest version must exist with the
size its add action records and have a readable Parquet footer whose row
count matches the action's statistics (when it has them). On keyed tables no
damaged or set-aside group-commit intent and no untrusted key index may be
left (:func:`write_path_problems`). The snapshot half
(every registered snapshot verifies) and the whole check are
:func:`pipeline.maintain.verify`, a layer above storage; `lake maintain` runs
it after compaction, checking snapshot files by size instead of rehashing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
        problems += write_path_problems(lake, name)
        out[name] = {"version": dt.version(), "files": len(adds), "problems": problems}
    return out


def write_path_problems(lake: Lake, name: str) -> list[str]:
    """What the write path left damaged in table ``name``: group-commit intents that are damaged or
    were set aside as damaged (docs/write-protocol.md, "Damaged intents")."""
    from pipeline.schema import table_spec

    if not table_spec(name).enforces_key or not (lake.is_local or lake.uri.startswith("s3://")):
        return []
    return damaged_intent_problems(lake, name) + key_index_problems(lake, name)


def damaged_intent_problems(lake: Lake, name: str) -> list[str]:
    """One line per damaged group-commit intent of ``name`` (pending, or set aside by a writer)."""
    from pipeline.lake.delta import damaged, group

    out = [f"{name}: commit intent {rid} is damaged ({why}); `pipeline lake maintain` sets it aside"
           for rid, why in group.inspect_damaged(lake, name)]
    out += [f"{name}: commit intent {rid.removeprefix(damaged.DAMAGED_PREFIX)} was set aside as damaged "
            f"({damaged.describe(body)}); `pipeline lake maintain` removes it" for rid, body in damaged.records(lake, name)]
    return out


def key_index_problems(lake: Lake, name: str) -> list[str]:
    """One line per key index of ``name`` an append would not trust (forged, damaged, of another table
    or history: docs/write-protocol.md, "The key index can only cost time"), or whose keys are not those
    the table's files hold at its version (recomputed from the files)."""
    import hashlib

    import numpy as np
    import pyarrow.fs as pafs

    from pipeline.lake.delta import keyindex

    fs, _ = lake.filesystem()
    try:
        infos = fs.get_file_info(pafs.FileSelector(keyindex.index_base(lake, name), allow_not_found=True))
    except OSError:
        return []
    dt = lake.table(name)
    out = []
    for info in sorted(infos, key=lambda i: i.path):
        fname = info.path.rsplit("/", 1)[-1]
        stem, _, ext = fname.partition(".")
        if not (fname.startswith("keys-") and stem[len("keys-"):].isdigit() and ext in ("idx", "npy")):
            continue
        v = int(stem[len("keys-"):])
        try:
            if ext != "idx" or v > dt.version():
                raise ValueError("an older format" if ext != "idx" else f"version {v} is not in the table")
            with fs.open_input_stream(info.path) as f:
                raw = f.read()
            entry = keyindex.commit_file(lake, name, v)
            keys = keyindex.decode_index(raw, table=name, table_id=str(dt.metadata().id), version=v,
                                         commit=None if entry is None else hashlib.sha256(entry).hexdigest(),
                                         anchor=keyindex.index_anchor(entry))
            at = lake.table(name, version=v)
            if not np.array_equal(keys, np.sort(keyindex.read_keys(lake, name, lake.live_files(at)))):
                raise ValueError(f"its keys are not the keys the table's files hold at version {v}")
        except (ValueError, OSError) as exc:
            out.append(f"{name}: key index {fname} is not trusted ({exc}); appends read the keys from the table "
                       "and `pipeline lake maintain` writes a new index")
    return out
