"""The math of one update: the pre-pass under frozen weights, one optimizer step
over length-bucketed micro-batches, and the metrics row of each step.
Tensors in, tensors (and a metrics dict) out; no lake I/O except loading a
frozen KL reference model."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Sequence

from pipeline.train.freshness import offpolicy_figures

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.policy_store import PolicyRef
    from pipeline.train.config import TrainConfig
    from pipeline.train.data import Members
    from pipeline.train.ds_adapter import DeepSpeedStrategy
    from pipeline.train.losses import Norm
    from pipeline.train.packing import Step


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


def prepass(strategy: DeepSpeedStrategy, members: Members, cfg: TrainConfig, lake: Lake, parent: PolicyRef) -> None:
    """Old log-probs (recompute mode) and reference log-probs (kl_coef > 0) of
    every member under frozen weights, once, before the first update, and the
    starting weights' log-probs (``current_logprobs``: the old ones in recompute
    mode, one more no-grad pass in rollout mode) for the off-policy figures.
    Every rank computes all members, in the same micro-batches: identical on
    any world size and on resume."""
    import numpy as np
    import torch

    from pipeline.train.packing import pack_by_length

    need_old = cfg.old_logprobs == "recompute"
    need_ref = cfg.kl_coef > 0
    members.old_logprobs = [None] * len(members)
    members.ref_logprobs = [None] * len(members)
    members.current_logprobs = [None] * len(members)
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
        members.current_logprobs = members.old_logprobs
    else:
        run(strategy.module, members.current_logprobs)
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


class StepSums:
    """Sums over this rank's micro-batches of one step, by name; all-reduced
    across ranks as one float64 tensor whose slots follow ``NAMES``."""

    NAMES = ("loss", "pg_loss", "kl",                 # the micro-batches' losses, summed
             "entropy_tok", "clip_high_tok", "clip_low_tok", "approx_kl_tok", "mismatch_tok",  # x tokens
             "tokens")

    def __init__(self) -> None:
        import torch

        self.values = torch.zeros(len(self.NAMES), dtype=torch.float64)
        self.log_ratios: list = []      # per sequence: log pi - log mu on its loss tokens (offpolicy_figures)

    def add(self, **named: float) -> None:
        import torch

        self.values += torch.tensor([named[n] for n in self.NAMES], dtype=torch.float64)

    def all_reduce(self, strategy: DeepSpeedStrategy) -> dict[str, float]:
        return dict(zip(self.NAMES, (float(v) for v in strategy.all_reduce_sum(self.values))))


def train_step(strategy: DeepSpeedStrategy, members: Members, step: Step, cfg: TrainConfig, loss_kind: str, norm_len: float) -> dict[str, Any]:
    """Forward/backward over this rank's micro-batches of ``step``, then one optimizer step."""
    from pipeline.train import losses as L

    t0 = time.perf_counter()
    all_idx = [i for mb in step.micro_batches for i in mb]
    norm = L.Norm(num_tokens=float(members.loss_tokens(all_idx)), num_seqs=float(len(all_idx)), norm_len=norm_len)
    sums = StepSums()
    quant = {"ratio_p05": 1.0, "ratio_p50": 1.0, "ratio_p95": 1.0}
    for mb in step.for_rank(strategy.rank, strategy.world_size):
        if not mb:
            zero_weight_pass(strategy)
            continue
        met = micro_batch(strategy, members, mb, cfg, loss_kind, norm, sums)
        if strategy.rank == 0 and mb == step.for_rank(0, strategy.world_size)[0]:
            quant = {k: met[k] for k in quant}
    out = strategy.optimizer_step()
    offp = offpolicy_figures([x for part in strategy.all_gather_object(sums.log_ratios) for x in part],
                             cfg.ratio_tail_bound)
    return step_row(members, step, cfg, all_idx, sums.all_reduce(strategy), quant | offp, out,
                    time.perf_counter() - t0)


def zero_weight_pass(strategy: DeepSpeedStrategy) -> None:
    """This rank has fewer micro-batches than another: a zero-weight pass keeps
    the per-backward ZeRO reductions in lockstep."""
    import torch

    dev = strategy.device
    lp, ent = strategy.forward(torch.zeros(1, 2, dtype=torch.long, device=dev),
                               torch.zeros(1, dtype=torch.long, device=dev),
                               torch.zeros(1, dtype=torch.long, device=dev))
    strategy.backward(0.0 * (lp.sum() + ent.sum()))


def micro_batch(strategy: DeepSpeedStrategy, members: Members, mb: Sequence[int], cfg: TrainConfig, loss_kind: str,
                 norm: Norm, sums: StepSums) -> dict[str, float]:
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
        d = ((logp.detach().double() - rollout.double()) * mask).cpu().numpy()                              # [B, R]
        keep = mask.cpu().numpy() > 0
        sums.log_ratios.extend(d[k][keep[k]] for k in range(B))
        tok = float(mask.sum())
        mism = float(L.masked_mean(L.kl_penalty(old, rollout, "k3"), mask)) if cfg.old_logprobs == "recompute" \
            else float(L.masked_mean(L.kl_penalty(logp.detach(), rollout, "k3"), mask))
        sums.add(loss=float(total.detach()), pg_loss=float(pg.detach()), kl=float(kl_val.detach()),
                 entropy_tok=float(L.masked_mean(ent.detach(), mask)) * tok, clip_high_tok=met["clip_frac_high"] * tok,
                 clip_low_tok=met["clip_frac_low"] * tok, approx_kl_tok=met["approx_kl"] * tok,
                 mismatch_tok=mism * tok, tokens=tok)
    return met


def step_row(members: Members, step: Step, cfg: TrainConfig, all_idx: list[int], sums: dict[str, float],
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


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
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


