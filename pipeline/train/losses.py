"""Policy-gradient losses: pure functions on [B, T] tensors with a mask.

B = sequences in the micro-batch, T = response positions (padded). ``mask`` is
1.0 on policy-sampled response tokens and 0.0 on prompt, padding and
observation tokens (which therefore never reach the loss or its gradient).

Every loss returns ``(loss, metrics)``: a scalar tensor and a dict of detached
floats/tensors. ``norm`` carries the normalizers of the *whole optimizer step*
(all micro-batches, all ranks), so that summing the micro-batch losses gives
exactly the step loss whatever the micro-batching (verl does the same with
``global_batch_info``). Without ``norm`` the micro-batch is the step.

Registered by name (``POLICY_LOSSES``); registering a name twice is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.train.config import AGG_MODES

POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict]]] = {}


def register_policy_loss(name: str):
    def deco(fn):
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} registered twice")
        POLICY_LOSSES[name] = fn
        return fn
    return deco


@dataclass(frozen=True)
class Norm:
    """Normalizers of one optimizer step (over every micro-batch and rank)."""

    num_tokens: float   # masked-in tokens in the step
    num_seqs: float     # sequences in the step
    norm_len: float     # Dr.GRPO constant (longest response / generation budget)


def batch_norm(mask: torch.Tensor, norm_len: float | None = None) -> Norm:
    """Normalizers when the micro-batch is the whole step."""
    return Norm(float(mask.sum()), float(mask.shape[0]), float(norm_len if norm_len else mask.shape[-1]))


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str, norm: Norm | None = None) -> torch.Tensor:
    """Reduce per-token ``values`` [B, T] to a scalar.

    - token-mean:              sum_bt v*m / sum_bt m                 (DAPO token-level)
    - seq-mean-token-mean:     1/B sum_b (sum_t v*m / sum_t m)       (GRPO paper)
    - seq-mean-token-sum:      1/B sum_b sum_t v*m
    - seq-mean-token-sum-norm: 1/B sum_b sum_t v*m / L               (Dr.GRPO, L constant)
    """
    norm = norm or batch_norm(mask)
    masked = values * mask                                            # [B, T]
    if agg == "token-mean":
        return masked.sum() / max(norm.num_tokens, 1.0)
    if agg == "seq-mean-token-mean":
        seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)            # [B]
        return seq.sum() / max(norm.num_seqs, 1.0)
    if agg == "seq-mean-token-sum":
        return masked.sum() / max(norm.num_seqs, 1.0)
    if agg == "seq-mean-token-sum-norm":
        return masked.sum() / (max(norm.num_seqs, 1.0) * norm.norm_len)
    raise ValueError(f"unknown agg {agg!r}; one of {AGG_MODES}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate [B, T] (Schulman's estimators, u = ref - logp):

    - k1 = -u                 (unbiased, can be negative)
    - k2 = u^2 / 2            (low variance, biased)
    - k3 = e^u - u - 1        (unbiased and >= 0; DeepSeekMath's GRPO penalty)
    """
    u = (ref_logprobs - logprobs).clamp(-20.0, 20.0)                  # [B, T]
    if kind == "k1":
        return -u
    if kind == "k2":
        return 0.5 * u * u
    if kind == "k3":
        return torch.exp(u) - u - 1.0
    raise ValueError(f"unknown kl kind {kind!r}; one of k1, k2, k3")


def _quantiles(x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    vals = x.detach()[mask > 0].float()
    if vals.numel() == 0:
        return {"ratio_p05": 1.0, "ratio_p50": 1.0, "ratio_p95": 1.0}
    q = torch.quantile(vals, torch.tensor([0.05, 0.5, 0.95], dtype=vals.dtype))
    return {"ratio_p05": float(q[0]), "ratio_p50": float(q[1]), "ratio_p95": float(q[2])}


@register_policy_loss("ppo")
def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.2, ratio_level: str = "token", agg: str = "token-mean",
                norm: Norm | None = None, is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate with asymmetric clip (PPO, GRPO; DAPO clip-higher when
    clip_high > clip_low). ``ratio_level="sequence"`` is GSPO (Zheng et al. 2025):
    s_b = exp(mean_t m*(logp - old)) per sequence, applied to every token as
    sg(s_b) * exp(logp - sg(logp)) so the gradient is GSPO's. ``is_weights``
    [B, T] (detached) multiplies the per-token loss: truncated importance
    sampling for the rollout-engine/trainer mismatch (Yao et al. 2025).
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0) * mask         # [B, T]
    if ratio_level == "token":
        ratio = torch.exp(log_ratio)                                         # [B, T]
    elif ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0)      # [B]
        ratio = torch.exp(seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach())  # [B, T]
    else:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; token or sequence")
    unclipped = -advantages * ratio                                          # [B, T]
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)     # [B, T]
    per_token = torch.maximum(unclipped, clipped)                            # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, agg, norm)
    with torch.no_grad():
        r = ratio.detach()
        above = ((r > 1.0 + clip_high) & (advantages > 0)).to(mask.dtype)   # gradient cut above
        below = ((r < 1.0 - clip_low) & (advantages < 0)).to(mask.dtype)    # gradient cut below
        metrics = {
            "clip_frac_high": float(masked_mean(above, mask)),
            "clip_frac_low": float(masked_mean(below, mask)),
            "approx_kl": float(masked_mean(kl_penalty(logprobs.detach(), old_logprobs, "k3"), mask)),
            **_quantiles(r, mask),
        }
    return loss, metrics


@register_policy_loss("reinforce")
def reinforce_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                   mask: torch.Tensor, *, agg: str = "token-mean", norm: Norm | None = None,
                   is_weights: torch.Tensor | None = None, **_: object) -> tuple[torch.Tensor, dict]:
    """REINFORCE (Williams 1992), no ratio: -A * logp per token. For
    one-sample-per-prompt snapshots (advantages from a batch baseline)."""
    mask = mask.to(logprobs.dtype)
    per_token = -advantages * logprobs                                       # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, agg, norm)
    metrics = {"clip_frac_high": 0.0, "clip_frac_low": 0.0, "approx_kl": 0.0,
               "ratio_p05": 1.0, "ratio_p50": 1.0, "ratio_p95": 1.0}
    if old_logprobs is not None:
        with torch.no_grad():
            metrics["approx_kl"] = float(masked_mean(kl_penalty(logprobs.detach(), old_logprobs, "k3"), mask))
    return loss, metrics


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """min(pi_old / pi_rollout, cap) per token [B, T]: corrects for the rollout
    engine sampling from slightly different probabilities than the trainer
    computes (TIS, Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training")."""
    w = torch.exp((old_logprobs - rollout_logprobs).clamp(-20.0, 20.0)).clamp(max=cap)
    return w * mask + (1.0 - mask)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, *, coef: float, agg: str = "token-mean",
                  norm: Norm | None = None) -> torch.Tensor:
    """-coef * agg(entropy): subtracting it from the loss rewards exploration."""
    return -coef * aggregate(entropy, mask.to(entropy.dtype), agg, norm)
