"""One publisher for tests/admission/test_snapshot_race.py: for each trial,
publish the snapshot of ``synthetic_payload(seed=trial)`` (the same id in every
racer) with a manifest of its own (``source_versions`` differ, as when two
admissions read different data versions), aligned with the other racer at the
commit point by the snapshot module's barrier hook, then register it as
admission does (snapshots row, app transaction ``snapshot:<id>``).

    python snapshot_racer.py LAKE_URI STORAGE_OPTIONS_JSON SYNC_DIR RACER TRIALS

Prints one JSON line per trial: {"trial", "racer", "snapshot_id", "manifest_sha256"}.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa

from pipeline.snapshots.format import compute_snapshot_id

from pipeline.snapshots.publish import PUBLISH_BARRIER_ENV, write_snapshot_files
from pipeline.lake.delta import Lake
from pipeline.schema import arrow_schema
from pipeline.testing.train_fixtures import synthetic_payload


def main() -> None:
    uri, opts, sync, racer, trials = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5])
    lake = Lake(uri, storage_options=opts or None)
    for t in range(trials):
        payload = synthetic_payload(16, seed=t)
        sid = compute_snapshot_id(zip(payload.column("trajectory_id").to_pylist(),
                                      payload.column("content_hash").to_pylist()), "race", "grpo")
        payload = payload.set_column(0, "snapshot_id", pa.array([sid] * payload.num_rows))
        os.environ[PUBLISH_BARRIER_ENV] = str(sync / f"trial-{t}")
        snap = write_snapshot_files(lake, payload, snapshot_id=sid, manifest_extra={
            "config_hash": "race", "advantage_estimator": "grpo",
            "source_versions": {"trajectories": 10 * t + racer}})
        row = {"snapshot_id": sid, "admission_run_id": f"racer-{racer}", "config_hash": "race", "config_json": "{}",
               "advantage_estimator": "grpo", "current_policy_version": 0, "num_groups": 4,
               "num_members": payload.num_rows, "num_tokens": 0, "path": snap.path,
               "manifest_sha256": snap.manifest_sha256, "source_versions": [], "quality_json": None,
               "created_at": datetime.now(timezone.utc)}
        lake.append("snapshots", pa.Table.from_pylist([row], schema=arrow_schema("snapshots")), command="race",
                    app_id=f"snapshot:{sid}", txn_version=0)
        print(json.dumps({"trial": t, "racer": racer, "snapshot_id": sid,
                          "manifest_sha256": snap.manifest_sha256}), flush=True)


if __name__ == "__main__":
    main()
