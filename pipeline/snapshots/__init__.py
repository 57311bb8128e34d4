"""Training-batch snapshots: the immutable, content-addressed unit that
admission writes and every trainer reads.

- :mod:`pipeline.snapshots.format`: ids, the manifest, opening and verifying;
- :mod:`pipeline.snapshots.publish`: writing and atomically publishing one;
- :mod:`pipeline.snapshots.reader`: the reader API for trainers, re-exported here::

    import pipeline.snapshots
    snap = pipeline.snapshots.open(lake, snapshot_id)     # verifies, or raises
    for batch in snap.batches(256): ...
"""

from pipeline.snapshots.reader import (  # noqa: A004
    MEMBER_COLUMNS, TURN_COLUMNS, SnapshotReader, collate, member, open, policy_turns, turn_token_advantages)

__all__ = ["MEMBER_COLUMNS", "TURN_COLUMNS", "SnapshotReader", "collate", "member", "open", "policy_turns",
           "turn_token_advantages"]
