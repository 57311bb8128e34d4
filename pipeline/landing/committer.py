"""The committer behind the front door (``pipeline serve``): one per table.

It pulls the table's subject through a durable pull consumer, lands every
message through the ingest path (validate, stamp, dedupe, quarantine:
:func:`pipeline.landing.ingest.check_source`, the function ``pipeline ingest``
runs per file), and commits a whole flush as ONE Delta commit carrying the
application transaction ``appId = <stream>/<consumer>``, ``version = the last
stream sequence`` of the flush (the kafka-delta-ingest rule). Only then are
the messages acked. docs/write-protocol.md ("Front door") has the proof; in short:

- resume: at start the consumer is created afresh (deliver all: the stream is a
  work queue, so "all" is what was never acked) and every message with sequence
  <= the table's transaction version is acked without landing: a commit whose
  acks were lost is never landed twice, and nothing acked was not committed;
- fencing: every commit also takes version ``n + 1`` of the fence transaction
  ``<app id>#fence`` (``Lake.append(lock=...)``), where ``n`` is the version this
  committer read at start or committed last. A committer that another one
  superseded finds ``n + 1`` taken and its commit is refused (``LockTaken``):
  the table's transaction version decides, not a clock;
- one committer per table also by a lease (``serve-<stream>-<table>``), so a
  second ``pipeline serve`` refuses or waits as a standby.

Dedupe keys stay in memory (loaded once from the key index), so a flush costs
its own rows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pipeline.errors import ConflictError, PipelineError
from pipeline.landing import wire

if TYPE_CHECKING:
    from pipeline.lake.delta import KeySet, Lake

log = logging.getLogger("pipeline.serve")
COMMAND = "pipeline serve"
FENCE_SUFFIX = "#fence"
MAX_RESYNCS = 5


class FencedError(ConflictError):
    """Another committer committed this table since this one read it: this one
    must not commit (it stops; nothing it pulled is acked)."""


@dataclass(kw_only=True)
class ServeSettings:
    stream: str = wire.DEFAULT_STREAM
    tables: tuple[str, ...] = ("trajectories", "events")
    interval_s: float = 1.0              # at most one commit per table per interval
    linger_s: float = 0.2                # a flush waits this long for more messages after the first
    max_messages: int = 2_000            # flush earlier when this many messages are pulled
    max_flush_bytes: int = 256 << 20     # ... or this many payload bytes
    fetch_batch: int = 256
    max_bytes: int = 1 << 30             # the stream's limit: producers get backpressure past it
    max_msgs: int = -1
    duplicate_window_s: float = 120.0
    replicas: int = 1
    ack_wait_s: float = 300.0            # longer than any flush: redelivery only after a committer died
    lease_ttl_s: float = 30.0


@dataclass(kw_only=True)
class FlushReport:
    table: str
    messages: int = 0
    skipped: int = 0                     # sequence <= the committed version: landed before, acked now
    rows_read: int = 0
    landed: int = 0
    duplicates: int = 0
    quarantined: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    version: int | None = None           # the Delta version of the table's commit
    txn_version: int | None = None       # the last stream sequence it covers

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class LogMessage:
    """One message pulled from the landing log: its stream sequence, id, headers and payload."""

    seq: int
    msg_id: str
    headers: dict[str, str]
    payload: bytes
    raw: Any                              # the nats Msg (acked after the commit)


class TableCommitter:
    """Lands one table's messages. ``resync`` reads the table's state; ``land``
    commits a flush (no network: the caller pulls and acks)."""

    def __init__(self, lake: Lake, table: str, *, stream: str) -> None:
        self.lake = lake
        self.table = table
        self.stream = stream
        self.app_id = wire.app_id(stream, table)
        self.fence_app = self.app_id + FENCE_SUFFIX
        self.committed_seq = 0
        self.fence = 0
        self.read_version: int | None = None
        self.keys: KeySet | None = None
        self.resync()

    def resync(self) -> None:
        """Read the committed sequence, the fence version and the dedupe keys from the table."""
        from pipeline.lake.delta import KeySet

        self.lake.ensure(self.table)
        dt = self.lake.table(self.table)
        self.committed_seq = dt.transaction_version(self.app_id) or 0
        self.fence = dt.transaction_version(self.fence_app) or 0
        self.read_version = dt.version()
        ks = self.lake.keys(self.table, dt)
        self.keys = KeySet(ks.index, np.array(ks.loose, copy=True))

    def land(self, msgs: list[LogMessage]) -> tuple[FlushReport, list[LogMessage]]:
        """Commit ``msgs`` (one quarantine commit when needed, then one commit of
        the table carrying the transaction); returns the report and the messages
        to ack (all of them). Raises FencedError when superseded."""
        from pipeline.lake.delta import KeyRace, LockTaken

        msgs = sorted(msgs, key=lambda m: m.seq)
        for _ in range(MAX_RESYNCS):
            fresh = [m for m in msgs if m.seq > self.committed_seq]
            report = FlushReport(table=self.table, messages=len(msgs), skipped=len(msgs) - len(fresh))
            if not fresh:
                return report, msgs
            try:
                self._commit(fresh, report)
                return report, msgs
            except KeyRace:
                self.resync()          # another writer landed some keys since our read: decide again
            except LockTaken:
                raise FencedError(f"{self.table}: another committer committed since this one read version "
                                  f"{self.fence} of {self.fence_app}; this one stops without acking",
                                  hint="run one pipeline serve per lake (a second one waits with --standby)"
                                  ) from None
        raise PipelineError(f"{self.table}: lost {MAX_RESYNCS} races in a row to concurrent appends",
                            hint="restart pipeline serve: nothing unacked is lost")

    def _commit(self, fresh: list[LogMessage], report: FlushReport) -> None:
        from pipeline.lake.delta.common import pause_point

        staged, rows, q_tables, new_keys = self._stage(fresh, report)
        last = fresh[-1].seq
        try:
            if q_tables:
                q = pa.concat_tables(q_tables)
                # keyed by (message id, row, code): a replay never quarantines a row twice
                self.lake.append("quarantine", q, command=COMMAND)
                report.quarantined = q.num_rows
                for code in q.column("reason_code").to_pylist():
                    report.reasons[code] = report.reasons.get(code, 0) + 1
            res = self.lake.append(
                self.table, None, command=COMMAND, app_id=self.app_id, txn_version=last,
                staged=staged, read_version=self.read_version, lock=(self.fence_app, self.fence + 1),
                extra_metadata={"pipeline.serve.first_seq": str(fresh[0].seq),
                                "pipeline.serve.messages": str(len(fresh))})
        except BaseException:
            if staged and (self.lake.transaction_version(self.table, self.app_id) or 0) < last:
                self.lake.discard(self.table, staged)
            raise
        if not res.landed:   # (app id, last) committed by someone else: superseded
            from pipeline.lake.delta import LockTaken

            self.lake.discard(self.table, staged)
            raise LockTaken(self.fence_app, self.fence + 1)
        pause_point(f"serve:{self.table}:committed")
        from pipeline.lake.delta import KeySet

        assert self.keys is not None
        loose = [self.keys.loose, new_keys]
        if res.version is not None and self.read_version is not None and res.version > self.read_version + 1:
            # other writers (pipeline ingest, Lake.append) committed between our read and our commit: their
            # keys join the ones in memory, or a later flush would not see them
            loose.append(self.lake.keys(self.table, self.lake.table(self.table, res.version),
                                        since=self.read_version).loose)
        self.keys = KeySet(self.keys.index, np.concatenate(loose))
        self.committed_seq, self.fence, self.read_version = last, self.fence + 1, res.version
        report.landed = rows
        report.version, report.txn_version = res.version, last

    def _stage(self, fresh: list[LogMessage], report: FlushReport) -> tuple[list[Any], int, list[pa.Table], np.ndarray]:
        """(staged files, rows staged, quarantine tables, keys staged) of the fresh messages."""
        from pipeline.landing.door import Incoming, check_flush

        assert self.keys is not None
        seen = _seen(self.lake, self.table, self.read_version, self.keys)
        subject = wire.subject(self.stream, self.table)
        lands, q_tables, stats = check_flush(seen, self.table, [
            Incoming(m.msg_id, f"{subject}#{m.seq}", m.payload, m.headers) for m in fresh])
        report.rows_read += stats.rows_read
        report.duplicates += stats.duplicates
        if not lands:   # nothing to land: the commit still records the sequence (no files)
            from pipeline.lake.delta import Staged

            return [Staged(actions=[], keys=np.empty(0, np.int64), rows=0, written_at=time.time())], 0, q_tables, np.empty(0, np.int64)
        data = pa.concat_tables(lands, promote_options="permissive")
        st = self.lake.stage(self.table, data)
        return [st], data.num_rows, q_tables, st.keys


def _seen(lake: Lake, table: str, read_version: int | None, keys: KeySet):
    """The ingest path's dedupe state over the in-memory keys (trajectories), or
    a key set the events path extends."""
    from pipeline.landing.ingest import Seen

    accepted = pa.table({"trajectory_id": pa.array([], pa.string()), "content_hash": pa.array([], pa.string())})
    return Seen(lake, None, read_version, keys, accepted)


# -- the network half ------------------------------------------------------------------------
def as_msg(m: Any) -> LogMessage:
    headers = dict(m.headers or {})
    return LogMessage(m.metadata.sequence.stream, headers.get(wire.HEADER_ID, f"seq:{m.metadata.sequence.stream}"),
                headers, m.data, m)


async def run_table(js: Any, committer: TableCommitter, s: ServeSettings, stop: asyncio.Event,
                    on_flush: Any = None, renew: Any = None) -> None:
    """Pull and commit until ``stop`` is set (what was pulled is committed and acked first).

    A flush starts when messages are pending, the previous flush is done, at
    least ``interval_s`` passed since the previous flush started (at most one
    commit per interval) and the oldest pending message waited ``linger_s``
    (or ``max_messages`` / ``max_flush_bytes`` are pending: then pulling pauses).
    While a flush commits (on a worker thread) the next one is pulled, so a
    message waits for at most one commit before its own."""
    from pipeline.lake.delta.common import pause_point
    from pipeline.landing.log import ack, fetch, fresh_consumer

    sub = await fresh_consumer(js, s, committer.table)
    pending: list[LogMessage] = []
    size = 0
    first_at = 0.0                      # when the oldest pending message came
    last_flush = -1e9                   # when the last flush started
    inflight: asyncio.Future | None = None
    loop = asyncio.get_running_loop()
    while True:
        now = time.monotonic()
        full = len(pending) >= s.max_messages or size >= s.max_flush_bytes
        due_at = max(last_flush + s.interval_s, first_at + (0.0 if full else s.linger_s))
        if not stop.is_set() and not full:
            wait = 0.05 if inflight is not None else (max(0.01, due_at - now) if pending else s.interval_s)
            got = await fetch(sub, s.fetch_batch, timeout=min(wait, s.interval_s))
            if got and not pending:
                first_at = time.monotonic()
            for m in got:
                pending.append(as_msg(m))
                size += len(m.data)
            if got:
                pause_point(f"serve:{committer.table}:pulled")
        elif inflight is not None:
            await asyncio.wait([inflight], timeout=s.interval_s)
        elif pending:
            await asyncio.sleep(max(0.0, due_at - time.monotonic()))
        if renew is not None:
            renew()                                      # LeaseLostError: stop before committing
        if inflight is not None and inflight.done():
            report, to_ack = inflight.result()           # FencedError, a commit error: stop, ack nothing
            inflight = None
            if await ack([m.raw for m in to_ack]):
                log.warning("%s: some acks were not confirmed; those messages come back and are acked "
                            "without landing", committer.table)
            if on_flush is not None:
                on_flush(report)
        now = time.monotonic()
        if pending and inflight is None and (now >= due_at or (stop.is_set() and now >= last_flush + s.interval_s)):
            last_flush = now
            inflight = loop.run_in_executor(None, committer.land, pending)
            pending, size = [], 0
        if stop.is_set() and not pending and inflight is None:
            return


def committed_through(lake: Lake, stream: str, table: str) -> int:
    """The last stream sequence of ``table``'s subject the lake has committed (0: none)."""
    if not lake.exists(table):
        return 0
    return lake.transaction_version(table, wire.app_id(stream, table)) or 0


def wait_committed(lake: Lake, stream: str, marks: dict[str, int], *, timeout: float = 120.0) -> None:
    """Block until the lake committed every table's subject through ``marks[table]``
    (a producer that must read its own writes back: rollout recovery)."""
    deadline = time.monotonic() + timeout
    for table, seq in marks.items():
        while committed_through(lake, stream, table) < seq:
            if time.monotonic() > deadline:
                raise PipelineError(f"the lake has not committed {table} through stream sequence {seq} within "
                                    f"{timeout:g}s (at {committed_through(lake, stream, table)})",
                                    hint="is pipeline serve running on this lake and stream?")
            time.sleep(0.2)
