"""``train_snapshot``: train the policy on exactly one snapshot, publish the next version.

    pipeline train --batch-snapshot SNAPSHOT_ID                      # one process, CPU or one GPU
    pipeline train --batch-snapshot SNAPSHOT_ID --nproc 2            # torchrun, gloo on CPU / nccl on GPUs
    pipeline train --batch-snapshot SNAPSHOT_ID --resume             # continue a killed run
    deepspeed --num_gpus 2 -m pipeline.train.worker JOB.json        # any launcher: see pipeline/train/worker.py

The driver (``_train_in_env``) is a short list of named steps, one function each,
in their own modules:
 1. ``identity.identify``: the run (snapshot + parent + config + world size -> checkpoint id);
    a snapshot already consumed by a published checkpoint is refused (or, for
    the same run, the published result is returned: a no-op);
 2. ``steps.prepare_data``: verify and load the snapshot, load the parent policy, assert it
    is trainable (data.check_members);
 3. ``steps.build_engine``: wrap the policy in DeepSpeed (ds_adapter);
 4. ``steps.plan_run``: the carried optimizer (``steps.carry_optimizer``), the pre-pass
    (old log-probs under the frozen starting weights, reference log-probs), the off-policy
    figures and gate, the LR for the snapshot's lag, the step plan; then
    ``steps.prepare_workdir``: the run's work directory;
 5. ``steps.restore``: the resumable state when resuming (hash-verified; never a silent fresh start);
 6. ``steps.step_loop``: length-bucketed micro-batches (``update.train_step``), losses from
    losses.py, metrics per step;
 7. ``publish.checkpoint_and_publish``: write the run's own checkpoint dir (``latest`` last),
    append the metrics rows, publish the checkpoints row naming it (the commit publishes the
    version; a racing run of the same checkpoint id that published first wins, this one's
    files are deleted), emit OpenLineage COMPLETE (FAIL on any error).

The resident trainer (``pipeline train --follow``, pipeline.train.follow) runs
steps 1, 2, 4, 6 and 7 once per version around one engine built once.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from pipeline.config import config_dict
from pipeline.lake.ref import as_lake
from pipeline.train.config import TrainConfig
from pipeline.train.freshness import check_freshness
from pipeline.train.identity import identify, run_identity
from pipeline.train.publish import JOB_NAME, CrashPoint, checkpoint_and_publish, lineage_run
from pipeline.train.records import TrainResult
from pipeline.train.steps import build_engine, carry_optimizer, plan_run, prepare_data, prepare_workdir, restore, step_loop
from pipeline.train.update import kl_reference_spec

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake

__all__ = ["TrainConfig", "TrainResult", "train_snapshot", "run_identity", "check_freshness", "kl_reference_spec",
           "JOB_NAME"]


# -- public entry ------------------------------------------------------------------


def train_snapshot(lake: Lake | str | os.PathLike[str], snapshot_id: str, cfg: TrainConfig | None = None, *,
                   from_checkpoint: str | int | None = None, resume: bool = False, nproc: int = 1, force: bool = False,
                   progress: bool | None = None, crash_at: CrashPoint | None = None) -> TrainResult:
    """Train on ``snapshot_id`` starting from ``from_checkpoint`` (a checkpoint
    id, policy version, or HF dir; default: the newest published policy) and
    publish the result as the next policy version.

    The run holds the line's lease (pipeline.train.hold): it waits for another
    training run, and is refused while the resident trainer runs.
    ``nproc`` > 1 launches that many processes with torchrun (gloo on CPU) and
    waits for them. ``force`` trains on a snapshot another published
    checkpoint already consumed. ``crash_at`` is for the failure drills only
    (``"publish"``: die with the checkpoint files half written).
    """
    from pipeline.train.hold import hold_line

    lake = as_lake(lake)
    cfg = cfg or TrainConfig()
    with hold_line(lake, "batch", snapshot_id):        # trainers on one line run one at a time
        if nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return _launch(lake, snapshot_id, cfg, from_checkpoint=from_checkpoint, resume=resume, nproc=nproc,
                           force=force, progress=progress, crash_at=crash_at)
        return _train(lake, snapshot_id, cfg, from_checkpoint=from_checkpoint, resume=resume, force=force,
                      progress=progress, crash_at=crash_at)


def _launch(lake: Lake, snapshot_id: str, cfg: TrainConfig, *, from_checkpoint: str | int | None, resume: bool, nproc: int, force: bool,
            progress: bool | None, crash_at: CrashPoint | None = None) -> TrainResult:
    """N processes via torchrun running pipeline.train.worker; rank 0 writes the result."""
    from pipeline.train.launch import launch

    data = launch({"lake": lake.uri, "snapshot_id": snapshot_id, "config": config_dict(cfg),
                   "from_checkpoint": from_checkpoint, "resume": resume, "force": force, "progress": progress,
                   "crash_at": crash_at}, nproc, failed=f"{nproc}-process training failed",
                  hint="see the worker output above; rerun with --resume to continue from the last saved step")
    return TrainResult(**data)


# -- the driver ----------------------------------------------------------------------


def _train(lake: Lake, snapshot_id: str, cfg: TrainConfig, *, from_checkpoint: str | int | None, resume: bool, force: bool,
           progress: bool | None, crash_at: CrashPoint | None) -> TrainResult:
    from pipeline.train.ds_adapter import single_process_scope

    t_start = time.perf_counter()
    with single_process_scope():
        return _train_in_env(lake, snapshot_id, cfg, from_checkpoint=from_checkpoint, resume=resume, force=force,
                             progress=progress, crash_at=crash_at, t_start=t_start)


def _train_in_env(lake: Lake, snapshot_id: str, cfg: TrainConfig, *, from_checkpoint: str | int | None, resume: bool, force: bool,
                  progress: bool | None, crash_at: CrashPoint | None, t_start: float) -> TrainResult:
    import torch

    torch.set_num_threads(cfg.threads)
    run = identify(lake, snapshot_id, cfg, from_checkpoint=from_checkpoint, resume=resume, force=force)
    if isinstance(run, TrainResult):
        return run                                          # this very run already published: a no-op
    with lineage_run(run):
        data = prepare_data(run)
        strategy = build_engine(cfg, data.lm)
        plan = plan_run(run, strategy, data.members,
                        optimizer_from=carry_optimizer(strategy, cfg, lake, run.parent, run.world_size)
                        if cfg.carry_optimizer else None, train_lag=data.freshness["train_lag_max"])
        prepare_workdir(run, resume)       # after the off-policy gate: a refused snapshot leaves no work directory
        strategy.barrier()                 # rank 0 made (or cleared) it before any rank writes there
        state = restore(run, strategy, resume)
        step_loop(run, strategy, data.members, plan, state, progress)
        result = checkpoint_and_publish(run, strategy, data, plan, state, crash_at=crash_at, t_start=t_start)
        strategy.barrier()
        return strategy.broadcast_object(result)


