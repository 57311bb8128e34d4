"""The one adapter over nats-py (the NATS JetStream client): nothing else in
the package imports ``nats``. Connections (credentials, TLS), the stream and the
committers' consumers, publishing with its errors mapped to ours, fetching.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from pipeline.errors import PipelineError
from pipeline.landing import wire
from pipeline.lake.uri import split_uri

log = logging.getLogger("pipeline.landing")

FULL_CODES = (10077, 10078, 10047)   # maximum bytes / messages exceeded, insufficient storage


class BackpressureError(PipelineError):
    """The log refused a batch because the stream is full: retry later (the rows
    of parts acked before are stored; a resend dedupes by row key)."""

    exit_code = 75   # EX_TEMPFAIL: retriable
    transient = True


class PublishError(PipelineError):
    """The log did not acknowledge a batch in time (the server unreachable or
    overloaded): retry; a resend of the same rows lands once."""

    exit_code = 75
    transient = True


def connect_options(url: str, *, user: str | None = None, password: str | None = None, token: str | None = None,
                    tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                    name: str | None = None, attempts: int = 10) -> dict[str, Any]:
    """nats-py ``connect`` keyword arguments: credentials from the arguments or
    ``NATS_USER``/``NATS_PASSWORD``/``NATS_TOKEN``; TLS when a CA or a certificate is given."""
    # a lost connection is retried every 0.5 s, ``attempts`` times (a first connect too: then it fails)
    opts: dict[str, Any] = {"servers": [url], "name": name, "max_reconnect_attempts": attempts,
                            "reconnect_time_wait": 0.5, "connect_timeout": 5, "allow_reconnect": True,
                            "error_cb": _quiet}
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


async def _quiet(exc: Exception) -> None:
    """nats-py prints every connection error with a traceback by default; ours surface as one-line errors."""
    log.debug("nats: %s: %s", type(exc).__name__, exc)


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
        scheme, rest = split_uri(url)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


class IdReusedError(PipelineError):
    """A message id the stream already holds for other bytes: the batch was NOT stored (not retriable)."""


async def publish(js: Any, subject: str, payload: bytes, headers: dict[str, str], *, stream: str,
                  timeout: float) -> tuple[int, bool]:
    """(stream sequence, duplicate) once JetStream stored the message; BackpressureError
    when the stream is full, PublishError when it refused it or did not answer."""
    from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
    from nats.js.errors import APIError, NoStreamResponseError

    mid = headers.get(wire.HEADER_ID, "?")
    try:
        ack = await js.publish(subject, payload, headers=headers, stream=stream)
    except APIError as exc:
        if exc.err_code in FULL_CODES:
            raise BackpressureError(
                f"the log is full: stream {stream!r} refused {mid} ({exc.description})",
                hint="retry later (the committer drains the stream); resent rows land once") from None
        raise PublishError(f"the log refused {mid}: {exc.description} (code {exc.err_code})",
                           hint="check the stream exists (pipeline serve creates it) and its limits") from None
    except (NatsTimeout, NoRespondersError, NoStreamResponseError, asyncio.TimeoutError) as exc:
        raise PublishError(f"no acknowledgement for {mid} within {timeout:g}s ({type(exc).__name__})",
                           hint="is pipeline serve (or the stream) there? retry: resent rows land once") from None
    if ack.duplicate:
        await _check_same_bytes(js, stream, ack.seq, payload, mid)
    return ack.seq, bool(ack.duplicate)


async def _check_same_bytes(js: Any, stream: str, seq: int, payload: bytes, mid: str) -> None:
    """A duplicate ack for an id the stream holds with other bytes is a reused id: say so (checked
    while the first copy is in the stream; once the committer consumed it, the row keys decide)."""
    from nats.js.errors import NotFoundError

    try:
        stored = await js.get_msg(stream, seq=seq)
    except NotFoundError:
        return
    if stored.data != payload:
        raise IdReusedError(f"message id {mid} was already used for other bytes (stream sequence {seq}); this "
                            f"batch was NOT stored",
                            hint="never reuse a message id: give every batch a new sequence (pipeline.landing's "
                                 "client does unless you pass seq=)")


async def ensure_stream(js: Any, s: Any) -> None:
    """Create the lake's stream (work queue: a message leaves it when acked) if it does not exist."""
    from nats.js import api
    from nats.js.errors import NotFoundError

    try:
        await js.stream_info(s.stream)
        return
    except NotFoundError:
        pass
    from nats.js.errors import APIError

    try:
        await js.add_stream(api.StreamConfig(
            name=s.stream, subjects=[f"{s.stream}.>"], retention=api.RetentionPolicy.WORK_QUEUE,
            max_bytes=s.max_bytes, max_msgs=s.max_msgs, discard=api.DiscardPolicy.NEW,
            duplicate_window=s.duplicate_window_s, storage=api.StorageType.FILE, num_replicas=s.replicas))
    except APIError as e:
        raise _stream_refused(s, e) from None


def _stream_refused(s: Any, e: Any) -> PipelineError:
    """The server would not create the stream: what it said, and what to change."""
    said = f"{e.description} (NATS error {e.err_code})"
    if e.err_code == 10047:
        # JetStream reserves a stream's max_bytes up front against its file store limit
        # (by default 75% of the free disk under its store directory when the server started)
        return PipelineError(
            f"the NATS server cannot create stream {s.stream!r}: it cannot reserve max_bytes={s.max_bytes} bytes "
            f"of its file store: {said}",
            hint="pass a smaller --max-bytes, free disk under the server's store directory, raise its "
                 "jetstream max_file_store, or delete streams that are no longer used (nats stream rm NAME)")
    return PipelineError(f"the NATS server refused to create stream {s.stream!r}: {said}",
                         hint="check the server's JetStream limits and the stream settings (--replicas, --max-bytes)")


async def fresh_consumer(js: Any, s: Any, table: str) -> Any:
    """The table's durable pull consumer, created afresh: it delivers every
    message not yet acked, in stream order, from the first."""
    from nats.js import api
    from nats.js.errors import NotFoundError

    name = wire.consumer_name(s.stream, table)
    try:
        await js.delete_consumer(s.stream, name)
    except NotFoundError:
        pass
    cfg = api.ConsumerConfig(durable_name=name, filter_subject=wire.subject(s.stream, table),
                             ack_policy=api.AckPolicy.EXPLICIT, deliver_policy=api.DeliverPolicy.ALL,
                             ack_wait=s.ack_wait_s, max_deliver=-1, max_ack_pending=-1)
    return await js.pull_subscribe(wire.subject(s.stream, table), durable=name, stream=s.stream, config=cfg)


async def fetch(sub: Any, n: int, *, timeout: float) -> list[Any]:
    """Up to ``n`` messages, waiting at most ``timeout`` s ([] when none came)."""
    import nats.errors

    try:
        return await sub.fetch(n, timeout=timeout)
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return []


async def ack(msgs: list[Any], *, timeout: float = 5.0) -> int:
    """Ack ``msgs`` and wait for the server's confirmation; returns how many were not
    confirmed. An unconfirmed ack is safe: the message comes back after the
    consumer's ack wait, and its sequence (<= the committed one) gets it acked
    without landing."""
    import nats.errors

    lost = 0
    for m in msgs:
        try:
            await m.ack_sync(timeout=timeout)
        except (nats.errors.Error, asyncio.TimeoutError):
            lost += 1
    return lost


async def stream_state(js: Any, stream: str) -> Any:
    return (await js.stream_info(stream)).state
