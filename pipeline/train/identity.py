"""Step 1 of a training run: its identity.

The same snapshot + parent + config + world size always names the same run
(``run_identity``), so a rerun finds its resumable state, a retried publish
lands once, and a replayed version of the resident trainer
(pipeline.train.follow) must name the checkpoint it already published.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import TYPE_CHECKING, Any

from pipeline.config import config_dict
from pipeline.errors import ConflictError, NotFoundError
from pipeline.train.records import Run, TrainResult

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.policy_store import PolicyRef
    from pipeline.train.config import TrainConfig


def snapshot_consumers(lake: Lake, snapshot_id: str) -> list[dict[str, Any]]:
    if not lake.exists("checkpoints"):
        return []
    rows = lake.read("checkpoints", columns=["checkpoint_id", "snapshot_ids", "policy_version",
                                             "parent_checkpoint_id", "train_config_json", "created_at"]).to_pylist()
    return [r for r in rows if snapshot_id in (r["snapshot_ids"] or [])]


def run_identity(snapshot_id: str, parent_checkpoint_id: str, cfg: TrainConfig, world_size: int,
                 generation: int = 0) -> tuple[str, str]:
    """(run_key, checkpoint_id): the same snapshot + parent + config + world
    size always names the same run, so a rerun finds its resumable state and a
    retried publish lands once. ``generation`` > 0 only for forced retraining."""
    from pipeline.train.config import identity_hash

    key = json.dumps([snapshot_id, parent_checkpoint_id, identity_hash(cfg), int(world_size), int(generation)])
    run_key = hashlib.sha256(key.encode()).hexdigest()
    return run_key, f"ck-{run_key[:20]}"


def published_result(lake: Lake, checkpoint_id: str, snapshot_id: str) -> TrainResult:
    from pipeline.policy_store import resolve_policy
    from pipeline.train.checkpoint import weight_hashes

    from pipeline.policy_store import published_by

    ref = resolve_policy(lake, checkpoint_id)
    row = lake.read("checkpoints").to_pylist()
    row = next(r for r in row if r["checkpoint_id"] == checkpoint_id)
    return TrainResult(checkpoint_id=checkpoint_id, policy_version=ref.policy_version,
                       parent_checkpoint_id=row["parent_checkpoint_id"], snapshot_id=snapshot_id,
                       global_step=int(row["global_step"]), samples_seen=int(row["samples_seen"]),
                       metrics=json.loads(row["metrics_json"] or "{}"), weight_sha256=weight_hashes(ref.file_sha256),
                       path=str(ref.path), world_size=int(row["world_size"]), already_published=True,
                       published_by=published_by(row))


def identify(lake: Lake, snapshot_id: str, cfg: TrainConfig, *, from_checkpoint: str | int | None, resume: bool,
             force: bool, parent: PolicyRef | None = None) -> Run | TrainResult:
    """Step 1: the run's identity; the published result when this very run already
    published, ConflictError when another run consumed the snapshot."""
    from pipeline.policy_store import local_checkpoint_dir, resolve_policy

    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if parent is None:   # the resident trainer passes the version it just published (its files: hashed then)
        parent = resolve_policy(lake, from_checkpoint)      # hash-verified unless a plain directory
    consumers = snapshot_consumers(lake, snapshot_id)
    generation = len(consumers) if force else 0
    run_key, checkpoint_id = run_identity(snapshot_id, parent.checkpoint_id, cfg, world_size, generation)
    if consumers and not force:
        if any(c["checkpoint_id"] == checkpoint_id for c in consumers):
            # this very run already published (also when the parent was a plain directory,
            # which is recorded as parent None): a no-op
            return published_result(lake, checkpoint_id, snapshot_id)
        for c in consumers:
            # the same run (same snapshot, parent, config, world size) already published: a no-op,
            # even though "the newest policy" is now that run's own output
            key, cid = run_identity(snapshot_id, c["parent_checkpoint_id"] or "", cfg, world_size)
            if c["checkpoint_id"] == cid:
                if rank == 0:   # killed after the publishing commit, before the cleanup
                    shutil.rmtree(local_checkpoint_dir(lake, f"_runs/{key[:24]}"), ignore_errors=True)
                return published_result(lake, cid, snapshot_id)
        from pipeline.policy_store import published_by

        c = consumers[0]
        raise ConflictError(f"snapshot {snapshot_id} was already consumed by checkpoint {c['checkpoint_id']} "
                            f"(policy version {c['policy_version']}, published by {published_by(c)})",
                            hint="a snapshot trains once; pass --force to train on it again")
    run = new_run(lake, snapshot_id, cfg, parent, world_size=world_size, rank=rank, generation=generation)
    if resume and not (run.work / "run.json").is_file():
        raise NotFoundError(f"nothing to resume: no interrupted run of snapshot {snapshot_id} from "
                            f"{parent.checkpoint_id} with this config (looked in {run.work})",
                            hint="run without --resume to start training; a different --config, --set, "
                                 "--from-checkpoint or --nproc is a different run")
    return run


def new_run(lake: Lake, snapshot_id: str, cfg: TrainConfig, parent: PolicyRef, *, world_size: int, rank: int,
            generation: int = 0) -> Run:
    """The Run of training ``snapshot_id`` from ``parent`` (no consumption check:
    ``identify`` does that; the resident trainer's replay re-runs consumed ones)."""
    from pipeline import lineage
    from pipeline.policy_store import local_checkpoint_dir, local_dir, run_checkpoint_rel

    run_key, checkpoint_id = run_identity(snapshot_id, parent.checkpoint_id, cfg, world_size, generation)
    work = local_checkpoint_dir(lake, f"_runs/{run_key[:24]}")
    final_rel = run_checkpoint_rel(checkpoint_id, _run_tag(world_size))   # this run's own: never a published one
    final = local_dir(lake, final_rel)
    lineage_run_id = lineage.new_run_id()
    inputs = [lineage.snapshot(lake, snapshot_id), lineage.checkpoint(lake, parent.checkpoint_id, parent.policy_version)]
    ol: dict[str, Any] = dict(job_type="TRAIN", engine="deepspeed", config=config_dict(cfg) | {"world_size": world_size})
    return Run(lake=lake, snapshot_id=snapshot_id, cfg=cfg, world_size=world_size, rank=rank, parent=parent,
               run_key=run_key, checkpoint_id=checkpoint_id, generation=generation, work=work, final=final,
               lineage_run_id=lineage_run_id, inputs=inputs, ol=ol, final_rel=final_rel)


def _run_tag(world_size: int) -> str | None:
    """The tag of this run's checkpoint directory, the same on every rank: the
    launcher's ``PIPELINE_RUN_TAG`` (pipeline.train.launch sets it), else a fresh one
    for one process, else (another launcher) the launcher's pid and port."""
    if os.environ.get("PIPELINE_RUN_TAG") or world_size == 1:
        return None                                    # run_checkpoint_rel: the env tag, or a fresh one
    return f"p{os.getppid()}-{os.environ.get('MASTER_PORT', '0')}"
