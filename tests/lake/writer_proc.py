"""A writer process for the concurrency and crash tests (run as a script).

    python writer_proc.py LAKE APP_ID N_BATCHES ROWS [SEED]

Appends N_BATCHES deterministic batches of ROWS trajectories to the lake's
trajectories table, batch k as application transaction (APP_ID, k). Restarted
with the same APP_ID it appends again from the newest batch that landed (that
one is skipped by the append's own transaction check) onwards.

With WRITER_READY=<path> in the environment it writes its pid there once it
has imported everything and is about to enter its append loop: a kill after
that marker lands inside the appends, not in interpreter start-up.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def batch(app_id: str, k: int, rows: int, seed: int):
    from pipeline.lake.ingest import stamp_derived
    from pipeline.testing.trajectories import make_trajectories

    t = make_trajectories(rows, seed=seed * 100_000 + k, median_len=8, sigma=0.3, id_prefix=f"{app_id}-b{k}-")
    return stamp_derived(t, f"writer-{app_id}")


def main(argv: list[str]) -> int:
    from pipeline.lake.delta import Lake

    uri, app_id, n, rows = argv[0], argv[1], int(argv[2]), int(argv[3])
    seed = int(argv[4]) if len(argv) > 4 else 0
    lake = Lake(uri)
    landed = lake.transaction_version("trajectories", app_id) if lake.exists("trajectories") else None
    batch(app_id, 0, rows, seed)  # warm up the data generator's imports before the marker
    if os.environ.get("WRITER_READY"):
        ready = Path(os.environ["WRITER_READY"])
        ready.with_name(ready.name + ".tmp").write_text(str(os.getpid()))
        ready.with_name(ready.name + ".tmp").replace(ready)    # whole or absent
    for k in range(max(landed or 0, 0), n):
        lake.append("trajectories", batch(app_id, k, rows, seed), command="test writer",
                    app_id=app_id, txn_version=k)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
