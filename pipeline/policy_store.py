"""Policy versions, published through the ``checkpoints`` table.

A policy version is a checkpoint directory ``<lake>/_checkpoints/<checkpoint_id>/``
holding at least ``hf/`` (a Hugging Face model directory: config.json,
model.safetensors, tokenizer files) that the rollout engines and the trainer
load. Publication = appending the checkpoints row (with the sha256 of every
file) *after* every file is written, so a reader that resolves "the newest
version" through the table never sees a half-written one. Loaders rehash the
files against the row before use: checkpoints contain pickles (optimizer
state), and only hash-verified, project-produced ones are ever loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline import __version__
from pipeline.errors import IntegrityError, NotFoundError

HF_SUBDIR = "hf"
_VERIFIED: dict[tuple[str, str], tuple] = {}  # (local dir, checkpoint id) -> (hashes, file stats) verified


def _stats(local: Path, files: dict[str, str]) -> dict[str, tuple[int, int] | None]:
    out: dict[str, tuple[int, int] | None] = {}
    for rel in files:
        try:
            st = (local / rel).stat()
            out[rel] = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            out[rel] = None
    return out


@dataclass(frozen=True)
class PolicyRef:
    checkpoint_id: str
    policy_version: int
    path: Path                  # local checkpoint directory
    file_sha256: dict[str, str]
    hf_path: Path | None = None  # set for a user's plain HF directory (no checkpoint around it)

    @property
    def hf_dir(self) -> Path:
        return self.hf_path if self.hf_path is not None else self.path / HF_SUBDIR


def checkpoint_rel(checkpoint_id: str) -> str:
    return f"_checkpoints/{checkpoint_id}"


def local_checkpoint_dir(lake, checkpoint_id: str) -> Path:
    """Where a checkpoint's files live on this machine (the lake itself when local;
    a cache directory for object-store lakes, filled by ``fetch_checkpoint``)."""
    if lake.is_local:
        return Path(lake.uri) / checkpoint_rel(checkpoint_id)
    cache = Path(os.environ.get("PIPELINE_CACHE", Path.home() / ".cache" / "pipeline"))
    return cache / "checkpoints" / hashlib.sha256(lake.uri.encode()).hexdigest()[:12] / checkpoint_id


def code_version() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
    except Exception:
        sha = ""
    return f"{__version__}+{sha}" if sha else __version__


def hash_dir(path: Path) -> dict[str, str]:
    """relative path -> sha256 for every file under ``path``."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            out[p.relative_to(path).as_posix()] = h.hexdigest()
    return out


def verify_dir(path: Path, expected: dict[str, str], *, what: str) -> None:
    actual = hash_dir(path)
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise IntegrityError(f"{what}: file(s) missing: {missing[:5]}", hint="the checkpoint is incomplete or was moved")
    bad = sorted(k for k in expected if actual[k] != expected[k])
    if bad:
        raise IntegrityError(f"{what}: sha256 mismatch for {bad[:5]}",
                             hint="the files were modified after publication; refusing to load them")


def _rows(lake) -> list[dict[str, Any]]:
    if not lake.exists("checkpoints"):
        return []
    t = lake.read("checkpoints", columns=["checkpoint_id", "policy_version", "path", "file_sha256", "created_at"])
    return t.to_pylist()


def latest_policy_version(lake) -> int | None:
    rows = _rows(lake)
    return max((r["policy_version"] for r in rows), default=None)


def next_policy_version(lake) -> int:
    v = latest_policy_version(lake)
    return 0 if v is None else v + 1


def resolve_policy(lake, spec: str | int | None = None, *, verify: bool = True) -> PolicyRef:
    """A policy by version number, checkpoint id, ``latest`` (None), or a local
    HF directory path (not verified: a user's own model)."""
    if isinstance(spec, str) and spec not in ("latest",) and not spec.isdigit():
        p = Path(spec)
        if p.is_dir():
            hf = p if (p / "config.json").exists() else p / HF_SUBDIR
            return PolicyRef(checkpoint_id=p.name, policy_version=-1, path=p, file_sha256={}, hf_path=hf)
    rows = _rows(lake)
    if not rows:
        raise NotFoundError(f"no published policy in lake {lake.uri}", hint="run: pipeline policy init")
    if spec is None or spec == "latest":
        row = max(rows, key=lambda r: (r["policy_version"], r["created_at"]))
    elif isinstance(spec, int) or str(spec).isdigit():
        matches = [r for r in rows if r["policy_version"] == int(spec)]
        if not matches:
            raise NotFoundError(f"policy version {spec} is not published",
                                hint=f"published: {sorted({r['policy_version'] for r in rows})}")
        row = max(matches, key=lambda r: r["created_at"])
    else:
        matches = [r for r in rows if r["checkpoint_id"] == spec]
        if not matches:
            raise NotFoundError(f"checkpoint {spec} not found")
        row = matches[0]
    files = dict(row["file_sha256"])
    local = fetch_checkpoint(lake, row["checkpoint_id"], files)
    key = (str(local), row["checkpoint_id"])
    if verify and _VERIFIED.get(key) != (files, _stats(local, files)):
        # rehash only when the files changed since this process last verified them:
        # rollout workers following the newest policy resolve it every wave
        verify_dir(local, files, what=f"checkpoint {row['checkpoint_id']}")
        _VERIFIED[key] = (files, _stats(local, files))
    return PolicyRef(row["checkpoint_id"], int(row["policy_version"]), local, files)


def fetch_checkpoint(lake, checkpoint_id: str, files: dict[str, str]) -> Path:
    """Make a checkpoint's files available locally (no-op for a local lake)."""
    local = local_checkpoint_dir(lake, checkpoint_id)
    if lake.is_local:
        return local
    fs, root = lake.filesystem()
    for rel, sha in files.items():
        dst = local / rel
        if dst.exists() and hashlib.sha256(dst.read_bytes()).hexdigest() == sha:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(f"{root}/{checkpoint_rel(checkpoint_id)}/{rel}") as f:
            dst.write_bytes(f.read())
    return local


def upload_checkpoint(lake, checkpoint_id: str, local: Path) -> None:
    """Copy a locally written checkpoint into an object-store lake (no-op when local)."""
    if lake.is_local:
        return
    fs, root = lake.filesystem()
    for p in sorted(local.rglob("*")):
        if p.is_file():
            dst = f"{root}/{checkpoint_rel(checkpoint_id)}/{p.relative_to(local).as_posix()}"
            fs.create_dir(dst.rsplit("/", 1)[0], recursive=True)
            with fs.open_output_stream(dst) as f:
                f.write(p.read_bytes())


POLICY_VERSION_APP = "pipeline.policy_version"  # its version = the newest published policy version + 1


def publish_checkpoint(lake, *, checkpoint_id: str, policy_version: int | None, parent_checkpoint_id: str | None,
                       snapshot_ids: list[str], train_config: dict[str, Any], train_config_hash: str,
                       seed: int, world_size: int = 1, global_step: int = 0, samples_seen: int = 0,
                       metrics: dict[str, Any] | None = None, command: str = "train") -> dict[str, Any]:
    """Hash every file of the (fully written) checkpoint directory and append its
    row: from this commit on, the policy version is published.

    ``policy_version=None`` takes the next free version. Two publishers racing for
    one version: the checkpoints commit carries version v+1 of the application
    transaction ``pipeline.policy_version``, which delta-rs lets only one commit
    take; the other re-reads and takes the next version (or, with an explicit
    ``policy_version``, fails with a ConflictError). Re-publishing the same
    checkpoint id is a no-op that returns the version it already has."""
    from pipeline.errors import ConflictError
    from pipeline.lake.delta import LockTaken

    local = local_checkpoint_dir(lake, checkpoint_id)
    if not (local / HF_SUBDIR / "config.json").exists():
        raise NotFoundError(f"checkpoint {checkpoint_id} has no {HF_SUBDIR}/config.json at {local}")
    files = hash_dir(local)
    upload_checkpoint(lake, checkpoint_id, local)
    row = {
        "checkpoint_id": checkpoint_id,
        "parent_checkpoint_id": parent_checkpoint_id,
        "snapshot_ids": list(snapshot_ids),
        "policy_version": -1,
        "path": checkpoint_rel(checkpoint_id),
        "train_config_hash": train_config_hash,
        "train_config_json": json.dumps(train_config, sort_keys=True, default=str),
        "code_version": code_version(),
        "seed": int(seed),
        "world_size": int(world_size),
        "global_step": int(global_step),
        "samples_seen": int(samples_seen),
        "metrics_json": json.dumps(metrics or {}, sort_keys=True, default=str),
        "file_sha256": list(files.items()),
        "created_at": datetime.now(timezone.utc),
    }
    from pipeline.schema import arrow_schema

    for _ in range(100):
        version = int(policy_version) if policy_version is not None else next_policy_version(lake)
        row["policy_version"] = version
        table = pa.Table.from_pylist([row], schema=arrow_schema("checkpoints"))
        try:
            # exactly once per checkpoint id, even if the publisher is retried
            res = lake.append("checkpoints", table, command=command, config_hash=train_config_hash,
                              app_id=f"publish:{checkpoint_id}", txn_version=0,
                              lock=(POLICY_VERSION_APP, version + 1))
        except LockTaken:
            if policy_version is not None:
                taken = [r["checkpoint_id"] for r in _rows(lake) if r["policy_version"] == version]
                raise ConflictError(f"policy version {version} is already published (checkpoint "
                                    f"{taken[0] if taken else '?'})",
                                    hint="publish as the next version, or use the published one") from None
            continue
        if not res.landed:  # this checkpoint id was published before: report the version it has
            prior = [r for r in _rows(lake) if r["checkpoint_id"] == checkpoint_id]
            if prior:
                row["policy_version"] = int(prior[0]["policy_version"])
        return row
    raise ConflictError("could not take a policy version: other publishers kept winning", hint="rerun")
