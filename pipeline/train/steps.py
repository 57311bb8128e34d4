"""Steps 2-6 of a training run (the driver is pipeline.train.run; the resident
trainer, pipeline.train.follow, calls the same steps once per version)."""

from __future__ import annotations

import json
import shutil
import sys
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from pipeline.config import config_dict
from pipeline.errors import ConflictError
from pipeline.train.freshness import check_freshness, check_lineage, snapshot_wait_ms
from pipeline.train.publish import cursor_state, live_metrics
from pipeline.train.records import Data, Plan, Run, State
from pipeline.train.update import prepass, train_step

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.policy_store import PolicyRef
    from pipeline.train.config import TrainConfig
    from pipeline.train.data import Members
    from pipeline.train.ds_adapter import DeepSpeedStrategy


def prepare_data(run: Run, lm: Any = None) -> Data:
    """Step 2: the snapshot, verified, the parent model (loaded unless ``lm``, the
    resident trainer's model, already holds the parent's weights), and the
    pre-training assertions."""
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
    check_lineage(lake, members, parent, snapshot_id)   # before the lag: a lag across lines means nothing
    freshness = check_freshness(members, parent.policy_version, cfg.max_train_lag, snapshot_id)
    freshness["consumed_at"] = consumed_at.isoformat()
    freshness["snapshot_wait_ms"] = snapshot_wait_ms(lake, snapshot_id, consumed_at)
    if lm is None:
        lm = load_causal_lm(parent.hf_dir, activation_checkpointing=cfg.activation_checkpointing,
                            ds_config=ds_config(zero_stage=cfg.zero_stage, precision=cfg.precision,
                                                offload=cfg.offload, max_grad_norm=cfg.max_grad_norm))
    check_members(members, vocab_size=int(lm.config.vocab_size),
                  max_positions=getattr(lm.config, "max_position_embeddings", None),
                  valid_counts=receipt_counts(lake, snapshot_id))
    return Data(members, lm, lineage_cfg, freshness)


def prepare_workdir(run: Run, resume: bool) -> None:
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


def build_engine(cfg: TrainConfig, lm: Any) -> DeepSpeedStrategy:
    """Step 3: seed everything, wrap the model in DeepSpeed."""
    from pipeline.train import checkpoint as ck
    from pipeline.train.ds_adapter import DeepSpeedStrategy
    from pipeline.train.model import PolicyLogprobs

    ck.seed_everything(cfg.seed)
    policy = PolicyLogprobs(lm, chunk=cfg.logprob_chunk, vocab_chunk=cfg.vocab_chunk)
    strategy = DeepSpeedStrategy(policy, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                                 zero_stage=cfg.zero_stage, precision=cfg.precision, offload=cfg.offload,
                                 max_grad_norm=cfg.max_grad_norm)
    strategy.barrier()
    return strategy


def plan_run(run: Run, strategy: DeepSpeedStrategy, members: Members, *, optimizer_from: str | None,
             train_lag: int | None = None, gate: bool = True) -> Plan:
    """Step 4: the loss, the pre-pass with the frozen starting weights, the
    off-policy figures of those weights against the rollout's sampling
    log-probs and their gate (``check_offpolicy``; ``gate=False``: a replayed
    version, which passed it when first trained), the learning rate for the
    snapshot's lag (``stale_lr_scale ** train_lag``), the step plan.
    ``optimizer_from``: whose optimizer state the engine holds (``carry_optimizer``
    ran before, or the resident trainer kept it in memory), recorded with the checkpoint."""
    from pipeline.train.freshness import check_offpolicy, member_log_ratios, offpolicy_figures
    from pipeline.train.packing import plan_steps

    cfg = run.cfg
    loss_kind = cfg.policy_loss
    if loss_kind == "auto":
        loss_kind = "reinforce" if int(members.group_size.max()) == 1 else "ppo"
    t0 = time.perf_counter()
    prepass(strategy, members, cfg, run.lake, run.parent)
    prepass_s = time.perf_counter() - t0
    figures = offpolicy_figures(member_log_ratios(members, members.current_logprobs), cfg.ratio_tail_bound)
    if gate:
        check_offpolicy(figures, min_ess_fraction=cfg.min_ess_fraction, max_ratio_p99=cfg.max_ratio_p99,
                        snapshot_id=run.snapshot_id,
                        policy=f"v{run.parent.policy_version} ({run.parent.checkpoint_id})")
    lr_scale = cfg.stale_lr_scale ** max(train_lag or 0, 0)
    if strategy.base_lr != cfg.lr * lr_scale:      # (the resident trainer's engine keeps the last version's)
        strategy.set_base_lr(cfg.lr * lr_scale)
    offpolicy = {f"snapshot_{k}": v for k, v in figures.items()} | {"lr_scale": lr_scale}
    steps = plan_steps(members.lengths, budget_tokens=cfg.micro_batch_tokens, grad_accum=cfg.grad_accum,
                       epochs=cfg.epochs, seed=cfg.seed, order=cfg.step_order, max_steps=cfg.max_steps)
    norm_len = float(cfg.norm_len or max(len(r) for r in members.response))
    return Plan(loss_kind=loss_kind, optimizer_from=optimizer_from, steps=steps, norm_len=norm_len,
                prepass_seconds=prepass_s, offpolicy=offpolicy)


def restore(run: Run, strategy: DeepSpeedStrategy, resume: bool) -> State:
    """Step 5: the resumable state when resuming (hash-verified; never a silent fresh start)."""
    from pipeline.train import checkpoint as ck

    if not resume:
        return State()
    state = ck.load_state(strategy, run.work)
    if state is None:
        if run.rank == 0:
            print(f"note: --resume found no saved step in {run.work} (save_every={run.cfg.save_every}); training "
                  f"restarts from step 0, which is deterministic and ends in the same weights. "
                  f"Set --set save_every=N to resume mid-run.", file=sys.stderr)
        return State(resumed_from=0)
    start = int(state["global_step"])
    if state.get("checkpoint_id") != run.checkpoint_id:
        raise ConflictError(f"resumable state in {run.work} belongs to {state.get('checkpoint_id')}")
    return State(start, int(state["samples_seen"]), list(state["metrics"]), start)


def step_loop(run: Run, strategy: DeepSpeedStrategy, members: Members, plan: Plan, state: State,
              progress: bool | None, *, live: bool = True) -> None:
    """Step 6: train from ``state.start`` (rank 0 appends the step rows as it goes: pipeline.train.live;
    ``live=False``: a replayed version, whose rows landed when it was first trained)."""
    from pipeline.lake.delta import pause_point
    from pipeline.train import checkpoint as ck

    steps = plan.steps
    run.live = live_metrics(run.lake, run.cfg, run.checkpoint_id, trackers=run.trackers) \
        if run.rank == 0 and live else None
    bar = None
    show = (progress if progress is not None else sys.stderr.isatty()) and run.rank == 0
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(steps), initial=state.start, desc=f"train {run.snapshot_id[:12]}", unit="step")
    strategy.train()
    for step in steps[state.start:]:
        row = train_step(strategy, members, step, run.cfg, plan.loss_kind, plan.norm_len)
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
            ck.save_state(strategy, run.work, f"step-{done:08d}", cursor_state(
                run.checkpoint_id, run.snapshot_id, done, state.samples_seen, step.epoch, state.rows))
    if bar is not None:
        bar.close()


def carry_optimizer(strategy: DeepSpeedStrategy, cfg: TrainConfig, lake: Lake, parent: PolicyRef, world_size: int) -> str | None:
    """Load the parent's DeepSpeed state (weights + AdamW moments; not its LR
    schedule) when the parent is a checkpoint of this trainer with a compatible
    layout. The parent's files were hash-verified by resolve_policy (or, for a
    state written at a resident trainer's shutdown, against its state manifest).
    Returns the parent id when carried, None for a fresh optimizer (the initial
    policy, a plain HF directory, a version published weights-only, or a
    different zero_stage/precision/offload/world size)."""
    from pipeline.train.checkpoint import FINAL_TAG, has_full_state

    root = parent.path
    if parent.policy_version < 0 or not has_full_state(root, parent.file_sha256):
        if parent.policy_version >= 0 and (root / "cursor.json").is_file() and strategy.is_rank_0():
            print(f"note: fresh optimizer: parent {parent.checkpoint_id} was published weights-only by the resident "
                  "trainer (pipeline train --follow); its optimizer state exists only at its full checkpoints "
                  "(docs/resident-trainer.md)", file=sys.stderr)
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


