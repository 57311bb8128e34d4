"""Group commit: concurrent appends to one keyed table land in one Delta commit
(docs/write-protocol.md, "Group commit").

A keyed append (``Lake.append`` of rows in memory, no ``lock``, no staged
files: rollout spool shipping, events, quarantine, library callers) dedupes
its rows, writes its data files and then publishes a **commit intent**,
``_staging/commit.<table>.<id>.json`` (put-if-absent): its add actions, its
application transactions, its commit metadata, the ``row_key`` of every row
and the table version it deduped against. Then every waiting writer is a
potential leader: it loads the table, returns if its own transaction is in
the log, and otherwise commits *every* pending intent it can (its own
included) in one commit carrying each intent's application transactions and
``pipeline.keys`` at the next version. Of several writers that try at once
delta-rs lets exactly one commit (they all carry ``pipeline.keys``); the
others reload and find their rows landed. No lease, no timeout: a leader
killed mid-commit either committed (its followers find their transactions) or
did not (the next writer to look commits its intent with the rest).

An intent is included only if none of its keys landed after the version its
writer deduped against and none repeats a key of an intent included before it
(intents are taken in name order, so every writer chooses alike). A writer
whose own intent can no longer land that way dedupes again and publishes a
new intent; once its keys are in the log no commit can include the old one
(the argument is in the doc).

The intent is also a staging-registry record (``paths``, not bound to its
writer's process): maintenance keeps its files while it lives, so a writer
killed after publishing its intent leaves files another writer may still
commit, and they are never deleted under that commit. It expires like any
record (``INTENT_MAX_AGE_S``); a writer never adopts an intent older than
``STAGE_MAX_AGE_S``.

A damaged intent (a record that does not parse, a file gone) can never be
committed; the first writer that finds it sets it aside
(pipeline/lake/delta/damaged.py) so it never holds the others back.

``PIPELINE_GROUP_COMMIT=0`` turns it off (each append commits alone, as
before): the baseline of the group-commit benchmark.
"""

from __future__ import annotations

import base64
import json
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError

from pipeline.errors import CommitError
from pipeline.lake import objects, staging
from pipeline.lake.delta import damaged, keyindex, writes
from pipeline.lake.delta.common import KEYS_APP, MAX_COMMIT_RETRIES, MAX_KEYED_ATTEMPTS, STAGE_MAX_AGE_S, \
    FilesMissing, pause_point, write_metadata
from pipeline.lake.liveness import identity
from pipeline.schema import ROW_KEY, TableSpec, table_spec

if TYPE_CHECKING:
    from pipeline.lake.delta.root import LakeRoot

GROUP_COMMIT_ENV = "PIPELINE_GROUP_COMMIT"
INTENT_PREFIX = "commit."
# One commit holds at most this many intents / rows (a bounded log entry); the rest go in the next.
MAX_GROUP_INTENTS = 256
MAX_GROUP_ROWS = 500_000
# The writer of the oldest pending intent commits for everyone; the others wait for the log to
# move. If it has not committed this long after we first saw it lead (it died, or it is slow), the
# waiting writers commit themselves. Only progress depends on it, never what lands.
TAKEOVER_S = 2.0

# Why :func:`choose` leaves an intent out of a commit: its transaction ``landed`` already, it is ``stale``,
# a key of it landed after its check (``keys``), a key or transaction of an intent taken before it
# (``repeat``), or the commit is ``full``.
LeftOut = Literal["landed", "stale", "keys", "repeat", "full"]
# How waiting for our intent ends (:func:`_drive`): ``landed`` with our files; a ``twin`` (our transaction
# with other files) landed; our transaction landed, with which files the log no longer says (``unknown``);
# ``keys`` of ours landed since our check; our files are ``gone``; or it ``failed`` (out of attempts).
Outcome = Literal["landed", "twin", "unknown", "keys", "gone", "failed"]
_BY_OURS: dict[bool | None, Outcome] = {True: "landed", False: "twin", None: "unknown"}


def enabled(lake: LakeRoot) -> bool:
    """On unless ``PIPELINE_GROUP_COMMIT=0``, on stores with put-if-absent (local, S3)."""
    if not lake.is_local and not lake.uri.startswith("s3://"):
        return False
    return os.environ.get(GROUP_COMMIT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True, kw_only=True)
class Intent:
    """One writer's pending append, as published in its intent record."""

    rid: str                    # record id: commit.<table>.<ms>-<uuid>
    app_id: str
    txn_version: int
    extra: tuple[str, ...]      # further application ids (version 0)
    meta: dict[str, str]
    checked: int                # the table version its rows were deduped against
    actions: tuple[dict[str, Any], ...]
    keys: np.ndarray
    rows: int
    created: float

    @property
    def apps(self) -> list[str]:
        return [self.app_id, *[t for t in self.extra if t != self.app_id]]


def _action_dict(a) -> dict[str, Any]:
    return {"path": a.path, "size": a.size, "partition_values": a.partition_values,
            "modification_time": a.modification_time, "data_change": a.data_change, "stats": a.stats}


def _add_action(d: dict[str, Any]):
    from deltalake.transaction import AddAction

    return AddAction(d["path"], int(d["size"]), d["partition_values"], int(d["modification_time"]),
                     bool(d["data_change"]), d["stats"])


def _publish(lake: LakeRoot, name: str, *, app_id: str, txn_version: int, extra: list[str], meta: dict[str, str],
             checked: int, actions: list, keys: np.ndarray, rows: int) -> Intent:
    rid = f"{INTENT_PREFIX}{name}.{int(time.time() * 1000):013d}-{uuid.uuid4().hex}"
    intent = Intent(rid=rid, app_id=app_id, txn_version=txn_version, extra=tuple(extra), meta=dict(meta),
                    checked=checked, actions=tuple(_action_dict(a) for a in actions), keys=keys.astype("<i8"),
                    rows=rows, created=time.time())
    body = {"paths": sorted(f"{name}/{a.path}" for a in actions), "created": intent.created,
            "host": socket.gethostname(), "pid": os.getpid(),
            "pid_bound": False,     # a dead writer's intent may still be committed by another writer
            **identity(),
            "commit": {"table": name, "app_id": app_id, "txn_version": txn_version, "extra": list(extra),
                       "meta": meta, "checked": checked, "rows": rows, "actions": list(intent.actions),
                       "keys": base64.b64encode(intent.keys.tobytes()).decode()}}
    objects.put_if_absent(lake, f"{staging.STAGING_DIR}/{rid}.json", json.dumps(body, sort_keys=True).encode())
    _CACHE[(lake.uri, rid)] = intent
    return intent


_CACHE: dict[tuple[str, str], Intent] = {}   # intents are immutable: parse each once per process


def _parse(rid: str, raw: bytes, name: str | None = None) -> Intent | str:
    """The intent in record ``rid``, or why it is damaged (a field missing or of the wrong type)."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise TypeError(what)

    try:
        body = json.loads(raw)
        c = body["commit"]
        need(isinstance(c, dict) and isinstance(body.get("created"), (int, float)), "no commit section or time")
        need(name is None or c.get("table") == name, f"its table is {c.get('table')!r}")
        need(isinstance(c["app_id"], str) and bool(c["app_id"]) and type(c["txn_version"]) is int
             and type(c["checked"]) is int and type(c["rows"]) is int and c["rows"] >= 0
             and isinstance(c["extra"], list) and isinstance(c["meta"], dict), "a transaction field is not valid")
        for a in c["actions"]:
            need(isinstance(a, dict) and isinstance(a.get("path"), str) and bool(a["path"])
                 and type(a.get("size")) is int and a["size"] >= 0 and isinstance(a.get("partition_values"), dict)
                 and type(a.get("modification_time")) is int and isinstance(a.get("data_change"), bool)
                 and (a.get("stats") is None or isinstance(a.get("stats"), str)),
                 "an add action lacks path, size, partition values, time, data change or stats")
        keys = base64.b64decode(c["keys"], validate=True)
        need(len(keys) == 8 * c["rows"], f"{len(keys)} bytes of keys for {c['rows']} rows")
        return Intent(rid=rid, app_id=c["app_id"], txn_version=c["txn_version"],
                      extra=tuple(str(t) for t in c["extra"]), meta={str(k): str(v) for k, v in c["meta"].items()},
                      checked=c["checked"], actions=tuple(c["actions"]),
                      keys=np.frombuffer(keys, "<i8").astype(np.int64), rows=c["rows"],
                      created=float(body["created"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable intent record ({type(exc).__name__}: {exc})"


def records(lake: LakeRoot, name: str) -> list[tuple[str, bytes | None, Intent | str]]:
    """(record id, its bytes (None when cached), the intent or why it is damaged) of every published
    intent of table ``name``, in name (= publication time) order."""
    prefix = f"{INTENT_PREFIX}{name}."
    out: list[tuple[str, bytes | None, Intent | str]] = []
    names = sorted(n for n in objects.list_names(lake, staging.STAGING_DIR, prefix=prefix) if n.endswith(".json"))
    if len(_CACHE) > 10_000:
        _CACHE.clear()
    for n in names:
        rid = n[:-len(".json")]
        cached = _CACHE.get((lake.uri, rid))
        if cached is not None:
            out.append((rid, None, cached))
            continue
        raw = objects.get(lake, f"{staging.STAGING_DIR}/{n}")
        if raw is None:
            continue     # committed and removed meanwhile
        intent = _parse(rid, raw, name)
        if isinstance(intent, Intent):
            _CACHE[(lake.uri, rid)] = intent
        out.append((rid, raw, intent))
    return out


def pending(lake: LakeRoot, name: str) -> list[Intent]:
    """The published intents of table ``name``, in name (= publication time) order. A record that does
    not parse can never be committed: it is set aside (pipeline/lake/delta/damaged.py), never chosen."""
    out = []
    for rid, raw, intent in records(lake, name):
        if isinstance(intent, Intent):
            out.append(intent)
        else:
            damaged.set_aside(lake, rid, raw, kind=damaged.RECORD, reason=intent)
    return out


def missing_files(lake: LakeRoot, name: str, intent: Intent) -> str:
    """Why the intent's files are not all there as written ("" when they are)."""
    try:
        lake.check_files({f"{name}/{a['path']}": int(a["size"]) for a in intent.actions}, what="intent")
    except FilesMissing as exc:
        return "; ".join(f"{p}: {'absent' if got is None else f'{got} bytes'}, the intent says {want}"
                         for p, want, got in exc.missing[:3]) + (" ..." if len(exc.missing) > 3 else "")
    return ""


def _remove(lake: LakeRoot, rid: str) -> None:
    staging.release(lake, rid)
    _CACHE.pop((lake.uri, rid), None)


_TABLES = threading.local()


def _commit_size(lake: LakeRoot, name: str, version: int) -> int | None:
    fs, _ = lake.filesystem()
    base = lake.table_path(name)
    import pyarrow.fs as pafs

    info = fs.get_file_info(f"{base}/_delta_log/{version:020d}.json")
    return info.size if info.type == pafs.FileType.File else None


def latest(lake: LakeRoot, name: str) -> DeltaTable:
    """Table ``name`` at its latest version: this thread's open table brought forward
    (``update_incremental`` reads only the new commits), or freshly loaded. The open table is
    reused only while the commit it was last at is still in the log with the same size (a table
    deleted and created again under this process is loaded afresh)."""
    tables = _TABLES.__dict__.setdefault("tables", {})
    held = tables.get((lake.uri, name))
    if held is not None:
        dt, size = held
        try:
            if _commit_size(lake, name, dt.version()) == size:
                if _commit_size(lake, name, dt.version() + 1) is None:
                    return dt       # no commit since: listing the log (update_incremental) costs more
                dt.update_incremental()
                tables[(lake.uri, name)] = (dt, _commit_size(lake, name, dt.version()))
                return dt
        except Exception:  # noqa: BLE001 - a log cleaned up under it, a transient read error: load again
            pass
    dt = lake.table(name)
    tables[(lake.uri, name)] = (dt, _commit_size(lake, name, dt.version()))
    return dt


@dataclass(kw_only=True)
class View:
    """Table ``name`` as of ``version``, read from its log alone (no snapshot loaded): what a waiting
    writer needs to see whether its transaction landed and which intents one commit could take.
    ``tid`` is the Delta table id (a table created again at the same path is another table)."""

    lake: LakeRoot
    name: str
    tid: str
    version: int
    _dt: DeltaTable | None = None

    @classmethod
    def of(cls, lake: LakeRoot, name: str, dt: DeltaTable) -> View:
        return cls(lake=lake, name=name, tid=str(dt.metadata().id), version=dt.version(), _dt=dt)

    def table(self) -> DeltaTable:
        """The snapshot at ``version`` (loaded only when the log alone does not tell)."""
        if self._dt is None or self._dt.version() != self.version:
            self._dt = self.lake.table(self.name, version=self.version)
        return self._dt

    def advanced(self) -> View:
        """This view moved to the newest commit in the log (one metadata request per new commit, and
        one for the version after it)."""
        v = self.version
        while _commit_size(self.lake, self.name, v + 1) is not None:
            v += 1
        return self if v == self.version else View(lake=self.lake, name=self.name, tid=self.tid, version=v)


# commits are immutable: (lake, table, Delta table id, version) -> (application transactions, paths added)
_LOG: dict[tuple[str, str, str, int], tuple[dict[str, int], frozenset[str]]] = {}


def _commit_facts(lake: LakeRoot, name: str, tid: str, version: int
                  ) -> tuple[dict[str, int], frozenset[str]] | None:
    """(application transactions, paths added) of commit ``version`` of table ``name`` with Delta
    table id ``tid``; None if its log file is gone."""
    from urllib.parse import unquote

    key = (lake.uri, name, tid, version)
    if key not in _LOG:
        entries = lake.log_entries(name, version)
        if entries is None:
            return None
        if len(_LOG) > 100_000:
            _LOG.clear()
        txns: dict[str, int] = {}
        for e in entries:
            if (t := e.get("txn")) and "appId" in t:
                txns[t["appId"]] = max(int(t.get("version", -1)), txns.get(t["appId"], -1))
        _LOG[key] = (txns, frozenset(unquote(e["add"]["path"]) for e in entries if "add" in e))
    return _LOG[key]


class _Landed:
    """Which intents' transactions are committed in ``dt``. An intent's transaction was not committed
    at its ``checked`` version (its writer looked), so only the commits after it can hold it: their log
    entries are read once per process, instead of asking delta-rs once per intent."""

    def __init__(self, view: View) -> None:
        self.view = view

    def where(self, intent: Intent) -> tuple[int | None, bool | None]:
        """(version of the commit holding the intent's transaction or None, whether that commit added
        the intent's files: False when a twin with the same transaction landed instead, None when
        the log no longer says)."""
        want = {a["path"] for a in intent.actions}
        view = self.view
        for v in range(view.version, intent.checked, -1):
            facts = _commit_facts(view.lake, view.name, view.tid, v)
            if facts is None:     # a log file cleaned up (never a recent one): ask the snapshot
                landed = view.table().transaction_version(intent.app_id)
                return (v if landed is not None and landed >= intent.txn_version else None), None
            if facts[0].get(intent.app_id, -1) >= intent.txn_version:
                return v, want <= facts[1]
        return None, False

    def __call__(self, intent: Intent) -> bool:
        return self.where(intent)[0] is not None


_COMMIT_KEYS: dict[tuple[str, str, str, int], np.ndarray] = {}   # commits are immutable: row_key they added


class _KeysAdded:
    """The ``row_key`` of the rows committed to ``dt`` after a version: from the files each commit
    after it added (read once per commit and process; Delta log entries cached likewise), so the cost
    follows the commits since, not the table's files."""

    def __init__(self, view: View) -> None:
        self.view = view
        self.memo: dict[int, keyindex.KeySet] = {}

    def since(self, version: int) -> keyindex.KeySet:
        if version not in self.memo:
            self.memo[version] = keyindex.KeySet(keyindex.EMPTY_KEYS, self._read(version))
        return self.memo[version]

    def _read(self, version: int) -> np.ndarray:
        view = self.view
        parts = []
        for v in range(version + 1, view.version + 1):
            key = (view.lake.uri, view.name, view.tid, v)
            if key not in _COMMIT_KEYS:
                facts = _commit_facts(view.lake, view.name, view.tid, v)
                try:
                    if facts is None:
                        raise FileNotFoundError(v)
                    _COMMIT_KEYS[key] = keyindex.read_keys(view.lake, view.name, [(p, {}) for p in sorted(facts[1])])
                except (OSError, ValueError):
                    # a log file cleaned up, or a file compacted away and vacuumed since: the live files
                    # added since, as keyindex reads them
                    return keyindex.keys(view.lake, view.name, view.table(), since=version).loose
                if len(_COMMIT_KEYS) > 100_000:
                    _COMMIT_KEYS.clear()
            parts.append(_COMMIT_KEYS[key])
        return np.concatenate(parts) if parts else keyindex.EMPTY_KEYS


def choose(view: View, intents: list[Intent], *, now: float | None = None
           ) -> tuple[list[Intent], dict[str, LeftOut]]:
    """The intents one commit on ``view`` takes, and why each other one is left out
    (``landed``, ``stale``, ``keys``: a key landed after its check, ``repeat``: a key or
    transaction of an intent taken before it, ``full``: the commit is full)."""
    now = time.time() if now is None else now
    out: list[Intent] = []
    why: dict[str, LeftOut] = {}
    live = []
    landed = _Landed(view)
    for i in intents:
        if landed(i):
            why[i.rid] = "landed"
        elif now - i.created > STAGE_MAX_AGE_S:
            why[i.rid] = "stale"
        else:
            live.append(i)
    if not live:
        return out, why
    added = _KeysAdded(view)
    taken_keys: list[np.ndarray] = []
    apps: set[str] = set()
    rows = 0
    for i in live:
        if len(out) >= MAX_GROUP_INTENTS or (out and rows + i.rows > MAX_GROUP_ROWS):
            why[i.rid] = "full"
            continue
        if added.since(i.checked).contains(i.keys).any():
            why[i.rid] = "keys"
            continue
        if apps & set(i.apps) or (taken_keys and keyindex.key_member(np.concatenate(taken_keys), i.keys).any()):
            why[i.rid] = "repeat"
            continue
        out.append(i)
        apps |= set(i.apps)
        taken_keys.append(i.keys)
        rows += i.rows
    return out, why


def _check_files(lake: LakeRoot, name: str, intents: list[Intent], ours: Intent) -> tuple[list[Intent], list[Intent]]:
    """(intents whose files are all there as written, those with a file gone). Another writer's
    intent with a file gone can never be committed: it is set aside after this one check."""
    ok, gone = [], []
    for i in intents:
        why = missing_files(lake, name, i)
        if not why:
            ok.append(i)
            continue
        gone.append(i)
        if i.rid != ours.rid:
            raw = objects.get(lake, f"{staging.STAGING_DIR}/{i.rid}.json")
            if raw is not None:
                damaged.set_aside(lake, i.rid, raw, kind=damaged.FILES, reason=f"files not as written: {why}")
            _CACHE.pop((lake.uri, i.rid), None)
    return ok, gone


def _commit(lake: LakeRoot, spec: TableSpec, dt: DeltaTable, intents: list[Intent], meta: dict[str, str]) -> None:
    now_ms = int(time.time() * 1000)
    txns = [Transaction(a, i.txn_version if a == i.app_id else 0, now_ms) for i in intents for a in i.apps]
    txns.append(Transaction(KEYS_APP, (dt.transaction_version(KEYS_APP) or 0) + 1, now_ms))
    meta = dict(meta, **{"pipeline.group_commit": str(len(intents)),
                         "pipeline.group_rows": str(sum(i.rows for i in intents))})
    pause_point(f"group:{spec.name}:committing")
    dt.create_write_transaction(
        [_add_action(a) for i in intents for a in i.actions],
        mode="append",
        schema=spec.arrow_schema(),
        partition_by=list(spec.partition_by) or None,
        commit_properties=CommitProperties(custom_metadata=meta, max_commit_retries=MAX_COMMIT_RETRIES,
                                           app_transactions=txns),
    )
    pause_point(f"group:{spec.name}:committed")


def append(lake: LakeRoot, name: str, data: pa.Table, *, command: str, config_hash: str | None, app_id: str | None,
           txn_version: int, extra: list[str]) -> writes.AppendResult:
    """``writes.append`` for a keyed table through a group commit (same result, same guarantees)."""
    if (lake.uri, name) not in _TABLES.__dict__.get("tables", {}):
        lake.ensure(name)       # once per thread and table (the open table below proves it exists)
    spec = table_spec(name)
    data = writes.prepare(lake, spec, data)
    app_id = app_id or f"write-{uuid.uuid4().hex}"
    meta = write_metadata(command, config_hash)
    meta.update({"pipeline.app_id": app_id, "pipeline.txn_version": str(txn_version)})
    dt = latest(lake, name)
    landed = dt.transaction_version(app_id)
    if landed is not None and landed >= txn_version:
        return writes.AppendResult(table=name, landed=False, rows=0, version=None, app_id=app_id,
                                   txn_version=txn_version)
    duplicates, conflicts = 0, None

    def result(*, landed: bool, rows: int, version: int | None) -> writes.AppendResult:
        return writes.AppendResult(table=name, landed=landed, rows=rows, version=version, app_id=app_id,
                                   txn_version=txn_version, duplicates=duplicates, conflicts=conflicts)

    checked: int | None = None
    last: Exception | None = None
    for _ in range(MAX_KEYED_ATTEMPTS):
        data, dups, confl = writes.drop_landed(lake, spec, dt, data, since=checked)
        duplicates += dups
        if confl is not None:
            conflicts = confl if conflicts is None else pa.concat_tables([conflicts, confl])
        if data.num_rows == 0:
            return result(landed=False, rows=0, version=None)
        if checked is not None:     # a later pass: has a twin with our transaction landed meanwhile?
            landed = dt.transaction_version(app_id)
            if landed is not None and landed >= txn_version:
                return result(landed=False, rows=0, version=None)
        checked = dt.version()      # our transaction is not in the table up to here (every pass looked)
        actions = writes.write_data_files(lake, spec, data)
        intent = _publish(lake, name, app_id=app_id, txn_version=txn_version, extra=extra, meta=meta,
                          checked=checked, actions=actions, keys=data.column(ROW_KEY).to_numpy(), rows=data.num_rows)
        pause_point(f"append:{name}:staged")      # files written and intent published, nothing committed
        outcome, version, last = _drive(lake, spec, intent, meta, View.of(lake, name, dt))
        if outcome == "landed":
            pause_point(f"append:{name}:committed")
            _remove(lake, intent.rid)
            writes.release(lake, name, actions)
            return result(landed=True, rows=data.num_rows, version=version)
        if outcome == "failed":
            break    # left published: another writer may still commit it, or it expires (maintenance)
        if outcome in ("keys", "gone") and _landed_as_of(lake, name, intent):
            outcome = "unknown"     # never delete files a commit may hold: the log says our transaction landed
        if outcome == "unknown":   # our transaction landed; whether with our files the log no longer says:
            _remove(lake, intent.rid)           # keep them (orphan cleanup removes them if unreferenced)
            writes.release(lake, name, actions)
            return result(landed=False, rows=0, version=version)
        # our intent can never land (see _drive): drop it and its files
        _remove(lake, intent.rid)
        writes.discard(lake, name, actions)
        if outcome == "twin":
            return result(landed=False, rows=0, version=None)
        dt = latest(lake, name)     # "keys": dedupe what landed since `checked`; "gone": write the files again
    cause = f"{type(last).__name__}: {last}" if last is not None else "out of attempts"
    raise CommitError(f"could not append {data.num_rows} rows to {name}: {cause}",
                      hint=f"retry with the same transaction id ({app_id}, {txn_version}); it lands at most once")


def _landed_as_of(lake: LakeRoot, name: str, intent: Intent) -> bool:
    """Is the intent's transaction in the table now (asked of a freshly loaded table)?"""
    v = lake.table(name).transaction_version(intent.app_id)
    return v is not None and v >= intent.txn_version


def _wait_for_commit(lake: LakeRoot, name: str, version: int, *, until: float) -> None:
    """Poll (one metadata request each time) until commit ``version + 1`` exists or ``until`` (monotonic).
    On an object store each poll is a billed request: poll less often there."""
    pause, most = (0.002, 0.02) if lake.is_local else (0.01, 0.1)
    while time.monotonic() < until and _commit_size(lake, name, version + 1) is None:
        time.sleep(pause)
        pause = min(pause * 1.5, most)


def _drive(lake: LakeRoot, spec: TableSpec, intent: Intent, meta: dict[str, str], view: View
           ) -> tuple[Outcome, int | None, Exception | None]:
    """Wait for ``intent`` to land, committing pending intents (ours among them) when nobody
    else does. -> ("landed", version), ("twin": the same transaction landed with other files),
    ("keys": some of our keys landed since our check), ("gone": our files vanished) or
    ("failed": out of attempts; the intent is left for another writer or maintenance).
    A writer that waits reads only the log (new commit files); it loads the table to commit."""
    name = spec.name
    last: Exception | None = None
    first_seen: dict[str, float] = {}     # leader intent -> when we first saw it lead (our monotonic clock)
    for attempt in range(MAX_KEYED_ATTEMPTS):
        view = view.advanced()
        version, ours = _Landed(view).where(intent)
        if version is not None:
            return _BY_OURS[ours], version, None
        intents = pending(lake, name)
        if intent.rid not in {i.rid for i in intents}:
            intents = sorted([*intents, intent], key=lambda i: i.rid)
        take, why = choose(view, intents)
        for i in intents:      # intents whose transaction is in the log are done: tidy their records
            if why.get(i.rid) == "landed" and i.rid != intent.rid:
                _remove(lake, i.rid)
        mine = why.get(intent.rid)
        if mine is not None:
            last = RuntimeError(f"its intent was left out ({mine}) behind {take[0].rid if take else 'none'}")
        elif take and take[0].rid != intent.rid:
            last = RuntimeError(f"the intent {take[0].rid} led and was not committed")
        if mine == "keys":
            return "keys", None, None
        if mine == "stale":
            return "failed", None, TimeoutError(f"its intent is older than {STAGE_MAX_AGE_S} s")
        # "repeat" / "full": another intent goes first; we still commit what can go now
        leader = take[0] if take else None
        if leader is not None and leader.rid != intent.rid:
            seen = first_seen.setdefault(leader.rid, time.monotonic())
            if time.monotonic() - seen < TAKEOVER_S:
                # the oldest intent's writer commits it, ours most likely with it: wait for the log to
                # move instead of racing that commit (a dead writer's intent is taken over after TAKEOVER_S)
                _wait_for_commit(lake, name, view.version, until=seen + TAKEOVER_S)
                continue
        if not take:
            time.sleep(random.uniform(0, min(0.002 * 2 ** min(attempt, 8), 0.25)))
            continue
        dt = latest(lake, name)
        if dt.version() != view.version or str(dt.metadata().id) != view.tid:
            view = View.of(lake, name, dt)      # the log moved (or the table is another): choose again
            continue
        take, gone = _check_files(lake, name, take, intent)
        if intent in gone:
            return "gone", None, None
        if not take:
            continue
        try:
            _commit(lake, spec, dt, take, meta)
        except CommitFailedError as exc:
            last = exc      # another writer committed first: most likely with our intent in it
        except Exception as exc:  # noqa: BLE001 - ambiguous: the next pass reads the log
            last = exc
        else:
            for i in take:  # committed: their records protect nothing any more
                if i.rid != intent.rid:
                    _remove(lake, i.rid)
            continue        # the next pass finds our transaction in the log (or commits ours, if left out)
        # lost a race: spread the retries of many writers
        time.sleep(random.uniform(0, min(0.002 * 2 ** min(attempt, 8), 0.25)))
    return "failed", None, last or RuntimeError(f"{MAX_KEYED_ATTEMPTS} passes without a commit holding it")


def sweep(lake: LakeRoot, name: str, *, dry_run: bool = False) -> list[str]:
    """Remove the intent records of ``name`` whose transaction is committed (left by writers killed
    after their commit landed). Records of intents not committed stay: another writer may still
    commit them, and they expire like any staging record (maintenance removes them then)."""
    if not lake.exists(name):
        return []
    dt = lake.table(name)
    out = []
    for i in pending(lake, name):
        v = dt.transaction_version(i.app_id)
        if v is not None and v >= i.txn_version:
            out.append(i.rid)
            if not dry_run:
                _remove(lake, i.rid)
    return out


def inspect_damaged(lake: LakeRoot, name: str) -> list[tuple[str, str]]:
    """(intent record id, why) of the pending intents of ``name`` that are damaged now: a record that
    does not parse, or a file gone (nothing is changed: `pipeline lake verify` reports them)."""
    out = []
    for rid, _raw, intent in records(lake, name):
        if isinstance(intent, str):
            out.append((rid, intent))
            continue
        missing = missing_files(lake, name, intent)
        if missing and objects.get(lake, f"{staging.STAGING_DIR}/{rid}.json") is not None:   # not just given up
            out.append((rid, f"files not as written: {missing}"))
    return out


def tidy_damaged(lake: LakeRoot, name: str, *, live: set[str], dry_run: bool = False) -> tuple[list[str], list[str]]:
    """What `pipeline lake maintain` does: set aside the damaged pending intents of ``name``, then remove
    the set-aside records that protect nothing any more (:func:`.damaged.prune`). -> (set aside, removed)."""
    aside = []
    for rid, why in inspect_damaged(lake, name):
        raw = objects.get(lake, f"{staging.STAGING_DIR}/{rid}.json")
        kind = damaged.RECORD if why.startswith("unreadable") else damaged.FILES
        if dry_run or damaged.set_aside(lake, rid, raw, kind=kind, reason=why):
            aside.append(rid)
    return aside, damaged.prune(lake, name, live=live, dry_run=dry_run)
