"""The front door's wire contract (docs/front-door.md): one JetStream stream per
lake, one subject per table, one Arrow IPC stream per message.

- stream ``<stream>`` (default ``lake``) holds the subjects ``<stream>.<table>``;
- a message's payload is an Arrow IPC *stream* (schema + record batches) of rows
  in the table's ingest contract (what ``pipeline ingest`` accepts);
- headers: ``Nats-Msg-Id`` = ``<producer id>:<sequence>`` (JetStream stores a
  resend of the same id once inside the stream's duplicate window),
  ``Lake-Table`` = the table, ``Lake-Wire`` = :data:`WIRE_VERSION`,
  ``Lake-Schema-Version`` = the content-hash version the rows were hashed with
  (:data:`pipeline.lake.contenthash.HASH_VERSION`), ``Lake-Part`` = ``i/n`` when a
  batch over the server's ``max_payload`` was split (each part has its own id).

Pure functions: no network here (the producer is :mod:`.producer`, the
committer :mod:`.committer`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyarrow as pa

from pipeline.errors import ConfigError, InputFileError

WIRE_VERSION = 1
DEFAULT_STREAM = "lake"
TABLES = ("trajectories", "events")          # the tables the front door lands
HEADER_ID = "Nats-Msg-Id"
HEADER_TABLE = "Lake-Table"
HEADER_WIRE = "Lake-Wire"
HEADER_SCHEMA = "Lake-Schema-Version"
HEADER_PART = "Lake-Part"
HEADROOM = 8 * 1024                          # bytes of a message kept for headers and framing
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PRODUCER = re.compile(r"^[A-Za-z0-9_.=-]{1,128}$")


def check_stream(stream: str) -> str:
    if not _NAME.match(stream or ""):
        raise ConfigError(f"stream name {stream!r} is not a NATS stream name",
                          hint="use letters, digits, '_' or '-' (at most 64), e.g. 'lake'")
    return stream


def check_producer(producer_id: str) -> str:
    if not _PRODUCER.match(producer_id or ""):
        raise ConfigError(f"producer id {producer_id!r} is not allowed",
                          hint="use letters, digits, '_', '.', '=' or '-' (at most 128); ':' separates the sequence")
    return producer_id


def subject(stream: str, table: str) -> str:
    """The subject of ``table`` in ``stream``."""
    if table not in TABLES:
        raise ConfigError(f"the front door does not land table {table!r}", hint=f"use one of {', '.join(TABLES)}")
    return f"{check_stream(stream)}.{table}"


def consumer_name(stream: str, table: str) -> str:
    """The durable pull consumer of ``table`` (one committer per table)."""
    return f"{check_stream(stream)}-{table}-committer"


def app_id(stream: str, table: str) -> str:
    """The Delta application transaction a committer's commits carry: ``<stream>/<consumer>``."""
    return f"{stream}/{consumer_name(stream, table)}"


def msg_id(producer_id: str, seq: int) -> str:
    return f"{producer_id}:{seq}"


@dataclass(frozen=True)
class Decoded:
    table: pa.Table | None        # None when the payload is not an Arrow IPC stream
    problem: str | None           # why not (one line)


def encode(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def decode(payload: bytes) -> Decoded:
    """The rows of one message, or the reason they cannot be read."""
    try:
        buf = pa.allocate_buffer(len(payload))      # Arrow-owned (docs/clean-exit.md)
        memoryview(buf).cast("B")[:] = payload
        return Decoded(pa.ipc.open_stream(pa.BufferReader(buf)).read_all(), None)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as exc:
        return Decoded(None, f"the payload is not an Arrow IPC stream ({exc})")


def split(table: pa.Table, max_payload: int) -> list[bytes]:
    """``table`` as one or more Arrow IPC streams, each at most ``max_payload -
    HEADROOM`` bytes (halving the rows until each part fits). A single row over
    the limit is an error: nothing is sent."""
    limit = max_payload - HEADROOM
    whole = encode(table)
    if len(whole) <= limit:
        return [whole]
    if table.num_rows <= 1:
        raise InputFileError(f"one row is {len(whole)} bytes as Arrow IPC, over the log's message limit "
                             f"({limit} bytes of max_payload {max_payload})",
                             hint="raise the NATS server's max_payload (up to 64 MB) or land it with pipeline ingest")
    half = table.num_rows // 2
    return split(table.slice(0, half), max_payload) + split(table.slice(half), max_payload)
