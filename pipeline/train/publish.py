"""Step 7 of a training run: write the checkpoint directory, publish the version.

``checkpoint_and_publish`` writes the run's own directory
``<lake>/_checkpoints/<id>.<run tag>/`` (``latest`` last), appends the metrics
rows and then the ``checkpoints`` row naming it: that commit publishes the
policy version. A run that loses the publication of its checkpoint id to a
racing run deletes its directory and returns the winner's version
(``already_published``, ``published_by``). ``full=False`` (the resident trainer between
full checkpoints) writes the weights (``hf/``), cursor and config only: no
DeepSpeed state. Every version records its weights as an anchor or a sparse
delta against its parent (``delta_base``; pipeline.policy_store.delta) in its row's
``train_config_json["weights"]``; a delta version's directory keeps only the delta
(its full weights go to this machine's cache: ``TrainResult.hf_dir``).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal

from pipeline.config import config_dict, config_hash
from pipeline.train.records import TrainResult
from pipeline.train.update import summarize

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.policy_store import PolicyRef
    from pipeline.train.config import TrainConfig
    from pipeline.train.ds_adapter import DeepSpeedStrategy
    from pipeline.train.live import LiveMetrics
    from pipeline.train.records import Data, Plan, Run, State

JOB_NAME = "pipeline.train"
CrashPoint = Literal["publish"]   # failure drills only: die with the checkpoint files half written


def checkpoint_and_publish(run: Run, strategy: DeepSpeedStrategy, data: Data, plan: Plan, state: State, *,
                           crash_at: CrashPoint | None, t_start: float, full: bool = True,
                           extra_config: dict[str, Any] | None = None, pause_prefix: str = "",
                           exclusive: bool = False) -> TrainResult | None:
    """Step 7: the checkpoint dir (``latest`` last); rank 0 publishes (metrics rows, then
    the checkpoints row), emits OpenLineage COMPLETE and removes the work directory.
    ``exclusive`` (the resident trainer, whose in-memory state must be what it
    published): losing the publication to another run is a ConflictError."""
    from pipeline import lineage
    from pipeline.policy_store.delta import ensure_rebuilt
    from pipeline.train import checkpoint as ck

    lake, cfg, steps = run.lake, run.cfg, plan.steps
    global_step = len(steps)
    client_state = cursor_state(run.checkpoint_id, run.snapshot_id, global_step, state.samples_seen,
                                 steps[-1].epoch if steps else 0, state.rows)
    train_config = config_dict(cfg) | {"policy_loss_resolved": plan.loss_kind, "norm_len_resolved": plan.norm_len,
                                       "optimizer_from": plan.optimizer_from}
    if crash_at == "publish":
        crash_while_publishing(strategy, run.final, client_state, train_config, data.lm, run.parent)
    # the parent's weights may be a rebuilt copy this machine's cache removed while the version trained
    parent_hf = ensure_rebuilt(lake, run.parent) if run.rank == 0 else run.parent.hf_dir
    record = ck.write_final(strategy, run.final, client_state=client_state, train_config=train_config, lm=data.lm,
                            parent_hf=parent_hf, full=full, pause_prefix=pause_prefix,
                            delta_base=delta_base(lake, run.parent, cfg.anchor_every) if run.rank == 0 else None)
    if run.rank != 0:
        return None
    summary = summarize(state.rows) | data.freshness | plan.offpolicy | {"prepass_seconds": plan.prepass_seconds}
    result = publish(lake, checkpoint_id=run.checkpoint_id, parent=run.parent, snapshot_id=run.snapshot_id, cfg=cfg,
                      world_size=run.world_size, global_step=global_step, samples_seen=state.samples_seen,
                      summary=summary, rows=state.rows, resumed_from=state.resumed_from, t_start=t_start,
                      lineage_run_id=run.lineage_run_id, final=run.final, live=run.live,
                     extra_config=data.lineage_cfg | {"optimizer_from": plan.optimizer_from, "full_state": full}
                     | (extra_config or {}) | ({"weights": record} if record else {}),
                     rel=run.final_rel, once_per_snapshot=run.generation == 0)
    if result.already_published and exclusive:
        from pipeline.errors import ConflictError

        raise ConflictError(f"checkpoint {result.checkpoint_id} (policy version {result.policy_version}) was "
                            f"published by {result.published_by} while this trainer held the line; its files were "
                            "discarded", hint="run one trainer per line; restart this one to replay and continue")
    lineage.emit_run_event(lake, event_type="COMPLETE", run_id=run.lineage_run_id, job_name=JOB_NAME,
                           inputs=run.inputs, outputs=lineage.train_outputs(lake, run.checkpoint_id,
                                                                            result.policy_version), **run.ol)
    shutil.rmtree(run.work, ignore_errors=True)
    return result


def delta_base(lake: Lake, parent: PolicyRef, anchor_every: int) -> dict[str, Any]:
    """What the version's weights record is made against: the parent's id and
    record (none for a plain directory: the version is an anchor)."""
    from pipeline.policy_store import policy_train_config
    from pipeline.policy_store.delta import weights_record

    if parent.policy_version < 0:
        return {"parent_id": None, "parent_record": None, "anchor_every": anchor_every, "lake_uri": lake.uri}
    return {"parent_id": parent.checkpoint_id, "parent_record": weights_record(policy_train_config(lake, parent)),
            "anchor_every": anchor_every, "lake_uri": lake.uri}


def cursor_state(checkpoint_id: str, snapshot_id: str, global_step: int, samples_seen: int, epoch: int,
                  rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The data cursor (DeepSpeed saves none): the plan is a pure function of
    the snapshot, config and seed, so the step index is the whole cursor."""
    return {"checkpoint_id": checkpoint_id, "snapshot_id": snapshot_id, "global_step": global_step,
            "samples_seen": samples_seen, "epoch": epoch, "metrics": rows}


def publish(lake: Lake, *, checkpoint_id: str, parent: PolicyRef, snapshot_id: str, cfg: TrainConfig, world_size: int,
             global_step: int, samples_seen: int, summary: dict[str, Any], rows: list[dict[str, Any]],
             resumed_from: int | None, t_start: float, lineage_run_id: str, final: Path,
             live: LiveMetrics | None = None, extra_config: dict[str, Any] | None = None, rel: str | None = None,
             once_per_snapshot: bool = False) -> TrainResult:
    """Metrics rows (exactly once), then the checkpoints row naming ``rel`` (the run's
    directory ``final``): that commit publishes the version."""
    from pipeline.policy_store import local_dir, publish_checkpoint, row_rel
    from pipeline.policy_store.delta import rebuilt_hf
    from pipeline.train.checkpoint import weight_hashes

    live = live or live_metrics(lake, cfg, checkpoint_id, with_trackers=False)
    live.flush(rows)                    # the steps not appended during the run (exactly once per step)
    close_trackers(live)
    published = publish_checkpoint(lake, checkpoint_id=checkpoint_id, policy_version=None,
                       parent_checkpoint_id=parent.checkpoint_id if parent.policy_version >= 0 else None,
                       snapshot_ids=[snapshot_id],
                       train_config=config_dict(cfg) | {"snapshot_id": snapshot_id, "parent": parent.checkpoint_id,
                                                        "consumed_at": summary.get("consumed_at")}
                       | (extra_config or {}),
                       train_config_hash=config_hash(cfg), seed=cfg.seed, world_size=world_size,
                       global_step=global_step, samples_seen=samples_seen, metrics=summary, command="pipeline train",
                       rel=rel, once_per_snapshot=once_per_snapshot)
    version = published["policy_version"]
    lost = bool(published["already_published"])
    path = local_dir(lake, row_rel(published)) if lost else final
    weights = weight_hashes(dict(published["file_sha256"]))
    rec = (extra_config or {}).get("weights") or {}
    rebuilt = str(rebuilt_hf(lake.uri, checkpoint_id, rec)) if any(k.startswith("delta/") for k in weights) else None
    return TrainResult(checkpoint_id=checkpoint_id, policy_version=version, parent_checkpoint_id=parent.checkpoint_id,
                       snapshot_id=snapshot_id, global_step=global_step, samples_seen=samples_seen, metrics=summary,
                       weight_sha256=weights, path=str(path),
                       world_size=world_size, resumed_from_step=resumed_from, already_published=lost,
                       seconds=time.perf_counter() - t_start, lineage_run_id=lineage_run_id,
                       published_by=published["published_by"], rebuilt_hf=rebuilt)


def live_metrics(lake: Lake, cfg: TrainConfig, checkpoint_id: str, *, with_trackers: bool = True,
                 trackers: Any = None):
    """``trackers``: an open (resident) Trackers to log to instead of opening one for this checkpoint."""
    from pipeline.train.live import LiveMetrics, Trackers

    if trackers is None:
        trackers = (Trackers(lake, cfg, checkpoint_id=checkpoint_id, config=config_dict(cfg))
                    if with_trackers and cfg.trackers else None)
    return LiveMetrics(lake, cfg, checkpoint_id=checkpoint_id, command="pipeline train",
                       config_hash=config_hash(cfg), trackers=trackers)


def close_trackers(live: LiveMetrics | None) -> None:
    if live is not None and live.trackers is not None:
        live.trackers.close()


@contextmanager
def lineage_run(run: Run) -> Iterator[None]:
    """The run's OpenLineage events around the block, from rank 0: START on entry; on any exception the
    trackers are closed and FAIL is emitted (an error emitting it never masks the real one), then it re-raises.
    COMPLETE is the publication's (checkpoint_and_publish)."""
    from pipeline import lineage

    outputs = lambda: [lineage.checkpoint(run.lake, run.checkpoint_id, rel=run.final_rel or None)]  # noqa: E731
    if run.rank == 0:
        lineage.emit_run_event(run.lake, event_type="START", run_id=run.lineage_run_id, job_name=JOB_NAME,
                               inputs=run.inputs, outputs=outputs(), **run.ol)
    try:
        yield
    except BaseException as exc:
        if run.rank == 0:
            close_trackers(run.live)
            try:
                lineage.emit_run_event(run.lake, event_type="FAIL", run_id=run.lineage_run_id, job_name=JOB_NAME,
                                       inputs=run.inputs, outputs=outputs(), error=f"{type(exc).__name__}: {exc}",
                                       **run.ol)
            except Exception:  # pragma: no cover - never mask the real error
                pass
        raise


def crash_while_publishing(strategy: DeepSpeedStrategy, final: Path, client_state, train_config, lm, parent: PolicyRef) -> None:
    """Failure drill: write part of the checkpoint (weights half written) and die like a SIGKILL."""
    from pipeline.train import checkpoint as ck

    final.mkdir(parents=True, exist_ok=True)
    strategy.save(final / "ds", ck.FINAL_TAG, client_state)
    hf = final / "hf"
    ck.export_hf(lm, parent.hf_dir, hf, strategy.consolidated_state_dict(lm))
    w = hf / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(137)

