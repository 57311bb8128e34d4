"""Small plain-object primitives on the lake root that Delta does not give us:
create-if-absent, read, list one level, delete. Paths are relative to the lake
root (``_locks/job-x/lease.00000000000000000001``).

``put_if_absent`` is the one atomic primitive the lease (pipeline/lake/lease.py) and
snapshot publication (pipeline/snapshots/) build on:

- local lake: the bytes go to a private temporary file that is then hard-linked
  to the target name; ``link`` fails if the name exists, so of N racers exactly
  one creates it, and the object appears complete or not at all (never empty);
- S3 (and S3-compatible stores honouring it): ``PutObject`` with
  ``If-None-Match: *``; the store answers 412 PreconditionFailed to every put
  after the first (S3 serializes conditional writes to one key), and a PUT is
  atomic: readers see the whole object or none. Listing and reads after a
  successful write are strongly consistent on S3.

The only module importing boto3 (deltalake does not expose its object store).
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Protocol

from pipeline.errors import ConfigError, PipelineError
from pipeline.lake.uri import split_uri


class ObjectRoot(Protocol):
    """What these primitives need of a lake: its root URI, whether it is a local
    path, and its object-store options. A :class:`~pipeline.lake.delta.Lake` is
    one; this module imports nothing of the table store."""

    uri: str
    is_local: bool
    storage_options: dict[str, str] | None


def _local_path(lake: ObjectRoot, rel: str) -> Path:
    return Path(lake.uri) / rel


def _require_supported(lake: ObjectRoot) -> None:
    if not lake.is_local and not lake.uri.startswith("s3://"):
        scheme = split_uri(lake.uri)[0]
        raise ConfigError(f"conditional writes (job leases, snapshot publication) are implemented for local and "
                          f"s3:// lakes, not {scheme}://", hint="use an S3-compatible endpoint for the lake")


def s3_bucket_key(lake: ObjectRoot, rel: str) -> tuple[str, str]:
    rest = split_uri(lake.uri)[1]
    bucket, _, prefix = rest.partition("/")
    return bucket, f"{prefix.strip('/')}/{rel}".lstrip("/")


_CLIENTS: dict[tuple, object] = {}
_CLIENTS_LOCK = threading.Lock()  # boto3's default session is not thread-safe (jobs schedule runs threads)


def s3_client(lake: ObjectRoot):
    """A boto3 S3 client built from the lake's storage options (cached per process)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # pragma: no cover - boto3 is a dependency
        raise PipelineError("boto3 is not installed (needed for leases and snapshots on S3)",
                            hint="boto3 is a core dependency: bash scripts/setup-env.sh installs it into .venv") from exc
    opts = lake.storage_options or {}
    key = (os.getpid(), tuple(sorted(opts.items())))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is not None:
            return client
        client = boto3.session.Session().client(
            "s3", endpoint_url=opts.get("AWS_ENDPOINT_URL"), aws_access_key_id=opts.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=opts.get("AWS_SECRET_ACCESS_KEY"), aws_session_token=opts.get("AWS_SESSION_TOKEN"),
            region_name=opts.get("AWS_REGION", "us-east-1"),
            config=Config(retries={"max_attempts": 8, "mode": "standard"}))
        _CLIENTS[key] = client
        return client


def _is_precondition_failed(exc: Exception) -> bool:
    resp = getattr(exc, "response", None) or {}
    code = str((resp.get("Error") or {}).get("Code", ""))
    status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    # 409 ConditionalRequestConflict: a concurrent conditional write to the same key is in flight
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def _is_missing(exc: Exception) -> bool:
    resp = getattr(exc, "response", None) or {}
    code = str((resp.get("Error") or {}).get("Code", ""))
    return code in ("NoSuchKey", "404", "NotFound")


def put_if_absent(lake: ObjectRoot, rel: str, data: bytes) -> bool:
    """Create ``rel`` with ``data`` unless it exists. True when this call created it.

    A retried request whose first attempt did land is refused by the store
    like a racer's: callers that must know compare the stored bytes with
    theirs (make ``data`` unique to the caller)."""
    _require_supported(lake)
    if lake.is_local:
        target = _local_path(lake, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-put-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, target)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
    bucket, key = s3_bucket_key(lake, rel)
    try:
        s3_client(lake).put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        return True
    except Exception as exc:
        if _is_precondition_failed(exc):
            return False
        raise


def get(lake: ObjectRoot, rel: str) -> bytes | None:
    """The object's bytes, or None when it does not exist."""
    _require_supported(lake)
    if lake.is_local:
        try:
            return _local_path(lake, rel).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
    bucket, key = s3_bucket_key(lake, rel)
    try:
        return s3_client(lake).get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        if _is_missing(exc):
            return None
        raise


def list_names(lake: ObjectRoot, rel_dir: str, *, prefix: str = "") -> list[str]:
    """Names of the objects directly under ``rel_dir`` (no sub-directories), only
    those starting with ``prefix`` when given (on S3 the store filters them)."""
    _require_supported(lake)
    if lake.is_local:
        d = _local_path(lake, rel_dir)
        try:
            return [p.name for p in d.iterdir() if p.name.startswith(prefix) and p.is_file()]
        except (FileNotFoundError, NotADirectoryError):
            return []
    bucket, base = s3_bucket_key(lake, rel_dir.rstrip("/") + "/")
    out: list[str] = []
    for page in s3_client(lake).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base + prefix,
                                                                          Delimiter="/"):
        out.extend(o["Key"][len(base):] for o in page.get("Contents", []))
    return out


def delete(lake: ObjectRoot, rel: str) -> None:
    """Remove ``rel``; a missing object is fine."""
    _require_supported(lake)
    if lake.is_local:
        try:
            _local_path(lake, rel).unlink(missing_ok=True)
        except (IsADirectoryError, NotADirectoryError):
            pass
        return
    bucket, key = s3_bucket_key(lake, rel)
    s3_client(lake).delete_object(Bucket=bucket, Key=key)
