"""``train_snapshot``: train the policy on exactly one snapshot, publish the next version.

    pipeline train --batch-snapshot SNAPSHOT_ID                      # one process, CPU or one GPU
    pipeline train --batch-snapshot SNAPSHOT_ID --nproc 2            # torchrun, gloo on CPU / nccl on GPUs
    pipeline train --batch-snapshot SNAPSHOT_ID --resume             # continue a killed run
    deepspeed --num_gpus 2 -m pipeline.train.worker JOB.json        # any launcher: see pipeline/train/worker.py

The driver (``_train_in_env``) is a short list of named steps, one function each:
 1. ``_identify``: the run (snapshot + parent + config + world size -> checkpoint id);
    a snapshot already consumed by a published checkpoint is refused (or, for
    the same run, the published result is returned: a no-op);
 2. ``_prepare_data``: verify and load the snapshot, load the parent policy, assert it
    is trainable (data.check_members); ``_prepare_workdir``: the run's work directory;
 3. ``_build_engine``: wrap the policy in DeepSpeed (ds_adapter);
 4. ``_plan``: pre-pass: old log-probs (frozen starting weights) and reference log-probs,
    the step plan;
 5. ``_restore``: the resumable state when resuming (hash-verified; never a silent fresh start);
 6. ``_step_loop``: length-bucketed micro-batches (``_train_step``), losses from losses.py,
    metrics per step;
 7. ``_checkpoint_and_publish``: write the checkpoint dir (``latest`` last), append the
    metrics rows, publish the checkpoints row (the commit publishes the version), emit
    OpenLineage COMPLETE (FAIL on any error).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from pipeline.config import config_dict, config_hash
from pipeline.errors import ConflictError, NotFoundError, PipelineError
from pipeline.lake.ref import as_lake
from pipeline.train.config import TrainConfig

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.policy_store import PolicyRef
    from pipeline.train.data import Members
    from pipeline.train.ds_adapter import DeepSpeedStrategy
    from pipeline.train.live import LiveMetrics
    from pipeline.train.losses import Norm
    from pipeline.train.packing import Step

__all__ = ["TrainConfig", "TrainResult", "train_snapshot", "run_identity"]

JOB_NAME = "pipeline.train"


@dataclass(frozen=True)
class TrainResult:
    checkpoint_id: str
    policy_version: int
    parent_checkpoint_id: str | None
    snapshot_id: str
    global_step: int
    samples_seen: int
    metrics: dict[str, Any]                 # summary over the run's steps
    weight_sha256: dict[str, str]           # hf/ weight files -> sha256
    path: str                               # local checkpoint directory
    world_size: int = 1
    resumed_from_step: int | None = None
    already_published: bool = False
    seconds: float = 0.0
    lineage_run_id: str | None = None
    worker_exit_codes: list[int] | None = None   # --nproc N: the launcher's exit code when it was not 0

    @property
    def hf_dir(self) -> Path:
        """The exported policy (what rollout engines load)."""
        return Path(self.path) / "hf"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- 1. identity ---------------------------------------------------------------------


def _consumers(lake: Lake, snapshot_id: str) -> list[dict[str, Any]]:
    if not lake.exists("checkpoints"):
        return []
    rows = lake.read("checkpoints", columns=["checkpoint_id", "snapshot_ids", "policy_version",
                                             "parent_checkpoint_id"]).to_pylist()
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


def _published_result(lake: Lake, checkpoint_id: str, snapshot_id: str) -> TrainResult:
    from pipeline.policy_store import resolve_policy
    from pipeline.train.checkpoint import weight_hashes

    ref = resolve_policy(lake, checkpoint_id)
    row = lake.read("checkpoints").to_pylist()
    row = next(r for r in row if r["checkpoint_id"] == checkpoint_id)
    return TrainResult(checkpoint_id, ref.policy_version, row["parent_checkpoint_id"], snapshot_id,
                       int(row["global_step"]), int(row["samples_seen"]), json.loads(row["metrics_json"] or "{}"),
                       weight_hashes(ref.file_sha256), str(ref.path), int(row["world_size"]),
                       already_published=True)


# -- public entry ------------------------------------------------------------------


def train_snapshot(lake: Lake | str | os.PathLike[str], snapshot_id: str, cfg: TrainConfig | None = None, *,
                   from_checkpoint: str | int | None = None, resume: bool = False, nproc: int = 1, force: bool = False,
                   progress: bool | None = None, crash_at: str | None = None) -> TrainResult:
    """Train on ``snapshot_id`` starting from ``from_checkpoint`` (a checkpoint
    id, policy version, or HF dir; default: the newest published policy) and
    publish the result as the next policy version.

    ``nproc`` > 1 launches that many processes with torchrun (gloo on CPU) and
    waits for them. ``force`` trains on a snapshot another published
    checkpoint already consumed. ``crash_at`` is for the failure drills only
    (``"publish"``: die with the checkpoint files half written).
    """
    lake = as_lake(lake)
    cfg = cfg or TrainConfig()
    if nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return _launch(lake, snapshot_id, cfg, from_checkpoint=from_checkpoint, resume=resume, nproc=nproc,
                       force=force, progress=progress, crash_at=crash_at)
    return _train(lake, snapshot_id, cfg, from_checkpoint=from_checkpoint, resume=resume, force=force,
                  progress=progress, crash_at=crash_at)


def _launch(lake: Lake, snapshot_id: str, cfg: TrainConfig, *, from_checkpoint: str | int | None, resume: bool, nproc: int, force: bool,
            progress: bool | None, crash_at: str | None = None) -> TrainResult:
    """N processes via torchrun running pipeline.train.worker; rank 0 writes the result."""
    import socket

    with tempfile.TemporaryDirectory(prefix="pipeline-train-") as tmp:
        spec = Path(tmp) / "job.json"
        out = Path(tmp) / "result.json"
        spec.write_text(json.dumps({"lake": lake.uri, "snapshot_id": snapshot_id, "config": config_dict(cfg),
                                    "from_checkpoint": from_checkpoint, "resume": resume, "force": force,
                                    "progress": progress, "result": str(out), "crash_at": crash_at}))
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "pipeline.train.worker", str(spec)]
        proc = subprocess.run(cmd, env=env)
        if out.is_file():
            data = json.loads(out.read_text())
            if "error" in data:
                raise PipelineError(data["error"], hint=data.get("hint"))
            if proc.returncode != 0:
                # published and verified by rank 0, yet a process died afterwards (e.g. SIGABRT while native
                # runtimes shut down): the caller must hear about it, not get a silent success
                data["worker_exit_codes"] = [proc.returncode]
            return TrainResult(**data)
        raise PipelineError(f"{nproc}-process training failed (exit code {proc.returncode})",
                            hint="see the worker output above; rerun with --resume to continue from the last saved step")


# -- the driver ----------------------------------------------------------------------


def _train(lake: Lake, snapshot_id: str, cfg: TrainConfig, *, from_checkpoint: str | int | None, resume: bool, force: bool,
           progress: bool | None, crash_at: str | None) -> TrainResult:
    from pipeline.train.ds_adapter import single_process_env

    t_start = time.perf_counter()
    added_env = single_process_env()
    try:
        return _train_in_env(lake, snapshot_id, cfg, from_checkpoint=from_checkpoint, resume=resume, force=force,
                             progress=progress, crash_at=crash_at, t_start=t_start)
    finally:
        for k in added_env:   # the process group stays up; the fake launcher env does not
            os.environ.pop(k, None)


def _train_in_env(lake: Lake, snapshot_id: str, cfg: TrainConfig, *, from_checkpoint: str | int | None, resume: bool, force: bool,
                  progress: bool | None, crash_at: str | None, t_start: float) -> TrainResult:
    import torch

    from pipeline import lineage

    torch.set_num_threads(cfg.threads)
    run = _identify(lake, snapshot_id, cfg, from_checkpoint=from_checkpoint, resume=resume, force=force)
    if isinstance(run, TrainResult):
        return run                                          # this very run already published: a no-op
    if run.rank == 0:
        lineage.emit_run_event(lake, event_type="START", run_id=run.lineage_run_id, job_name=JOB_NAME,
                               inputs=run.inputs, outputs=[lineage.checkpoint(lake, run.checkpoint_id)], **run.ol)
    try:
        data = _prepare_data(run)
        _prepare_workdir(run, resume)
        strategy = _build_engine(run, data.lm)
        plan = _plan(run, strategy, data.members)
        state = _restore(run, strategy, resume)
        _step_loop(run, strategy, data.members, plan, state, progress)
        result = _checkpoint_and_publish(run, strategy, data, plan, state, crash_at=crash_at, t_start=t_start)
        strategy.barrier()
        return strategy.broadcast_object(result)
    except BaseException as exc:
        if run.rank == 0:
            _close_trackers(run.live)
            try:
                lineage.emit_run_event(lake, event_type="FAIL", run_id=run.lineage_run_id, job_name=JOB_NAME,
                                       inputs=run.inputs, outputs=[lineage.checkpoint(lake, run.checkpoint_id)],
                                       error=f"{type(exc).__name__}: {exc}", **run.ol)
            except Exception:  # pragma: no cover - never mask the real error
                pass
        raise


@dataclass
class _Run:
    """One training run: who it is, where its files go, its lineage (step 1)."""

    lake: Lake
    snapshot_id: str
    cfg: TrainConfig
    world_size: int
    rank: int
    parent: PolicyRef
    run_key: str
    checkpoint_id: str
    generation: int
    work: Path                      # resumable state of the interrupted run
    final: Path                     # the published checkpoint directory
    lineage_run_id: str
    inputs: list[Any]               # OpenLineage input datasets
    ol: dict[str, Any]              # the other OpenLineage run-event arguments
    live: LiveMetrics | None = None  # rank 0, once the step loop starts


@dataclass
class _Data:
    """The verified snapshot and the parent model (step 2)."""

    members: Members
    lm: Any                         # the parent's transformers model
    lineage_cfg: dict[str, Any]     # tokenizer / template revisions recorded with the checkpoint
    freshness: dict[str, Any]       # check_freshness figures + consumed_at, snapshot_wait_ms


@dataclass
class _Plan:
    """What the pre-pass resolved: the loss, the step plan, the length normaliser (step 4)."""

    loss_kind: str
    optimizer_from: str | None
    steps: list[Step]
    norm_len: float


@dataclass
class _State:
    """Progress through the steps; restored on resume (step 5), advanced by the loop (step 6)."""

    start: int = 0
    samples_seen: int = 0
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    resumed_from: int | None = None


def _identify(lake: Lake, snapshot_id: str, cfg: TrainConfig, *, from_checkpoint: str | int | None, resume: bool,
              force: bool) -> _Run | TrainResult:
    """Step 1: the run's identity; the published result when this very run already
    published, ConflictError when another run consumed the snapshot."""
    from pipeline import lineage
    from pipeline.policy_store import local_checkpoint_dir, resolve_policy

    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    parent = resolve_policy(lake, from_checkpoint)          # hash-verified unless a plain directory
    consumers = _consumers(lake, snapshot_id)
    generation = len(consumers) if force else 0
    run_key, checkpoint_id = run_identity(snapshot_id, parent.checkpoint_id, cfg, world_size, generation)
    if consumers and not force:
        if any(c["checkpoint_id"] == checkpoint_id for c in consumers):
            # this very run already published (also when the parent was a plain directory,
            # which is recorded as parent None): a no-op
            return _published_result(lake, checkpoint_id, snapshot_id)
        for c in consumers:
            # the same run (same snapshot, parent, config, world size) already published: a no-op,
            # even though "the newest policy" is now that run's own output
            key, cid = run_identity(snapshot_id, c["parent_checkpoint_id"] or "", cfg, world_size)
            if c["checkpoint_id"] == cid:
                if rank == 0:   # killed after the publishing commit, before the cleanup
                    shutil.rmtree(local_checkpoint_dir(lake, f"_runs/{key[:24]}"), ignore_errors=True)
                return _published_result(lake, cid, snapshot_id)
        c = consumers[0]
        raise ConflictError(f"snapshot {snapshot_id} was already consumed by checkpoint {c['checkpoint_id']} "
                            f"(policy version {c['policy_version']})",
                            hint="a snapshot trains once; pass --force to train on it again")
    work = local_checkpoint_dir(lake, f"_runs/{run_key[:24]}")
    final = local_checkpoint_dir(lake, checkpoint_id)
    if resume and not (work / "run.json").is_file():
        raise NotFoundError(f"nothing to resume: no interrupted run of snapshot {snapshot_id} from "
                            f"{parent.checkpoint_id} with this config (looked in {work})",
                            hint="run without --resume to start training; a different --config, --set, "
                                 "--from-checkpoint or --nproc is a different run")
    lineage_run_id = lineage.new_run_id()
    inputs = [lineage.snapshot(lake, snapshot_id), lineage.checkpoint(lake, parent.checkpoint_id, parent.policy_version)]
    ol: dict[str, Any] = dict(job_type="TRAIN", engine="deepspeed", config=config_dict(cfg) | {"world_size": world_size})
    return _Run(lake, snapshot_id, cfg, world_size, rank, parent, run_key, checkpoint_id, generation, work, final,
                lineage_run_id, inputs, ol)


def _prepare_data(run: _Run) -> _Data:
    """Step 2: the snapshot, verified, the parent model, and the pre-training assertions."""
    from pipeline.policy_store import policy_train_config, tokenizer_rev
    from pipeline.train.data import check_comparable, check_members, load_members, receipt_counts
    from pipeline.train.ds_adapter import ds_config
    from pipeline.train.model import load_causal_lm

    lake, snapshot_id, cfg, parent = run.lake, run.snapshot_id, run.cfg, run.parent
    members, _ = load_members(lake, snapshot_id)
    parent_cfg = policy_train_config(lake, parent)
    parent_tok = parent_cfg.get("tokenizer_rev") or tokenizer_rev(parent.hf_dir)
    revs = check_comparable(lake, snapshot_id, policy_tokenizer=parent_tok,
                            policy_templates=parent_cfg.get("prompt_template_revs"),
                            policy_name=f"v{parent.policy_version} ({parent.checkpoint_id})")
    lineage_cfg = {"tokenizer_rev": parent_tok, "prompt_template_revs": sorted(
        set(parent_cfg.get("prompt_template_revs") or []) | revs["prompt_template_rev"])}
    consumed_at = datetime.now(timezone.utc)
    freshness = check_freshness(members, parent.policy_version, cfg.max_train_lag, snapshot_id)
    freshness["consumed_at"] = consumed_at.isoformat()
    freshness["snapshot_wait_ms"] = _snapshot_wait_ms(lake, snapshot_id, consumed_at)
    lm = load_causal_lm(parent.hf_dir, activation_checkpointing=cfg.activation_checkpointing,
                        ds_config=ds_config(zero_stage=cfg.zero_stage, precision=cfg.precision,
                                            offload=cfg.offload, max_grad_norm=cfg.max_grad_norm))
    check_members(members, vocab_size=int(lm.config.vocab_size),
                  max_positions=getattr(lm.config, "max_position_embeddings", None),
                  valid_counts=receipt_counts(lake, snapshot_id))
    return _Data(members, lm, lineage_cfg, freshness)


def _prepare_workdir(run: _Run, resume: bool) -> None:
    """Rank 0: a fresh work directory (unless resuming) holding the run's identity."""
    from pipeline.train import checkpoint as ck

    if run.rank != 0:
        return
    work = run.work
    if not resume and work.exists():
        print(f"note: discarding the state of an earlier interrupted run in {work} "
              "(pass --resume to continue it instead)", file=sys.stderr)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "run.json").exists():
        ck.atomic_write(work / "run.json", json.dumps({
            "snapshot_id": run.snapshot_id, "parent_checkpoint_id": run.parent.checkpoint_id,
            "checkpoint_id": run.checkpoint_id, "config": config_dict(run.cfg), "world_size": run.world_size,
            "generation": run.generation}, sort_keys=True, indent=1))


def _build_engine(run: _Run, lm: Any) -> DeepSpeedStrategy:
    """Step 3: seed everything, wrap the model in DeepSpeed."""
    from pipeline.train import checkpoint as ck
    from pipeline.train.ds_adapter import DeepSpeedStrategy
    from pipeline.train.model import PolicyLogprobs

    cfg = run.cfg
    ck.seed_everything(cfg.seed)
    policy = PolicyLogprobs(lm, chunk=cfg.logprob_chunk, vocab_chunk=cfg.vocab_chunk)
    strategy = DeepSpeedStrategy(policy, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                                 zero_stage=cfg.zero_stage, precision=cfg.precision, offload=cfg.offload,
                                 max_grad_norm=cfg.max_grad_norm)
    strategy.barrier()
    return strategy


def _plan(run: _Run, strategy: DeepSpeedStrategy, members: Members) -> _Plan:
    """Step 4: the loss, the carried optimizer, the pre-pass with the frozen starting weights, the step plan."""
    from pipeline.train.packing import plan_steps

    cfg = run.cfg
    loss_kind = cfg.policy_loss
    if loss_kind == "auto":
        loss_kind = "reinforce" if int(members.group_size.max()) == 1 else "ppo"
    optimizer_from = (_carry_optimizer(strategy, cfg, run.lake, run.parent, run.world_size)
                      if cfg.carry_optimizer else None)
    _prepass(strategy, members, cfg, run.lake, run.parent)
    steps = plan_steps(members.lengths, budget_tokens=cfg.micro_batch_tokens, grad_accum=cfg.grad_accum,
                       epochs=cfg.epochs, seed=cfg.seed, shuffle=cfg.shuffle, max_steps=cfg.max_steps)
    norm_len = float(cfg.norm_len or max(len(r) for r in members.response))
    return _Plan(loss_kind, optimizer_from, steps, norm_len)


def _restore(run: _Run, strategy: DeepSpeedStrategy, resume: bool) -> _State:
    """Step 5: the resumable state when resuming (hash-verified; never a silent fresh start)."""
    from pipeline.train import checkpoint as ck

    if not resume:
        return _State()
    state = ck.load_state(strategy, run.work)
    if state is None:
        if run.rank == 0:
            print(f"note: --resume found no saved step in {run.work} (save_every={run.cfg.save_every}); training "
                  f"restarts from step 0, which is deterministic and ends in the same weights. "
                  f"Set --set save_every=N to resume mid-run.", file=sys.stderr)
        return _State(resumed_from=0)
    start = int(state["global_step"])
    if state.get("checkpoint_id") != run.checkpoint_id:
        raise ConflictError(f"resumable state in {run.work} belongs to {state.get('checkpoint_id')}")
    return _State(start, int(state["samples_seen"]), list(state["metrics"]), start)


def _step_loop(run: _Run, strategy: DeepSpeedStrategy, members: Members, plan: _Plan, state: _State,
               progress: bool | None) -> None:
    """Step 6: train from ``state.start`` (rank 0 appends the step rows as it goes: pipeline.train.live)."""
    from pipeline.lake.delta import pause_point
    from pipeline.train import checkpoint as ck

    steps = plan.steps
    run.live = _live_metrics(run.lake, run.cfg, run.checkpoint_id) if run.rank == 0 else None
    bar = None
    show = (progress if progress is not None else sys.stderr.isatty()) and run.rank == 0
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(steps), initial=state.start, desc=f"train {run.snapshot_id[:12]}", unit="step")
    strategy.train()
    for step in steps[state.start:]:
        row = _train_step(strategy, members, step, run.cfg, plan.loss_kind, plan.norm_len)
        state.samples_seen += row["sequences"]
        row.update(checkpoint_id=run.checkpoint_id, snapshot_id=run.snapshot_id, run_id=run.lineage_run_id)
        state.rows.append(row)
        if bar is not None:
            bar.set_postfix(loss=f"{row['loss']:.4f}", reward=f"{row['reward_mean']:.3f}",
                            kl_old=f"{row['approx_kl']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1)
        done = step.index + 1
        if run.live is not None:
            run.live.step_done(state.rows)
        pause_point(f"train:step:{done}")
        if run.cfg.save_every and done % run.cfg.save_every == 0 and done < len(steps):
            ck.save_state(strategy, run.work, f"step-{done:08d}", _client_state(
                run.checkpoint_id, run.snapshot_id, done, state.samples_seen, step.epoch, state.rows))
    if bar is not None:
        bar.close()


def _checkpoint_and_publish(run: _Run, strategy: DeepSpeedStrategy, data: _Data, plan: _Plan, state: _State, *,
                            crash_at: str | None, t_start: float) -> TrainResult | None:
    """Step 7: the checkpoint dir (``latest`` last); rank 0 publishes (metrics rows, then
    the checkpoints row), emits OpenLineage COMPLETE and removes the work directory."""
    from pipeline import lineage
    from pipeline.train import checkpoint as ck

    lake, cfg, steps = run.lake, run.cfg, plan.steps
    global_step = len(steps)
    client_state = _client_state(run.checkpoint_id, run.snapshot_id, global_step, state.samples_seen,
                                 steps[-1].epoch if steps else 0, state.rows)
    train_config = config_dict(cfg) | {"policy_loss_resolved": plan.loss_kind, "norm_len_resolved": plan.norm_len,
                                       "optimizer_from": plan.optimizer_from}
    if crash_at == "publish":
        _crash_while_publishing(strategy, run.final, client_state, train_config, data.lm, run.parent)
    ck.write_final(strategy, run.final, client_state=client_state, train_config=train_config, lm=data.lm,
                   parent_hf=run.parent.hf_dir)
    if run.rank != 0:
        return None
    summary = _summary(state.rows) | data.freshness
    result = _publish(lake, checkpoint_id=run.checkpoint_id, parent=run.parent, snapshot_id=run.snapshot_id, cfg=cfg,
                      world_size=run.world_size, global_step=global_step, samples_seen=state.samples_seen,
                      summary=summary, rows=state.rows, resumed_from=state.resumed_from, t_start=t_start,
                      lineage_run_id=run.lineage_run_id, final=run.final, live=run.live,
                      extra_config=data.lineage_cfg)
    lineage.emit_run_event(lake, event_type="COMPLETE", run_id=run.lineage_run_id, job_name=JOB_NAME,
                           inputs=run.inputs, outputs=lineage.train_outputs(lake, run.checkpoint_id,
                                                                            result.policy_version), **run.ol)
    shutil.rmtree(run.work, ignore_errors=True)
    return result


def _client_state(checkpoint_id: str, snapshot_id: str, global_step: int, samples_seen: int, epoch: int,
                  rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The data cursor (DeepSpeed saves none): the plan is a pure function of
    the snapshot, config and seed, so the step index is the whole cursor."""
    return {"checkpoint_id": checkpoint_id, "snapshot_id": snapshot_id, "global_step": global_step,
            "samples_seen": samples_seen, "epoch": epoch, "metrics": rows}


def _carry_optimizer(strategy: DeepSpeedStrategy, cfg: TrainConfig, lake: Lake, parent: PolicyRef, world_size: int) -> str | None:
    """Load the parent's DeepSpeed state (weights + AdamW moments; not its LR
    schedule) when the parent is a checkpoint of this trainer with a compatible
    layout. The parent's files were hash-verified by resolve_policy. Returns the
    parent id when carried, None for a fresh optimizer (the initial policy, a
    plain HF directory, or a different zero_stage/precision/offload/world size)."""
    from pipeline.train.checkpoint import FINAL_TAG, LATEST

    root = parent.path
    if parent.policy_version < 0 or not (root / LATEST).is_file() or not (root / "ds" / FINAL_TAG).is_dir():
        return None
    pcfg = json.loads((root / "train_config.json").read_text())
    prow = [r for r in lake.read("checkpoints", columns=["checkpoint_id", "world_size"]).to_pylist()
            if r["checkpoint_id"] == parent.checkpoint_id]
    same = (pcfg.get("zero_stage"), pcfg.get("precision"), pcfg.get("offload")) == (
        cfg.zero_stage, cfg.precision, cfg.offload) and prow and int(prow[0]["world_size"]) == world_size
    if not same:
        if strategy.is_rank_0():
            print(f"note: fresh optimizer: parent {parent.checkpoint_id} was trained with another "
                  "zero_stage/precision/offload/world size", file=sys.stderr)
        return None
    strategy.load(root / "ds", FINAL_TAG, scheduler=False)
    strategy.reset_lr()
    return parent.checkpoint_id


def kl_reference_spec(kl_reference: str, parent: PolicyRef) -> str:
    """What ``kl_reference`` names for this update: ``"parent"`` (reuse the starting
    weights) or a policy version / checkpoint id to load. ``initial`` is policy
    version 0, the same frozen anchor at every iteration; it is the parent itself
    when the parent is version 0 or an unpublished directory (version -1)."""
    if kl_reference == "initial":
        return "parent" if parent.policy_version <= 0 else "0"
    if kl_reference in (parent.checkpoint_id, str(parent.policy_version)):
        return "parent"
    return kl_reference


def _snapshot_wait_ms(lake: Lake, snapshot_id: str, consumed_at: datetime) -> int | None:
    """How long the snapshot waited between its publication and its use (ms);
    with the members' ``queue_wait_ms`` (finish -> landing) this measures the
    queue to the point of use. None when the snapshots table has no row for it."""
    import pyarrow.dataset as ds

    if not lake.exists("snapshots"):
        return None
    rows = lake.read("snapshots", columns=["created_at"], filter=ds.field("snapshot_id") == snapshot_id).to_pylist()
    if not rows:
        return None
    return max(0, int((consumed_at - rows[0]["created_at"]).total_seconds() * 1000))


def check_freshness(members: Members, parent_version: int, max_train_lag: int | None, snapshot_id: str) -> dict[str, Any]:
    """Freshness at use: the lag between the snapshot's data and the policy this
    update starts from, ``parent_version - oldest sampled token version`` per
    member (the version that started it when the row has no per-token versions).
    Raises StaleSnapshotError beyond ``max_train_lag``; returns the figures
    recorded with the checkpoint (``train_lag_max``, ``train_lag_mean``)."""
    import numpy as np

    from pipeline.errors import StaleSnapshotError

    if parent_version < 0 or len(members) == 0:      # an unpublished directory has no version to compare
        return {"train_lag_max": None, "train_lag_mean": None, "parent_version": parent_version}
    oldest = []
    started = members.policy_version
    for i, tv in enumerate(members.token_versions):
        sampled = tv[tv >= 0] if tv is not None else np.zeros(0)
        oldest.append(int(sampled.min()) if sampled.size else
                      (int(started[i]) if started is not None else None))
    lags = np.array([parent_version - o if o is not None else np.nan for o in oldest], np.float64)
    known = lags[~np.isnan(lags)]
    worst = int(known.max()) if known.size else None
    if max_train_lag is not None and worst is not None and worst > max_train_lag:
        i = int(np.nanargmax(lags))
        raise StaleSnapshotError(
            f"snapshot {snapshot_id} is stale at use: trajectory {members.trajectory_id[i]} was sampled by policy "
            f"version {oldest[i]}, {worst} versions behind the policy it would update (version {parent_version}; "
            f"max_train_lag={max_train_lag})",
            hint="admit fresher data (pipeline admit) and train on that snapshot, or raise --set max_train_lag=N "
                 "(null: no limit) if this off-policy lag is intended")
    return {"train_lag_max": worst, "train_lag_mean": float(known.mean()) if known.size else None,
            "parent_version": parent_version}


def _prepass(strategy: DeepSpeedStrategy, members: Members, cfg: TrainConfig, lake: Lake, parent: PolicyRef) -> None:
    """Old log-probs (recompute mode) and reference log-probs (kl_coef > 0) of
    every member under frozen weights, once, before the first update. Every
    rank computes all members, in the same micro-batches: identical on any
    world size and on resume."""
    import numpy as np
    import torch

    from pipeline.train.packing import pack_by_length

    need_old = cfg.old_logprobs == "recompute"
    need_ref = cfg.kl_coef > 0
    members.old_logprobs = [None] * len(members)
    members.ref_logprobs = [None] * len(members)
    if not (need_old or need_ref):
        return
    batches = pack_by_length(members.lengths, cfg.micro_batch_tokens)

    def run(forward, target: list) -> None:
        from pipeline.train.data import collate

        with torch.no_grad():
            for idx in batches:
                b = collate(members, idx)
                lp, _ = forward(b["input_ids"].to(strategy.device), b["rows"].to(strategy.device),
                                b["targets"].to(strategy.device))
                flat = torch.zeros(b["shape"][0] * b["shape"][1], dtype=torch.float32)
                flat[b["cols"]] = lp.float().cpu()
                grid = flat.view(*b["shape"]).numpy()
                for k, i in enumerate(idx):
                    target[i] = grid[k, :len(members.response[i])].astype(np.float32).copy()

    strategy.eval()
    if need_old:
        run(strategy.module, members.old_logprobs)
    if need_ref:
        spec = kl_reference_spec(cfg.kl_reference, parent)
        if spec == "parent" and need_old:
            members.ref_logprobs = members.old_logprobs
        elif spec == "parent":
            run(strategy.module, members.ref_logprobs)
        else:
            from pipeline.policy_store import resolve_policy
            from pipeline.train.model import PolicyLogprobs, load_causal_lm

            ref = resolve_policy(lake, spec)
            # the same ZeRO stage as the policy, inference only: under ZeRO-3 partitioned, not a second full copy
            ref_lm = load_causal_lm(ref.hf_dir, ds_config=strategy.inference_config)
            ref_engine = strategy.inference_engine(PolicyLogprobs(ref_lm, chunk=cfg.logprob_chunk,
                                                                  vocab_chunk=cfg.vocab_chunk))
            run(ref_engine, members.ref_logprobs)
            strategy.release_inference_engine(ref_engine)
            del ref_engine, ref_lm
    strategy.train()


class _StepSums:
    """Sums over this rank's micro-batches of one step, by name; all-reduced
    across ranks as one float64 tensor whose slots follow ``NAMES``."""

    NAMES = ("loss", "pg_loss", "kl",                 # the micro-batches' losses, summed
             "entropy_tok", "clip_high_tok", "clip_low_tok", "approx_kl_tok", "mismatch_tok",  # x tokens
             "tokens")

    def __init__(self) -> None:
        import torch

        self.values = torch.zeros(len(self.NAMES), dtype=torch.float64)

    def add(self, **named: float) -> None:
        import torch

        self.values += torch.tensor([named[n] for n in self.NAMES], dtype=torch.float64)

    def all_reduce(self, strategy: DeepSpeedStrategy) -> dict[str, float]:
        return dict(zip(self.NAMES, (float(v) for v in strategy.all_reduce_sum(self.values))))


def _train_step(strategy: DeepSpeedStrategy, members: Members, step: Step, cfg: TrainConfig, loss_kind: str, norm_len: float) -> dict[str, Any]:
    """Forward/backward over this rank's micro-batches of ``step``, then one optimizer step."""
    from pipeline.train import losses as L

    t0 = time.perf_counter()
    all_idx = [i for mb in step.micro_batches for i in mb]
    norm = L.Norm(num_tokens=float(members.loss_tokens(all_idx)), num_seqs=float(len(all_idx)), norm_len=norm_len)
    sums = _StepSums()
    quant = {"ratio_p05": 1.0, "ratio_p50": 1.0, "ratio_p95": 1.0}
    for mb in step.for_rank(strategy.rank, strategy.world_size):
        if not mb:
            _zero_weight_pass(strategy)
            continue
        met = _micro_batch(strategy, members, mb, cfg, loss_kind, norm, sums)
        if strategy.rank == 0 and mb == step.for_rank(0, strategy.world_size)[0]:
            quant = {k: met[k] for k in quant}
    out = strategy.optimizer_step()
    return _step_row(members, step, cfg, all_idx, sums.all_reduce(strategy), quant, out, time.perf_counter() - t0)


def _zero_weight_pass(strategy: DeepSpeedStrategy) -> None:
    """This rank has fewer micro-batches than another: a zero-weight pass keeps
    the per-backward ZeRO reductions in lockstep."""
    import torch

    dev = strategy.device
    lp, ent = strategy.forward(torch.zeros(1, 2, dtype=torch.long, device=dev),
                               torch.zeros(1, dtype=torch.long, device=dev),
                               torch.zeros(1, dtype=torch.long, device=dev))
    strategy.backward(0.0 * (lp.sum() + ent.sum()))


def _micro_batch(strategy: DeepSpeedStrategy, members: Members, mb: Sequence[int], cfg: TrainConfig, loss_kind: str,
                 norm: Norm, sums: _StepSums) -> dict[str, float]:
    """Forward/backward of one micro-batch; adds its sums to ``sums``, returns the loss's metrics."""
    import torch

    from pipeline.train import losses as L
    from pipeline.train.data import collate

    dev = strategy.device
    need = ("rollout",) + (("old",) if cfg.old_logprobs == "recompute" else ()) + (("ref",) if cfg.kl_coef > 0 else ())
    b = collate(members, mb, need=need)
    B, R = b["shape"]
    lp_flat, ent_flat = strategy.forward(b["input_ids"].to(dev), b["rows"].to(dev), b["targets"].to(dev))
    cols = b["cols"].to(dev)
    logp = torch.zeros(B * R, dtype=lp_flat.dtype, device=dev).index_copy(0, cols, lp_flat).view(B, R)  # [B, R]
    ent = torch.zeros(B * R, dtype=ent_flat.dtype, device=dev).index_copy(0, cols, ent_flat).view(B, R)  # [B, R]
    mask, adv = b["mask"].to(dev), b["advantages"].to(dev)                                            # [B, R]
    rollout = b["rollout"].to(dev)                                                                    # [B, R]
    old = b["old"].to(dev) if "old" in b else rollout                                                 # [B, R]
    is_w = None
    if cfg.old_logprobs == "recompute" and cfg.tis_cap > 0:
        is_w = L.truncated_is_weights(old, rollout, mask, cfg.tis_cap)                               # [B, R]
    pg, met = L.POLICY_LOSSES[loss_kind](logp, old, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                         ratio_level=cfg.ratio_level, agg=cfg.agg, norm=norm, is_weights=is_w)
    total = pg
    kl_val = torch.zeros(())
    if cfg.kl_coef > 0:
        kl_tok = L.kl_penalty(logp, b["ref"].to(dev), cfg.kl_kind)                                   # [B, R]
        kl_val = L.aggregate(kl_tok, mask, cfg.agg, norm)
        total = total + cfg.kl_coef * kl_val
    if cfg.entropy_coef > 0:
        total = total + L.entropy_bonus(ent, mask, coef=cfg.entropy_coef, agg=cfg.agg, norm=norm)
    # DeepSpeed averages gradients over ranks; the loss is already a share of the global step sum
    strategy.backward(total * strategy.world_size)
    with torch.no_grad():
        tok = float(mask.sum())
        mism = float(L.masked_mean(L.kl_penalty(old, rollout, "k3"), mask)) if cfg.old_logprobs == "recompute" \
            else float(L.masked_mean(L.kl_penalty(logp.detach(), rollout, "k3"), mask))
        sums.add(loss=float(total.detach()), pg_loss=float(pg.detach()), kl=float(kl_val.detach()),
                 entropy_tok=float(L.masked_mean(ent.detach(), mask)) * tok, clip_high_tok=met["clip_frac_high"] * tok,
                 clip_low_tok=met["clip_frac_low"] * tok, approx_kl_tok=met["approx_kl"] * tok,
                 mismatch_tok=mism * tok, tokens=tok)
    return met


def _step_row(members: Members, step: Step, cfg: TrainConfig, all_idx: list[int], sums: dict[str, float],
              quant: dict[str, float], out: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The metrics row of one step from the all-reduced sums (schemas/metrics.yaml)."""
    import numpy as np

    from pipeline.train.packing import padding_ratio

    tok = max(sums["tokens"], 1.0)
    real = int(members.lengths[all_idx].sum())
    lags = members.policy_lag[all_idx]
    return {
        "global_step": step.index, "epoch": step.epoch,
        "loss": sums["loss"], "pg_loss": sums["pg_loss"], "kl": sums["kl"] if cfg.kl_coef > 0 else None,
        "entropy": sums["entropy_tok"] / tok,
        "reward_mean": float(np.mean(members.reward[all_idx])), "advantage_mean": float(np.mean(members.advantage[all_idx])),
        "clip_frac_high": sums["clip_high_tok"] / tok, "clip_frac_low": sums["clip_low_tok"] / tok,
        "clip_fraction": (sums["clip_high_tok"] + sums["clip_low_tok"]) / tok,
        "approx_kl": sums["approx_kl_tok"] / tok, "mismatch_kl": sums["mismatch_tok"] / tok, **quant,
        "grad_norm": out["grad_norm"], "lr": out["lr"],
        "tokens": int(sums["tokens"]), "sequences": len(all_idx), "micro_batches": len(step.micro_batches),
        "padding_ratio": padding_ratio(members.lengths, [list(mb) for mb in step.micro_batches]),
        "tokens_per_s": real / seconds if seconds > 0 else 0.0, "step_seconds": seconds,
        "policy_lag": float(np.mean(lags)), "policy_lag_max": int(np.max(lags)),
        "created_at": datetime.now(timezone.utc).isoformat(),
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"steps": 0}
    def mean(k: str) -> float | None:
        vals = [r[k] for r in rows if r.get(k) is not None]
        return float(sum(vals) / len(vals)) if vals else None
    return {"steps": len(rows), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
            "loss_mean": mean("loss"), "reward_mean": mean("reward_mean"), "entropy_mean": mean("entropy"),
            "approx_kl_mean": mean("approx_kl"), "mismatch_kl_mean": mean("mismatch_kl"),
            "clip_fraction_mean": mean("clip_fraction"), "grad_norm_mean": mean("grad_norm"),
            "padding_ratio_mean": mean("padding_ratio"), "tokens": int(sum(r["tokens"] for r in rows)),
            "tokens_per_s_mean": mean("tokens_per_s"), "policy_lag_mean": mean("policy_lag")}


def _publish(lake: Lake, *, checkpoint_id: str, parent: PolicyRef, snapshot_id: str, cfg: TrainConfig, world_size: int,
             global_step: int, samples_seen: int, summary: dict[str, Any], rows: list[dict[str, Any]],
             resumed_from: int | None, t_start: float, lineage_run_id: str, final: Path,
             live: LiveMetrics | None = None, extra_config: dict[str, Any] | None = None) -> TrainResult:
    """Metrics rows (exactly once), then the checkpoints row: that commit publishes the version."""
    from pipeline.policy_store import hash_dir, publish_checkpoint
    from pipeline.train.checkpoint import weight_hashes

    live = live or _live_metrics(lake, cfg, checkpoint_id, with_trackers=False)
    live.flush(rows)                    # the steps not appended during the run (exactly once per step)
    _close_trackers(live)
    published = publish_checkpoint(lake, checkpoint_id=checkpoint_id, policy_version=None,
                       parent_checkpoint_id=parent.checkpoint_id if parent.policy_version >= 0 else None,
                       snapshot_ids=[snapshot_id],
                       train_config=config_dict(cfg) | {"snapshot_id": snapshot_id, "parent": parent.checkpoint_id,
                                                        "consumed_at": summary.get("consumed_at")}
                       | (extra_config or {}),
                       train_config_hash=config_hash(cfg), seed=cfg.seed, world_size=world_size,
                       global_step=global_step, samples_seen=samples_seen, metrics=summary, command="pipeline train")
    version = published["policy_version"]
    return TrainResult(checkpoint_id, version, parent.checkpoint_id, snapshot_id, global_step, samples_seen, summary,
                       weight_hashes(hash_dir(final)), str(final), world_size, resumed_from, False,
                       time.perf_counter() - t_start, lineage_run_id)


def _live_metrics(lake: Lake, cfg: TrainConfig, checkpoint_id: str, *, with_trackers: bool = True):
    from pipeline.train.live import LiveMetrics, Trackers

    trackers = (Trackers(lake, cfg, checkpoint_id=checkpoint_id, config=config_dict(cfg))
                if with_trackers and cfg.trackers else None)
    return LiveMetrics(lake, cfg, checkpoint_id=checkpoint_id, command="pipeline train",
                       config_hash=config_hash(cfg), trackers=trackers)


def _close_trackers(live: LiveMetrics | None) -> None:
    if live is not None and live.trackers is not None:
        live.trackers.close()


def _crash_while_publishing(strategy: DeepSpeedStrategy, final: Path, client_state, train_config, lm, parent: PolicyRef) -> None:
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
