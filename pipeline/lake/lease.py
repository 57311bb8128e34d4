"""Leases in the lake: at most one live owner of a name (a scheduled job, a
rollout run) at a time, on a local lake and on S3. docs/leases.md has the
argument; in short:

A lease is a sequence of generation objects ``_locks/<name>/lease.<n>`` (n
zero-padded), each created with ``objects.put_if_absent`` (a hard link on a
local lake, ``If-None-Match: *`` on S3): of any number of racers creating the
same generation, exactly one succeeds. The newest generation is the lease; its
body says who owns it and until when. Taking over an expired (or released)
generation n means creating n+1, so simultaneous takeovers race on one key
and one wins. The generation objects are never rewritten; superseded ones are
deleted, the newest never is (release writes a newer "released" generation),
so generation numbers are never reused, and a winner that finds a newer
generation than its own right after creating it (a racer that read an old
listing) backs off.

    from pipeline.lake.lease import acquire
    lease = acquire(lake, "rollout-R1", owner="rollout on host-3", ttl=300)
    if lease is None: ...              # held: holder(lake, "rollout-R1") says by whom
    lease.renew()                      # heartbeat: extend by ttl (LeaseLostError if taken over)
    lease.release()

Expiry compares the holder's ``expires`` (its clock) with the reader's clock:
hosts need clocks synchronized well within the ttl, as for any lease.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConfigError, ConflictError, PipelineError
from pipeline.lake import objects
from pipeline.lake.liveness import holder_is_dead, identity
from pipeline.lake.ref import as_lake

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

LOCK_DIR = "_locks"
_GEN = re.compile(r"^lease\.(\d{20})$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]{0,199}$")
MAX_ROUNDS = 8


class LeaseHeldError(ConflictError):
    """Another owner holds a live lease."""

    def __init__(self, name: str, record: dict[str, Any] | None) -> None:
        self.record = record or {}
        super().__init__(f"{describe_holder(name, record)}",
                         hint="wait for it to finish or for its lease to expire; a crashed owner's lease "
                              "expires after its ttl")


class LeaseLostError(PipelineError):
    """Our lease expired and another owner took it over (or it was released)."""


def describe_holder(name: str, record: dict[str, Any] | None) -> str:
    if not record:
        return f"lease {name!r} is held"
    until = datetime.fromtimestamp(float(record.get("expires", 0)), timezone.utc).isoformat(timespec="seconds")
    return f"lease {name!r} is held by {record.get('owner', '?')} until {until}"


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ConfigError(f"lease name {name!r} is not allowed",
                          hint="letters, digits and . _ = - (at most 200), starting with a letter or digit")


def _rel(name: str, gen: int | None = None) -> str:
    d = f"{LOCK_DIR}/{name}"
    return d if gen is None else f"{d}/lease.{gen:020d}"


def _generations(lake: Lake, name: str) -> list[int]:
    return sorted(int(m.group(1)) for n in objects.list_names(lake, _rel(name)) if (m := _GEN.match(n)))


def _read(lake: Lake, name: str, gen: int) -> dict[str, Any] | None:
    raw = objects.get(lake, _rel(name, gen))
    if raw is None:
        return None
    try:
        rec = json.loads(raw)
        return rec if isinstance(rec, dict) else {}
    except ValueError:
        return {}  # unreadable: judged expired (creation is atomic, so this is damage, not a race)


def _live(rec: dict[str, Any], now: float | None = None) -> bool:
    """Not released, not expired, and not provably dead (a holder on this host,
    boot and pid namespace whose process is gone: pipeline/lake/liveness.py)."""
    return not rec.get("released") and float(rec.get("expires", 0)) > (time.time() if now is None else now) \
        and not holder_is_dead(rec)


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(kw_only=True)
class Lease:
    """A held lease (generation ``generation`` of ``name``)."""

    lake: Any
    name: str
    owner: str
    ttl: float
    generation: int
    expires: float
    token: str
    info: dict[str, Any] = field(default_factory=dict)   # extra fields for readers (e.g. a run's workers)

    def _body(self, gen: int, *, released: bool = False) -> bytes:
        return json.dumps({**self.info, "lease": self.name, "generation": gen, "owner": self.owner,
                           "token": self.token, "host": socket.gethostname(), "pid": os.getpid(), **identity(),
                           "expires": self.expires, "released": released, "written_at": time.time()}).encode()

    def held(self) -> bool:
        """True while our generation is the newest and not expired (reads the store)."""
        gens = _generations(self.lake, self.name)
        return bool(gens) and gens[-1] == self.generation and self.expires > time.time()

    def renew(self, ttl: float | None = None) -> "Lease":
        """Heartbeat: extend the lease by ``ttl`` (default: its own) from now, as a
        new generation. Raises LeaseLostError when another owner took it over."""
        gens = _generations(self.lake, self.name)
        if not gens or gens[-1] != self.generation:
            raise LeaseLostError(f"lease {self.name!r} was taken over (generation {gens[-1] if gens else None} "
                                 f"is newer than ours, {self.generation})", hint="stop: another owner runs now")
        nxt, old_expires = self.generation + 1, self.expires
        self.expires = time.time() + (self.ttl if ttl is None else ttl)
        created = objects.put_if_absent(self.lake, _rel(self.name, nxt), self._body(nxt))
        if not created:  # ours after all if a retried PUT's first attempt landed
            rec = _read(self.lake, self.name, nxt) or {}
            created = rec.get("token") == self.token and not rec.get("released")
        if not created or _generations(self.lake, self.name)[-1:] != [nxt]:
            self.expires = old_expires
            raise LeaseLostError(f"lease {self.name!r} was taken over while renewing", hint="stop: another owner "
                                 "runs now")
        prev, self.generation = self.generation, nxt
        _forget_below(self.lake, self.name, nxt, also=[prev])
        return self

    heartbeat = renew

    def release(self) -> bool:
        """Give the lease up (a newer "released" generation). False when it was
        no longer ours (expired and taken over)."""
        gens = _generations(self.lake, self.name)
        if not gens or gens[-1] != self.generation:
            return False
        nxt = self.generation + 1
        if not objects.put_if_absent(self.lake, _rel(self.name, nxt), self._body(nxt, released=True)):
            rec = _read(self.lake, self.name, nxt) or {}
            if not (rec.get("token") == self.token and rec.get("released")):
                return False  # taken over after it expired
        _forget_below(self.lake, self.name, nxt)
        return True

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _forget_below(lake: Lake, name: str, gen: int, also: list[int] | None = None) -> None:
    """Delete superseded generations (< gen): never read again once gen exists."""
    for g in set(_generations(lake, name) + list(also or [])):
        if g < gen:
            try:
                objects.delete(lake, _rel(name, g))
            except Exception:
                pass  # best effort: a leftover superseded generation is harmless


def holder(lake: Lake | str | os.PathLike[str], name: str) -> dict[str, Any] | None:
    """The live owner's record (owner, expires, generation, host, pid), or None."""
    lake = as_lake(lake)
    _check_name(name)
    for _ in range(MAX_ROUNDS):
        gens = _generations(lake, name)
        if not gens:
            return _legacy(lake, name, ttl=0, remove=False)
        rec = _read(lake, name, gens[-1])
        if rec is None:
            continue  # superseded and deleted between list and read: look again
        return rec if _live(rec) else None
    return None


def _legacy(lake: Lake, name: str, *, ttl: float, remove: bool) -> dict[str, Any] | None:
    """A lease file of the previous format (one object at ``_locks/<name>``):
    its live record, else None (an expired one is moved out of the way)."""
    if lake.is_local:
        from pathlib import Path

        p = Path(lake.uri) / _rel(name)
        if not p.is_file():
            return None
        try:
            rec = json.loads(p.read_bytes())
        except (OSError, ValueError):
            try:
                rec = {"expires": p.stat().st_mtime + ttl}  # created but never written: judge by age
            except FileNotFoundError:
                return None
        rec.setdefault("owner", f"{rec.get('host', '?')}:{rec.get('pid', '?')}")
        if _live(rec):
            return rec
        if remove:  # rename is atomic: one remover; a racer sees it gone
            tomb = p.with_name(f"{p.name}.legacy-{uuid.uuid4().hex}")
            try:
                os.rename(p, tomb)
                tomb.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
        return None
    raw = objects.get(lake, _rel(name))
    if raw is None:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    rec.setdefault("owner", f"{rec.get('host', '?')}:{rec.get('pid', '?')}")
    return rec if _live(rec) else None


def try_acquire(lake: Lake | str | os.PathLike[str], name: str, *, owner: str | None = None, ttl: float,
                info: dict[str, Any] | None = None) -> tuple[Lease | None, dict[str, Any] | None]:
    """(lease, None) when acquired, else (None, the live holder's record).
    ``info``: extra fields written into the lease body."""
    lake = as_lake(lake)
    _check_name(name)
    owner = owner or default_owner()
    token = uuid.uuid4().hex
    seen: dict[str, Any] | None = None
    for _ in range(MAX_ROUNDS):
        gens = _generations(lake, name)
        if gens:
            rec = _read(lake, name, gens[-1])
            if rec is None:
                continue  # superseded while we looked: list again
            if _live(rec):
                return None, rec
            seen, nxt = rec, gens[-1] + 1
        else:
            legacy = _legacy(lake, name, ttl=ttl, remove=True)
            if legacy is not None:
                return None, legacy
            nxt = 1
        lease = Lease(lake=lake, name=name, owner=owner, ttl=ttl, generation=nxt, expires=time.time() + ttl,
                      token=token, info=dict(info or {}))
        if not objects.put_if_absent(lake, _rel(name, nxt), lease._body(nxt)):
            mine = _read(lake, name, nxt)
            if not mine or mine.get("token") != token:
                continue  # another racer created generation nxt: it holds the lease (or look again)
            # ours after all: a retried PUT whose first attempt had landed
        if _generations(lake, name)[-1:] != [nxt]:
            # we read an old listing: a newer generation already existed, so ours is no lease
            objects.delete(lake, _rel(name, nxt))
            continue
        _forget_below(lake, name, nxt)
        return lease, None
    return None, seen


def acquire(lake: Lake | str | os.PathLike[str], name: str, *, owner: str | None = None, ttl: float) -> Lease | None:
    """The lease, or None when a live owner holds it (``holder`` says who)."""
    lake = as_lake(lake)
    return try_acquire(lake, name, owner=owner, ttl=ttl)[0]


def require(lake: Lake | str | os.PathLike[str], name: str, *, owner: str | None = None, ttl: float) -> Lease:
    """The lease, or LeaseHeldError naming the live owner."""
    lake = as_lake(lake)
    lease, rec = try_acquire(lake, name, owner=owner, ttl=ttl)
    if lease is None:
        raise LeaseHeldError(name, rec)
    return lease
