"""Care of published checkpoints: retention (``lake maintain --keep-checkpoints``),
unpublished run directories (``lake maintain``), verification (``lake verify``:
every file against its row, as rollout checks it) and repair (``pipeline policy
repair``: retire damaged DeepSpeed state so the version loads again).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from pipeline.policy_store import RETIRABLE, RETIRED_FILE, checkpoint_rows, retired_files, row_rel

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


def retire_checkpoints(lake: Lake, keep: int, *, dry_run: bool = False) -> dict[str, Any]:
    """Remove the DeepSpeed state (``ds/``, ``rng/``) of every published version
    but the newest ``keep`` ones and the parents of interrupted training runs
    (``_checkpoints/_runs/*/run.json``: a resume may carry their optimizer).
    Their ``hf/`` model stays, so every version still loads, rolls out, serves as
    a parent (with a fresh optimizer) and answers lineage queries. The list of
    removed files is written to ``retired.json`` before anything is removed."""
    rows = sorted(checkpoint_rows(lake), key=lambda r: (r["policy_version"], r["created_at"]))
    keep_ids = {r["checkpoint_id"] for r in rows[len(rows) - keep:]} if keep > 0 else set()
    fs, root = lake.filesystem()
    runs = f"{root}/_checkpoints/_runs"
    try:
        infos = fs.get_file_info(pafs.FileSelector(runs, allow_not_found=True, recursive=False))
    except (FileNotFoundError, OSError):
        infos = []
    for info in infos:
        try:
            with fs.open_input_stream(f"{info.path}/run.json") as f:
                keep_ids.add(json.loads(f.read().decode()).get("parent_checkpoint_id"))
        except (FileNotFoundError, OSError, ValueError):
            pass
    report: dict[str, Any] = {"keep_checkpoints": keep, "retired": [], "files_removed": 0, "bytes_removed": 0}
    if keep <= 0:
        return report
    for r in rows:
        cid = r["checkpoint_id"]
        if cid in keep_ids:
            continue
        done = retired_files(lake, cid, rel=row_rel(r))
        todo = sorted(k for k, _ in r["file_sha256"] if k.startswith(RETIRABLE) and k not in done)
        if not todo:
            continue
        base = f"{root}/{row_rel(r)}"
        sizes = {k: fs.get_file_info(f"{base}/{k}").size or 0 for k in todo}
        report["retired"].append({"policy_version": int(r["policy_version"]), "checkpoint_id": cid,
                                  "files": len(todo), "bytes": sum(sizes.values())})
        report["files_removed"] += len(todo)
        report["bytes_removed"] += sum(sizes.values())
        if dry_run:
            continue
        _retire(lake, base, done, todo)
    return report


def _retire(lake: Lake, base: str, done: set[str], todo: list[str], why: str | None = None) -> None:
    """Record ``todo`` as removed in ``base``/retired.json (first: a crash leaves files
    it allows missing), then delete them and ``ds/``, ``rng/``."""
    fs, _ = lake.filesystem()
    body = json.dumps({"removed": sorted(done | set(todo)), "at": datetime.now(timezone.utc).isoformat()}
                      | ({"damaged": sorted(todo), "why": why} if why else {}), indent=1).encode()
    tmp = f"{base}/.{RETIRED_FILE}.tmp{os.getpid()}"
    if lake.is_local:
        Path(base).mkdir(parents=True, exist_ok=True)
    with fs.open_output_stream(tmp) as f:
        f.write(body)
    fs.move(tmp, f"{base}/{RETIRED_FILE}")
    for k in todo:
        try:
            fs.delete_file(f"{base}/{k}")
        except (FileNotFoundError, OSError):
            pass
    for d in ("ds", "rng"):
        try:
            fs.delete_dir(f"{base}/{d}")
        except (FileNotFoundError, OSError):
            pass


# -- verification and repair --------------------------------------------------------------------


def _sha256(fs: Any, path: str) -> str | None:
    h = hashlib.sha256()
    try:
        with fs.open_input_stream(path) as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except (FileNotFoundError, OSError):
        return None
    return h.hexdigest()


def check_checkpoint(lake: Lake, row: dict[str, Any]) -> dict[str, list[str]]:
    """{missing: [...], mismatched: [...]}: the files of one published row (less those
    retention removed) that are absent or do not hash to the row's sha256, read
    from the lake itself (no cache), as ``resolve_policy`` checks them before use."""
    fs, root = lake.filesystem()
    rel = row_rel(row)
    gone = retired_files(lake, row["checkpoint_id"], rel=rel)
    out: dict[str, list[str]] = {"missing": [], "mismatched": []}
    for name, sha in sorted(dict(row["file_sha256"]).items()):
        if name in gone:
            continue
        got = _sha256(fs, f"{root}/{rel}/{name}")
        if got is None:
            out["missing"].append(name)
        elif got != sha:
            out["mismatched"].append(name)
    return out


def _reason(row: dict[str, Any], bad: dict[str, list[str]]) -> str:
    parts = ([f"sha256 mismatch for {bad['mismatched'][:5]}"] if bad["mismatched"] else []) + \
        ([f"file(s) missing: {bad['missing'][:5]}"] if bad["missing"] else [])
    return (f"checkpoint {row['checkpoint_id']} (policy version {row['policy_version']}, {row_rel(row)}): "
            f"{'; '.join(parts)}")


def verify_checkpoints(lake: Lake, *, newest_only: bool = False) -> dict[str, Any]:
    """{checked, problems: [...]}: every published checkpoint's files (``newest_only``:
    the newest version's, what rollout loads) against their recorded sha256
    (``check_checkpoint``), one line per damaged version."""
    rows = sorted(checkpoint_rows(lake), key=lambda r: (r["policy_version"], r["created_at"]))
    rows = rows[-1:] if newest_only else rows
    problems = []
    for r in rows:
        bad = check_checkpoint(lake, r)
        if bad["missing"] or bad["mismatched"]:
            problems.append(_reason(r, bad) + " (pipeline policy repair)")
    return {"checked": len(rows), "problems": problems}


def repair_checkpoints(lake: Lake, *, dry_run: bool = False) -> dict[str, Any]:
    """Make every published version load again where its model is intact: a version
    whose damaged or missing files are all DeepSpeed state (``ds/``, ``rng/``, what two
    trainers overwriting one directory damaged) gets them retired as retention does
    (recorded in ``retired.json`` with the reason, then deleted): its ``hf/`` model
    verifies, rollout loads it, and a resident trainer rebuilds its optimizer by replay
    or starts a fresh one. A version whose ``hf/`` files are damaged is reported as
    ``unrepairable`` (its model is lost: restore the files from a copy)."""
    fs, root = lake.filesystem()
    rows = sorted(checkpoint_rows(lake), key=lambda r: (r["policy_version"], r["created_at"]))
    out: dict[str, Any] = {"checked": len(rows), "repaired": [], "unrepairable": [], "dry_run": dry_run}
    for r in rows:
        bad = check_checkpoint(lake, r)
        damaged = sorted(bad["missing"] + bad["mismatched"])
        if not damaged:
            continue
        entry = {"policy_version": int(r["policy_version"]), "checkpoint_id": r["checkpoint_id"],
                 "files": damaged, "reason": _reason(r, bad)}
        if not all(k.startswith(RETIRABLE) for k in damaged):
            out["unrepairable"].append(entry)
            continue
        rel = row_rel(r)
        done = retired_files(lake, r["checkpoint_id"], rel=rel)
        state = sorted(k for k, _ in r["file_sha256"] if k.startswith(RETIRABLE) and k not in done)
        entry["retired"] = state      # the whole DeepSpeed state: a partly damaged one is not loadable
        out["repaired"].append(entry)
        if not dry_run:
            _retire(lake, f"{root}/{rel}", done, state, why=entry["reason"])
    return out


TRAIN_LINE_LEASE = "train-line"    # held by every trainer while it trains and publishes (pipeline.train.hold)


def remove_unpublished_checkpoints(lake: Lake, *, min_age_s: float, dry_run: bool = False) -> list[str]:
    """Delete run directories ``_checkpoints/<id>.<run tag>/`` no checkpoints row
    names (a run killed before its publication, or a loser killed before deleting
    its files) whose newest file is older than ``min_age_s``. Nothing is removed
    while a trainer holds the line's lease (its directory may be about to be published)."""
    from pipeline.lake.lease import holder

    if holder(lake, TRAIN_LINE_LEASE) is not None:
        return []
    fs, root = lake.filesystem()
    named = {row_rel(r) for r in checkpoint_rows(lake)}
    try:
        infos = fs.get_file_info(pafs.FileSelector(f"{root}/_checkpoints", allow_not_found=True, recursive=False))
    except (FileNotFoundError, OSError):
        return []
    removed = []
    for info in infos:
        name = info.path.rsplit("/", 1)[-1]
        rel = f"_checkpoints/{name}"
        if info.type != pafs.FileType.Directory or name.startswith("_") or "." not in name or rel in named:
            continue
        files = fs.get_file_info(pafs.FileSelector(info.path, recursive=True))
        newest = max((f.mtime.timestamp() for f in files if f.mtime is not None), default=0.0)
        if time.time() - newest < min_age_s:
            continue
        removed.append(rel)
        if not dry_run:
            fs.delete_dir(info.path)
    return removed
