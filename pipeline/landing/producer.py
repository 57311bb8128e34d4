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

from pipeline.errors import PipelineError
from pipeline.landing import wire

FULL_CODES = (10077, 10078, 10047)   # maximum bytes / messages exceeded, insufficient storage


class BackpressureError(PipelineError):
    """The log refused a batch because the stream is full: retry later (the rows
    of parts acked before are stored; a resend dedupes by row key)."""

    exit_code = 75   # EX_TEMPFAIL: retriable
    retriable = True


class PublishError(PipelineError):
    """The log did not acknowledge a batch in time (the server unreachable or
    overloaded): retry; a resend of the same rows lands once."""

    exit_code = 75
    retriable = True


@dataclass
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


def connect_options(url: str, *, user: str | None = None, password: str | None = None, token: str | None = None,
                    tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                    name: str | None = None) -> dict[str, Any]:
    """nats-py ``connect`` keyword arguments: credentials from the arguments or
    ``NATS_USER``/``NATS_PASSWORD``/``NATS_TOKEN``; TLS when a CA or a certificate is given."""
    opts: dict[str, Any] = {"servers": [url], "name": name, "max_reconnect_attempts": 5,
                            "connect_timeout": 5, "allow_reconnect": True}
    user = user or os.environ.get("NATS_USER")
    password = password or os.environ.get("NATS_PASSWORD")
    token = token or os.environ.get("NATS_TOKEN")
    if user:
        opts.update(user=user, password=password or "")
    if token:
        opts["token"] = token
    tls_ca = tls_ca or os.environ.get("NATS_TLS_CA")
    tls_cert = tls_cert or os.environ.get("NATS_TLS_CERT")
    tls_key = tls_key or os.environ.get("NATS_TLS_KEY")
    if tls_ca or tls_cert:
        import ssl

        ctx = ssl.create_default_context(cafile=tls_ca)
        if tls_cert:
            ctx.load_cert_chain(tls_cert, tls_key)
        opts["tls"] = ctx
    return opts


async def nats_connect(url: str, **kw: Any):
    import nats

    from pipeline.errors import ConfigError

    try:
        return await nats.connect(**connect_options(url, **kw))
    except Exception as exc:  # noqa: BLE001 - every connect failure is one line for the operator
        raise ConfigError(f"cannot connect to the log at {_redact(url)}: {type(exc).__name__}: {exc}",
                          hint="check the address, that nats-server runs with -js, and the credentials "
                               "(NATS_USER/NATS_PASSWORD or NATS_TOKEN)") from None


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


class AsyncProducer:
    """The producer for asyncio code (``await AsyncProducer.connect(url)``)."""

    def __init__(self, nc: Any, *, stream: str, producer_id: str, timeout: float) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=timeout)
        self.stream = wire.check_stream(stream)
        self.producer_id = wire.check_producer(producer_id)
        self.timeout = timeout
        self._seq = time.time_ns() // 1000
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, url: str, *, stream: str = wire.DEFAULT_STREAM, producer_id: str | None = None,
                      timeout: float = 10.0, **auth: Any) -> AsyncProducer:
        nc = await nats_connect(url, name=f"lake-producer {producer_id or ''}".strip(), **auth)
        return cls(nc, stream=stream, producer_id=producer_id or default_producer_id(), timeout=timeout)

    def _next_ids(self, n: int) -> list[str]:
        start = max(self._seq + 1, time.time_ns() // 1000)
        self._seq = start + n - 1
        return [wire.msg_id(self.producer_id, start + i) for i in range(n)]

    async def append(self, table: str, rows: Any) -> PublishReport:
        """Publish ``rows`` (a pyarrow Table, pandas/polars frame or list of row
        dicts, in the table's ingest contract) to ``table``'s subject; returns
        once every part is acknowledged by JetStream."""
        from pipeline.lake.ingest import _as_arrow   # the same conversion ingest_table applies

        data = rows if isinstance(rows, pa.Table) else _as_arrow(rows)
        subject = wire.subject(self.stream, table)
        parts = wire.split(data, self._nc.max_payload)
        ids = self._next_ids(len(parts))
        return await self._publish(table, subject, parts, ids, data.num_rows)

    async def ingest_table(self, rows: Any) -> PublishReport:
        return await self.append("trajectories", rows)

    async def _publish(self, table: str, subject: str, parts: list[bytes], ids: list[str], rows: int) -> PublishReport:
        from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
        from nats.js.errors import APIError, NoStreamResponseError

        from pipeline.lake.contenthash import HASH_VERSION

        seqs: list[int] = []
        dups = 0
        for i, (payload, mid) in enumerate(zip(parts, ids)):
            headers = {wire.HEADER_ID: mid, wire.HEADER_TABLE: table, wire.HEADER_WIRE: str(wire.WIRE_VERSION),
                       wire.HEADER_SCHEMA: str(HASH_VERSION)}
            if len(parts) > 1:
                headers[wire.HEADER_PART] = f"{i + 1}/{len(parts)}"
            try:
                ack = await self._js.publish(subject, payload, headers=headers, stream=self.stream)
            except APIError as exc:
                if exc.err_code in FULL_CODES:
                    raise BackpressureError(
                        f"the log is full: stream {self.stream!r} refused {mid} ({exc.description}); "
                        f"{i} of {len(parts)} part(s) of this batch were stored",
                        hint="retry later (the committer drains the stream); resent rows land once") from None
                raise PublishError(f"the log refused {mid}: {exc.description} (code {exc.err_code})",
                                   hint="check the stream exists (pipeline serve creates it) and its limits") from None
            except (NatsTimeout, NoRespondersError, NoStreamResponseError, asyncio.TimeoutError) as exc:
                raise PublishError(f"no acknowledgement for {mid} within {self.timeout:g}s ({type(exc).__name__})",
                                   hint="is pipeline serve (or the stream) there? retry: resent rows land once"
                                   ) from None
            seqs.append(ack.seq)
            dups += bool(ack.duplicate)
        return PublishReport(table, rows, len(parts), dups, min(seqs), max(seqs), ids)

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

    def append(self, table: str, rows: Any) -> PublishReport:
        return self._run(self._p.append(table, rows))

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
