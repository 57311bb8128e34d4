"""A producer process for the kill tests: publishes batches of 10 trajectories
and appends each acknowledged batch's message id to a file (after the ack)."""

from __future__ import annotations

import sys

from pipeline.landing import connect
from pipeline.testing.trajectories import make_trajectories

url, stream, acked, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with connect(url, stream=stream, producer_id="killed") as door, open(acked, "a") as out:
    for k in range(n):
        rows = make_trajectories(10, seed=k, id_prefix=f"k{k}-", median_len=8, prompt_len=4)
        door.ingest_table(rows)
        out.write(f"{k}\n")
        out.flush()
