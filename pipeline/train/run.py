"""``train_snapshot``: train the policy on exactly one snapshot, publish the next version.

    pipeline train --batch-snapshot SNAPSHOT_ID                      # one process, CPU or one GPU
    pipeline train --batch-snapshot SNAPSHOT_ID --nproc 2            # torchrun, gloo on CPU / nccl on GPUs
    pipeline train --batch-snapshot SNAPSHOT_ID --resume             # continue a killed run
    deepspeed --num_gpus 2 -m pipeline.train.worker JOB.json        # any launcher: see pipeline/train/worker.py

The driver is a short list of named steps:
 1. identify the run (snapshot + parent + config + world size -> checkpoint id);
    a snapshot already consumed by a published checkpoint is refused (or, for
    the same run, the published result is returned: a no-op);
 2. verify and load the snapshot, assert it is trainable (data.check_members);
 3. load the parent policy, wrap it in DeepSpeed (ds_adapter);
 4. pre-pass: old log-probs (frozen starting weights) and reference log-probs;
 5. restore the resumable state when resuming (hash-verified; never a silent fresh start);
 6. train: length-bucketed micro-batches, losses from losses.py, metrics per step;
 7. write the checkpoint dir (``latest`` last), append the metrics rows,
    publish the checkpoints row (the commit publishes the version), emit
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
from typing import TYPE_CHECKING, Any

from pipeline.config import config_dict, config_hash
from pipeline.errors import ConflictError, NotFoundError, PipelineError
from pipeline.train.config import TrainConfig

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

    from pipeline.policy_store import PolicyRef
    from pipeline.train.data import Members
    from pipeline.train.ds_adapter import DeepSpeedStrategy
    from pipeline.train.live import LiveMetrics

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


def train_snapshot(lake: Lake, snapshot_id: str, cfg: TrainConfig | None = None, *, from_checkpoint: str | int | None = None,
                   resume: bool = False, nproc: int = 1, force: bool = False, progress: bool | None = None,
                   crash_at: str | None = None) -> TrainResult:
    """Train on ``snapshot_id`` starting from ``from_checkpoint`` (a checkpoint
    id, policy version, or HF dir; default: the newest published policy) and
    publish the result as the next policy version.

    ``nproc`` > 1 launches that many processes with torchrun (gloo on CPU) and
    waits for them. ``force`` trains on a snapshot another published
    checkpoint already consumed. ``crash_at`` is for the failure drills only
    (``"publish"``: die with the checkpoint files half written).
    """
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
    from pipeline.lake.delta import pause_point
    from pipeline.policy_store import local_checkpoint_dir, policy_train_config, resolve_policy, tokenizer_rev
    from pipeline.train import checkpoint as ck
    from pipeline.train.data import check_comparable, check_members, load_members, receipt_counts
    from pipeline.train.ds_adapter import DeepSpeedStrategy, ds_config
    from pipeline.train.model import PolicyLogprobs, load_causal_lm
    from pipeline.train.packing import plan_steps

    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(cfg.threads)

    # 1. identity
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
    if rank == 0:
        lineage.emit_run_event(lake, event_type="START", run_id=lineage_run_id, job_name=JOB_NAME, inputs=inputs,
                               outputs=[lineage.checkpoint(lake, checkpoint_id)], **ol)
    try:
        # 2. the snapshot, verified, and the pre-training assertions
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
        if rank == 0:
            if not resume and work.exists():
                print(f"note: discarding the state of an earlier interrupted run in {work} "
                      "(pass --resume to continue it instead)", file=sys.stderr)
                shutil.rmtree(work)
            work.mkdir(parents=True, exist_ok=True)
            if not (work / "run.json").exists():
                ck.atomic_write(work / "run.json", json.dumps({
                    "snapshot_id": snapshot_id, "parent_checkpoint_id": parent.checkpoint_id,
                    "checkpoint_id": checkpoint_id, "config": config_dict(cfg), "world_size": world_size,
                    "generation": generation}, sort_keys=True, indent=1))

        # 3. model + DeepSpeed
        ck.seed_everything(cfg.seed)
        policy = PolicyLogprobs(lm, chunk=cfg.logprob_chunk, vocab_chunk=cfg.vocab_chunk)
        strategy = DeepSpeedStrategy(policy, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                                     zero_stage=cfg.zero_stage, precision=cfg.precision, offload=cfg.offload,
                                     max_grad_norm=cfg.max_grad_norm)
        strategy.barrier()

        # 4. pre-pass with the frozen starting weights
        loss_kind = cfg.policy_loss
        if loss_kind == "auto":
            loss_kind = "reinforce" if int(members.group_size.max()) == 1 else "ppo"
        optimizer_from = _carry_optimizer(strategy, cfg, lake, parent, world_size) if cfg.carry_optimizer else None
        _prepass(strategy, members, cfg, lake, parent)

        steps = plan_steps(members.lengths, budget_tokens=cfg.micro_batch_tokens, grad_accum=cfg.grad_accum,
                           epochs=cfg.epochs, seed=cfg.seed, shuffle=cfg.shuffle, max_steps=cfg.max_steps)
        norm_len = float(cfg.norm_len or max(len(r) for r in members.response))

        # 5. resume
        start, samples_seen, rows, resumed_from = 0, 0, [], None
        if resume:
            state = ck.load_state(strategy, work)
            if state is not None:
                start, samples_seen, rows = int(state["global_step"]), int(state["samples_seen"]), list(state["metrics"])
                resumed_from = start
                if state.get("checkpoint_id") != checkpoint_id:
                    raise ConflictError(f"resumable state in {work} belongs to {state.get('checkpoint_id')}")
            else:
                resumed_from = 0
                if rank == 0:
                    print(f"note: --resume found no saved step in {work} (save_every={cfg.save_every}); training "
                          f"restarts from step 0, which is deterministic and ends in the same weights. "
                          f"Set --set save_every=N to resume mid-run.", file=sys.stderr)

        # 6. train (rank 0 appends the step rows as it goes: pipeline.train.live)
        live = _live_metrics(lake, cfg, checkpoint_id) if rank == 0 else None
        bar = None
        show = (progress if progress is not None else sys.stderr.isatty()) and rank == 0
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(steps), initial=start, desc=f"train {snapshot_id[:12]}", unit="step")
        strategy.train()
        for step in steps[start:]:
            row = _train_step(strategy, members, step, cfg, loss_kind, norm_len)
            samples_seen += row["sequences"]
            row.update(checkpoint_id=checkpoint_id, snapshot_id=snapshot_id, run_id=lineage_run_id)
            rows.append(row)
            if bar is not None:
                bar.set_postfix(loss=f"{row['loss']:.4f}", reward=f"{row['reward_mean']:.3f}",
                                kl_old=f"{row['approx_kl']:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
                bar.update(1)
            done = step.index + 1
            if live is not None:
                live.step_done(rows)
            pause_point(f"train:step:{done}")
            if cfg.save_every and done % cfg.save_every == 0 and done < len(steps):
                ck.save_state(strategy, work, f"step-{done:08d}", _client_state(
                    checkpoint_id, snapshot_id, done, samples_seen, step.epoch, rows))
        if bar is not None:
            bar.close()

        # 7. publish
        global_step = len(steps)
        client_state = _client_state(checkpoint_id, snapshot_id, global_step, samples_seen,
                                     steps[-1].epoch if steps else 0, rows)
        train_config = config_dict(cfg) | {"policy_loss_resolved": loss_kind, "norm_len_resolved": norm_len,
                                           "optimizer_from": optimizer_from}
        if crash_at == "publish":
            _crash_while_publishing(strategy, final, client_state, train_config, lm, parent)
        ck.write_final(strategy, final, client_state=client_state, train_config=train_config, lm=lm,
                       parent_hf=parent.hf_dir)
        summary = _summary(rows) | freshness
        result = None
        if rank == 0:
            result = _publish(lake, checkpoint_id=checkpoint_id, parent=parent, snapshot_id=snapshot_id, cfg=cfg,
                              world_size=world_size, global_step=global_step, samples_seen=samples_seen,
                              summary=summary, rows=rows, resumed_from=resumed_from, t_start=t_start,
                              lineage_run_id=lineage_run_id, final=final, live=live, extra_config=lineage_cfg)
            lineage.emit_run_event(lake, event_type="COMPLETE", run_id=lineage_run_id, job_name=JOB_NAME,
                                   inputs=inputs, outputs=lineage.train_outputs(lake, checkpoint_id,
                                                                                result.policy_version), **ol)
            shutil.rmtree(work, ignore_errors=True)
        strategy.barrier()
        return strategy.broadcast_object(result)
    except BaseException as exc:
        if rank == 0:
            _close_trackers(locals().get("live"))
            try:
                lineage.emit_run_event(lake, event_type="FAIL", run_id=lineage_run_id, job_name=JOB_NAME,
                                       inputs=inputs, outputs=[lineage.checkpoint(lake, checkpoint_id)],
                                       error=f"{type(exc).__name__}: {exc}", **ol)
            except Exception:  # pragma: no cover - never mask the real error
                pass
        raise


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


def _train_step(strategy: DeepSpeedStrategy, members: Members, step, cfg: TrainConfig, loss_kind: str, norm_len: float) -> dict[str, Any]:
    """Forward/backward over this rank's micro-batches of ``step``, then one optimizer step."""
    import numpy as np
    import torch

    from pipeline.train import losses as L
    from pipeline.train.data import collate

    t0 = time.perf_counter()
    W, dev = strategy.world_size, strategy.device
    all_idx = [i for mb in step.micro_batches for i in mb]
    norm = L.Norm(num_tokens=float(members.loss_tokens(all_idx)), num_seqs=float(len(all_idx)), norm_len=norm_len)
    need = ("rollout",) + (("old",) if cfg.old_logprobs == "recompute" else ()) + (("ref",) if cfg.kl_coef > 0 else ())
    loss_fn = L.POLICY_LOSSES[loss_kind]
    # sums over this rank's tokens: [loss, pg, kl, entropy*tok, clip_hi*tok, clip_lo*tok, approx_kl*tok, mismatch*tok, tok]
    acc = torch.zeros(9, dtype=torch.float64)
    quant = {"ratio_p05": 1.0, "ratio_p50": 1.0, "ratio_p95": 1.0}
    tokens_in = 0
    for mb in step.for_rank(strategy.rank, W):
        if not mb:
            # this rank has fewer micro-batches than another: a zero-weight pass keeps
            # the per-backward ZeRO reductions in lockstep
            lp, ent = strategy.forward(torch.zeros(1, 2, dtype=torch.long, device=dev),
                                       torch.zeros(1, dtype=torch.long, device=dev),
                                       torch.zeros(1, dtype=torch.long, device=dev))
            strategy.backward(0.0 * (lp.sum() + ent.sum()))
            continue
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
        pg, met = loss_fn(logp, old, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
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
        strategy.backward(total * W)
        with torch.no_grad():
            tok = float(mask.sum())
            mism = float(L.masked_mean(L.kl_penalty(old, rollout, "k3"), mask)) if cfg.old_logprobs == "recompute" \
                else float(L.masked_mean(L.kl_penalty(logp.detach(), rollout, "k3"), mask))
            acc += torch.tensor([float(total.detach()), float(pg.detach()), float(kl_val.detach()), float(L.masked_mean(ent.detach(), mask)) * tok,
                                 met["clip_frac_high"] * tok, met["clip_frac_low"] * tok, met["approx_kl"] * tok,
                                 mism * tok, tok], dtype=torch.float64)
            if strategy.rank == 0 and mb == step.for_rank(0, W)[0]:
                quant = {k: met[k] for k in quant}
        tokens_in += b["tokens_in"]
    out = strategy.optimizer_step()
    acc = strategy.all_reduce_sum(acc)
    tok = max(float(acc[8]), 1.0)
    slots = sum(len(mb) * int(members.lengths[list(mb)].max()) for mb in step.micro_batches)
    real = int(members.lengths[all_idx].sum())
    seconds = time.perf_counter() - t0
    lags = members.policy_lag[all_idx]
    return {
        "global_step": step.index, "epoch": step.epoch,
        "loss": float(acc[0]), "pg_loss": float(acc[1]), "kl": float(acc[2]) if cfg.kl_coef > 0 else None,
        "entropy": float(acc[3]) / tok,
        "reward_mean": float(np.mean(members.reward[all_idx])), "advantage_mean": float(np.mean(members.advantage[all_idx])),
        "clip_frac_high": float(acc[4]) / tok, "clip_frac_low": float(acc[5]) / tok,
        "clip_fraction": (float(acc[4]) + float(acc[5])) / tok,
        "approx_kl": float(acc[6]) / tok, "mismatch_kl": float(acc[7]) / tok, **quant,
        "grad_norm": out["grad_norm"], "lr": out["lr"],
        "tokens": int(acc[8]), "sequences": len(all_idx), "micro_batches": len(step.micro_batches),
        "padding_ratio": 0.0 if slots == 0 else 1.0 - real / slots,
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
