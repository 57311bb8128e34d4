"""One racer process for tests/test_leases.py: for each trial, announce
readiness, wait for the barrier file, then try to take lease ``race-<trial>``.

    python tests/lease_racer.py LAKE_URI STORAGE_OPTIONS_JSON SYNC_DIR RACER TRIALS

Prints one JSON line per trial: {"trial", "racer", "got", "generation", "holder"}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pipeline.lake.delta import Lake
from pipeline.lake.lease import holder, try_acquire


def main() -> None:
    uri, opts, sync, racer, trials = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], \
        int(sys.argv[5])
    lake = Lake(uri, storage_options=opts or None)
    holder(lake, "race-warmup")  # the store client is built and connected before the race
    for t in range(trials):
        (sync / f"ready-{t}-{racer}").write_text("")
        go = sync / f"go-{t}"
        deadline = time.time() + 120
        while not go.exists():
            if time.time() > deadline:
                raise SystemExit("no go signal")
            time.sleep(0.0005)
        lease, held = try_acquire(lake, f"race-{t}", owner=f"racer-{racer}", ttl=600)
        print(json.dumps({"trial": t, "racer": racer, "got": lease is not None,
                          "generation": lease.generation if lease else None,
                          "holder": (held or {}).get("owner")}), flush=True)


if __name__ == "__main__":
    main()
