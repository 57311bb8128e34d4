"""Producers: publish rows to the lake's log and return once JetStream stored them.

    from pipeline.landing import connect
    with connect("nats://user:pass@host:4222") as door:
        door.ingest_table(rows)                 # trajectories; or door.append("events", rows)

``append`` returns after the JetStream publish ack of every part: the rows are
stored in the stream (replicated first, in a cluster) and will be committed to
the lake by ``pipeline serve`` exactly once. A full stream (its ``max_bytes`` /
``max_msgs`` with discard=new) raises :class:`BackpressureError`, which is
retriable: nothing is buffered without bound in the producer.

Each message's ``Nats-Msg-Id`` is ``<producer id>:<sequence>``; sequences start
at the clock in microseconds and only grow, so a restarted producer with the same
id never reuses one (a reused id with other bytes would be dropped by the
server as a duplicate). :class:`AsyncProducer` is the same for asyncio code.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.landing import wire
from pipeline.landing.log import BackpressureError, IdReusedError, PublishError, nats_connect  # noqa: F401 - re-exported


@dataclass(kw_only=True)
class PublishReport:
    table: str
    rows: int
    messages: int
    duplicates: int          # messages the server had stored before (a resend inside the duplicate window)
    first_seq: int           # stream sequences of the parts
    last_seq: int
    msg_ids: list[str]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def default_producer_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class AsyncProducer:
    """The producer for asyncio code (``await AsyncProducer.connect(url)``)."""

    def __init__(self, nc: Any, *, stream: str, producer_id: str, timeout: float) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=timeout)
        self.stream = wire.check_stream(stream)
        self.producer_id = wire.check_producer(producer_id)
        self.timeout = timeout
        self._seq = time.time_ns() // 1000

    @classmethod
    async def connect(cls, url: str, *, stream: str = wire.DEFAULT_STREAM, producer_id: str | None = None,
                      timeout: float = 10.0, **auth: Any) -> AsyncProducer:
        nc = await nats_connect(url, name=f"lake-producer {producer_id or ''}".strip(), **auth)
        return cls(nc, stream=stream, producer_id=producer_id or default_producer_id(), timeout=timeout)

    def _next_ids(self, n: int) -> list[str]:
        start = max(self._seq + 1, time.time_ns() // 1000)
        self._seq = start + n - 1
        return [wire.msg_id(self.producer_id, start + i) for i in range(n)]

    async def append(self, table: str, rows: Any, *, seq: int | None = None,
                     producer_id: str | None = None) -> PublishReport:
        """Publish ``rows`` (a pyarrow Table, pandas/polars frame or list of row
        dicts, in the table's ingest contract) to ``table``'s subject; returns
        once every part is acknowledged by JetStream. ``seq``: the caller's own
        sequence for this batch (a resend after a crash then has the same ids:
        ``<producer>:<seq>``, or ``<producer>:<seq>.<part>`` when split), under
        ``producer_id`` when given (one connection, several deterministic producers)."""
        from pipeline.landing.ingest import as_arrow   # the same conversion ingest_table applies

        data = rows if isinstance(rows, pa.Table) else as_arrow(rows)
        subject = wire.subject(self.stream, table)
        parts = wire.split(data, self._nc.max_payload)
        if seq is None:
            ids = self._next_ids(len(parts))
        else:
            one = wire.msg_id(wire.check_producer(producer_id or self.producer_id), seq)
            ids = [one] if len(parts) == 1 else [f"{one}.{i + 1}" for i in range(len(parts))]
        return await self._publish(table, subject, parts, ids, data.num_rows)

    async def ingest_table(self, rows: Any) -> PublishReport:
        return await self.append("trajectories", rows)

    async def _publish(self, table: str, subject: str, parts: list[bytes], ids: list[str], rows: int) -> PublishReport:
        from pipeline.landing.log import publish

        from pipeline.lake.contenthash import HASH_VERSION

        seqs: list[int] = []
        dups = 0
        for i, (payload, mid) in enumerate(zip(parts, ids)):
            headers = {wire.HEADER_ID: mid, wire.HEADER_TABLE: table, wire.HEADER_WIRE: str(wire.WIRE_VERSION),
                       wire.HEADER_SCHEMA: str(HASH_VERSION)}
            if len(parts) > 1:
                headers[wire.HEADER_PART] = f"{i + 1}/{len(parts)}"
            try:
                seq, dup = await publish(self._js, subject, payload, headers, stream=self.stream,
                                         timeout=self.timeout)
            except (BackpressureError, PublishError) as exc:
                if len(parts) == 1:
                    raise
                raise type(exc)(f"{exc.message}; {i} of {len(parts)} part(s) of this batch were stored before",
                                hint=exc.hint) from None
            seqs.append(seq)
            dups += dup
        return PublishReport(table=table, rows=rows, messages=len(parts), duplicates=dups, first_seq=min(seqs),
                             last_seq=max(seqs), msg_ids=ids)

    async def close(self) -> None:
        await self._nc.drain()


class Producer:
    """The blocking producer (:func:`connect`): an :class:`AsyncProducer` on a
    private event loop thread. Safe to call from several threads."""

    def __init__(self, url: str, *, stream: str = wire.DEFAULT_STREAM, producer_id: str | None = None,
                 timeout: float = 10.0, **auth: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lake-producer", daemon=True)
        self._thread.start()
        try:
            self._p: AsyncProducer = self._run(AsyncProducer.connect(
                url, stream=stream, producer_id=producer_id, timeout=timeout, **auth))
        except BaseException:
            self._stop()
            raise

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def producer_id(self) -> str:
        return self._p.producer_id

    def append(self, table: str, rows: Any, *, seq: int | None = None,
               producer_id: str | None = None) -> PublishReport:
        return self._run(self._p.append(table, rows, seq=seq, producer_id=producer_id))

    def ingest_table(self, rows: Any) -> PublishReport:
        return self._run(self._p.ingest_table(rows))

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._run(self._p.close())
            finally:
                self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(url: str, **kw: Any) -> Producer:
    """A blocking producer for the log at ``url`` (``nats://[user:pass@]host:port``)."""
    return Producer(url, **kw)
