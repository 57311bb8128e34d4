"""One racer for the write-protocol tests (run as a script).

    python race_proc.py LAKE START_FILE ingest FILE...
    python race_proc.py LAKE START_FILE maintain
    python race_proc.py LAKE START_FILE publish CHECKPOINT_ID
    python race_proc.py LAKE START_FILE append APP_ID SEED N ID_PREFIX    (Lake.append of N trajectories)

Imports everything first, writes the readiness marker START_FILE.ready-<pid>,
then waits for START_FILE to exist (the test writes it once every racer is
ready), so racers started one by one begin their read-decide-commit at the
same moment. Prints one JSON line with the outcome, and in ``raced`` the wall
clock times at which it was released and finished.
"""

from __future__ import annotations

import json
import os
import sys
import time


def trajectories(seed: int, n: int, prefix: str):
    """The N trajectories an ``append`` racer lands (the same for the same arguments)."""
    from pipeline.lake.ingest import stamp_derived
    from pipeline.testing.trajectories import make_trajectories

    return stamp_derived(make_trajectories(n, seed=seed, median_len=6, sigma=0.2, id_prefix=prefix), "race")


def _append(lake, *, app_id: str, seed: int, n: int, prefix: str) -> dict:
    r = lake.append("trajectories", trajectories(seed, n, prefix), command="race append", app_id=app_id)
    return {"landed": r.landed, "rows": r.rows, "duplicates": r.duplicates, "version": r.version}


def main(argv: list[str]) -> int:
    from pipeline.lake.delta import Lake
    from pipeline.ingest import ingest_files
    from pipeline.maintain import maintain
    from pipeline.policy_store import publish_checkpoint

    uri, start, cmd, args = argv[0], argv[1], argv[2], argv[3:]
    lake = Lake(uri)
    if start != "-":
        with open(f"{start}.tmp-{os.getpid()}", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{start}.tmp-{os.getpid()}", f"{start}.ready-{os.getpid()}")   # whole or absent
    while start != "-" and not os.path.exists(start):
        time.sleep(0.002)
    released = time.time()
    if cmd == "ingest":
        out = ingest_files(lake, args).as_dict()
    elif cmd == "maintain":
        out = maintain(lake, tables=["trajectories"], orphan_min_age_s=float(os.environ.get("ORPHAN_AGE", 3600)))
    elif cmd == "publish":
        row = publish_checkpoint(lake, checkpoint_id=args[0], policy_version=None, parent_checkpoint_id=None,
                                 snapshot_ids=[], train_config={}, train_config_hash="h", seed=0)
        out = {"policy_version": row["policy_version"]}
    elif cmd == "append":
        out = _append(lake, app_id=args[0], seed=int(args[1]), n=int(args[2]), prefix=args[3])
    else:
        raise SystemExit(f"unknown command {cmd}")
    print(json.dumps(dict(out, raced=[released, time.time()]), default=str), flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # These racers test what lands in the lake, which is committed before this line. One
    # racer of the conflicting-content race was seen to abort (SIGABRT) at interpreter
    # teardown once in ~5 runs, after printing its result; the library's clean exit is what
    # tests/test_clean_exit.py measures (docs/clean-exit.md), so a racer skips teardown.
    os._exit(code)
