"""The lake's front door for a fleet (docs/front-door.md): producers publish
batches to a NATS JetStream stream (one per lake, one subject per table); one
committer per table (``pipeline serve``) lands them through the ingest path
and commits each flush once, exactly once across restarts.

The landing door itself, one for every writer (validate, stamp, dedupe, quarantine, append):

- :mod:`.ingest`: files and in-memory tables (``land_files``, ``land_table``: ``pipeline ingest`` /
  ``ingest_table``), their per-source step ``check_source`` and its core ``validate_stamp``;
- :mod:`.rows`: ``land_rows``, one batch of in-memory rows under an application transaction
  (rollout spool shipping, the simulator's lake mode).

The front door for a fleet:

- :mod:`.wire`: subjects, headers, payload (the contract another language reads);
- :mod:`.producer`: :func:`connect` -> ``append(table, rows)`` / ``ingest_table(rows)``;
- :mod:`.door`: a flush's messages through validate, stamp, dedupe, quarantine (the ingest path's own steps);
- :mod:`.log`: the nats-py adapter (connections, the stream, consumers, publish errors);
- :mod:`.committer`: a flush as one Delta commit with its transaction, then the acks;
- :mod:`.serve`: the process (lease, signals, one committer per table).

nats-py is imported only in :mod:`.log` (the adapter), inside functions.
"""

from __future__ import annotations

from typing import Any

from pipeline.landing.wire import DEFAULT_STREAM, TABLES, WIRE_VERSION, subject

__all__ = ["DEFAULT_STREAM", "TABLES", "WIRE_VERSION", "connect", "subject"]


def connect(url: str, **kw: Any):
    """A blocking producer for the log at ``url``: ``append(table, rows)`` and
    ``ingest_table(rows)`` return after JetStream stored the batch
    (:class:`pipeline.landing.producer.Producer`)."""
    from pipeline.landing.producer import connect as _connect

    return _connect(url, **kw)
