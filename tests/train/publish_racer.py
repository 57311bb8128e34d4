"""One publisher process for tests/train/test_publish_race.py: write a checkpoint
directory of its own (bytes that differ per racer, as two trainings' DeepSpeed
pickles do), wait for the barrier file, publish it.

    python tests/train/publish_racer.py LAKE_URI STORAGE_OPTIONS_JSON SYNC_DIR RACER CHECKPOINT_ID SNAPSHOT_ID

SYNC_DIR "-": no barrier. Prints one JSON line: {racer, rel, policy_version,
already_published, published_by, path} or {racer, rel, error}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.lake.delta import Lake
from pipeline.policy_store import checkpoint_rows, local_dir, publish_checkpoint, run_checkpoint_rel


def write_run_dir(root: Path, racer: str) -> None:
    (root / "hf").mkdir(parents=True)
    (root / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "racer": "same"}))
    (root / "hf" / "model.safetensors").write_bytes(b"weights " * 64)
    (root / "ds" / "final").mkdir(parents=True)
    (root / "ds" / "final" / "mp_rank_00_model_states.pt").write_bytes(f"state of racer {racer} ".encode() * 64)
    (root / "latest").write_text("final")


def main() -> None:
    uri, opts, sync, racer, ckpt, sid = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], \
        sys.argv[5], sys.argv[6]
    lake = Lake(uri, storage_options=opts or None)
    rel = run_checkpoint_rel(ckpt)
    write_run_dir(local_dir(lake, rel), racer)
    checkpoint_rows(lake)   # the store client is built and connected before the race
    if sync != "-":
        (Path(sync) / f"ready-{racer}").write_text("")
        go = Path(sync) / "go"
        deadline = time.time() + 120
        while not go.exists():
            if time.time() > deadline:
                raise SystemExit("no go signal")
            time.sleep(0.0005)
    try:
        row = publish_checkpoint(lake, checkpoint_id=ckpt, policy_version=None, parent_checkpoint_id=None,
                                 snapshot_ids=[sid], train_config={"racer": racer}, train_config_hash="race", seed=0,
                                 command=f"racer {racer}", rel=rel, once_per_snapshot=True)
    except PipelineError as exc:
        print(json.dumps({"racer": racer, "rel": rel, "error": exc.message}), flush=True)
        return
    print(json.dumps({"racer": racer, "rel": rel, "policy_version": int(row["policy_version"]),
                      "checkpoint_id": row["checkpoint_id"], "already_published": row["already_published"],
                      "published_by": row["published_by"], "path": row["path"]}), flush=True)


if __name__ == "__main__":
    main()
