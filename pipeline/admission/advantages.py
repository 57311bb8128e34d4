"""Advantage estimators: pure functions over admitted members, in a registry.

Every estimator takes the rewards of the admitted members and their group
index (``rewards: float64 [N]``, ``groups: int64 [N]`` codes 0..G-1) and
returns one sequence-level advantage per member (``float64 [N]``). Per-token
advantages are that value broadcast over ``loss_mask`` (``token_advantages``).

- grpo: (r - mean_g) / (std_g + eps), population std (Shao et al. 2024,
  DeepSeekMath); ``scaling="batch"`` divides by the std of all centred rewards
  instead, ``"none"`` does not divide.
- dr_grpo: r - mean_g (Liu et al. 2025, "Understanding R1-Zero-Like Training":
  no std division, no length normalization).
- rloo: r - mean of the other members = G/(G-1) * (r - mean_g) (Ahmadian et al. 2024).
- reinforce_batch_norm: (r - b) / (std_batch + eps) over the whole snapshot, b =
  the batch mean or a running mean carried between snapshots (REINFORCE++,
  Hu 2025); one sample per prompt is allowed.

- grpo_turn (opt-in per-turn credit): the member's sequence-level advantage is
  grpo's (what snapshot_members records, and what a group without complete
  turn rewards trains on); materialization adds ``turn_advantages`` to the
  snapshot payload (``turn_advantages`` below) and the trainer puts them on
  each turn's tokens.

Per-turn credit (``turn_advantages``): where an
environment records one reward per policy turn (``trajectories.turn_rewards``,
docs/admission-rules.md "Per-turn credit"), GRPO with process supervision
(Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, section 4.1.3): each turn
reward is normalized by the mean and population std of all turn rewards of
its group, and the advantage of a turn is the sum of the normalized rewards of
that turn and every later turn of the same trajectory (the return-to-go);
``turn_token_advantages`` puts each turn's advantage on that turn's policy
tokens (the k-th run of ``loss_mask`` 1s). The other estimators and their
snapshots are unchanged by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from pipeline.snapshots.reader import policy_turns, turn_token_advantages  # noqa: F401  (the token side, re-exported)


class Estimator(Protocol):
    def __call__(self, rewards: np.ndarray, groups: np.ndarray, *, eps: float, scaling: str,
                 baseline: float | None) -> np.ndarray: ...


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    fn: Estimator
    group_baseline: bool  # needs >= 2 members with reward spread per group (zero-variance check applies)


ESTIMATORS: dict[str, EstimatorSpec] = {}


def register(name: str, *, group_baseline: bool) -> Callable[[Estimator], Estimator]:
    """Register an estimator under ``name``; registering a name twice is an error."""

    def deco(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = EstimatorSpec(name, fn, group_baseline)
        return fn

    return deco


def _group_stats(rewards: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per member: group mean, group population std, group size."""
    n_groups = int(groups.max()) + 1 if groups.size else 0
    count = np.bincount(groups, minlength=n_groups).astype(np.float64)        # [G]
    mean = np.bincount(groups, weights=rewards, minlength=n_groups) / np.maximum(count, 1)  # [G]
    dev = rewards - mean[groups]                                                # [N]
    var = np.bincount(groups, weights=dev * dev, minlength=n_groups) / np.maximum(count, 1)  # [G]
    return mean[groups], np.sqrt(var)[groups], count[groups]


@register("grpo", group_baseline=True)
def grpo(rewards: np.ndarray, groups: np.ndarray, *, eps: float, scaling: str = "group",
         baseline: float | None = None) -> np.ndarray:
    mean, std, _ = _group_stats(rewards, groups)
    centred = rewards - mean                                                    # [N]
    if scaling == "group":
        return centred / (std + eps)
    if scaling == "batch":
        return centred / (float(np.sqrt(np.mean(centred * centred))) + eps) if centred.size else centred
    return centred


@register("dr_grpo", group_baseline=True)
def dr_grpo(rewards: np.ndarray, groups: np.ndarray, *, eps: float, scaling: str = "group",
            baseline: float | None = None) -> np.ndarray:
    mean, _, _ = _group_stats(rewards, groups)
    return rewards - mean


@register("rloo", group_baseline=True)
def rloo(rewards: np.ndarray, groups: np.ndarray, *, eps: float, scaling: str = "group",
         baseline: float | None = None) -> np.ndarray:
    mean, _, count = _group_stats(rewards, groups)
    # r - (sum - r)/(G-1) = G/(G-1) * (r - mean); a lone member has no others: 0
    return np.where(count > 1, count / np.maximum(count - 1, 1) * (rewards - mean), 0.0)


@register("grpo_turn", group_baseline=True)
def grpo_turn(rewards: np.ndarray, groups: np.ndarray, *, eps: float, scaling: str = "group",
              baseline: float | None = None) -> np.ndarray:
    """The sequence-level part of per-turn credit: grpo (the turn-level part is ``turn_advantages``,
    applied at materialization where the payload's turn rewards are read)."""
    return grpo(rewards, groups, eps=eps, scaling=scaling, baseline=None)


TURN_ESTIMATORS = frozenset({"grpo_turn"})   # estimators whose snapshots carry turn_advantages


@register("reinforce_batch_norm", group_baseline=False)
def reinforce_batch_norm(rewards: np.ndarray, groups: np.ndarray, *, eps: float, scaling: str = "group",
                         baseline: float | None = None) -> np.ndarray:
    if rewards.size == 0:
        return rewards.astype(np.float64)
    b = float(np.mean(rewards)) if baseline is None else float(baseline)
    centred = rewards - b
    std = float(np.std(rewards))  # population std of the batch
    return centred / (std + eps)


def running_baseline(previous: float | None, rewards: np.ndarray, momentum: float | None) -> float | None:
    """The baseline to use for this snapshot (and to carry to the next one)."""
    if momentum is None or rewards.size == 0:
        return None
    mean = float(np.mean(rewards))
    return mean if previous is None else momentum * previous + (1 - momentum) * mean


def compute_advantages(name: str, rewards: np.ndarray, groups: np.ndarray, *, eps: float,
                       scaling: str = "group", baseline: float | None = None) -> np.ndarray:
    if name not in ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(ESTIMATORS)}")
    rewards = np.asarray(rewards, np.float64)
    groups = np.asarray(groups, np.int64)
    return np.asarray(ESTIMATORS[name].fn(rewards, groups, eps=eps, scaling=scaling, baseline=baseline),
                      np.float64)


def token_advantages(advantage: float, loss_mask: np.ndarray) -> np.ndarray:
    """Per-token advantage: the member's advantage on policy tokens, 0 on observations.  # [T]"""
    return np.asarray(loss_mask, np.float64) * float(advantage)


def turn_advantages(turn_rewards: list[np.ndarray], groups: np.ndarray, *, eps: float) -> list[np.ndarray]:
    """Per member, one advantage per policy turn (DeepSeekMath's process-supervision GRPO, section 4.1.3).

    ``turn_rewards[i]`` -- member i's rewards, one per policy turn (float64 [K_i], K_i >= 1);
    ``groups`` -- group codes 0..G-1 (int64 [N]). With mu_g, sigma_g the mean and population std of
    every turn reward of group g's members: r~_ik = (r_ik - mu_g) / (sigma_g + eps), and
    A_ik = sum over k' >= k of r~_ik' (returns-to-go of the normalized turn rewards)."""
    groups = np.asarray(groups, np.int64)
    if len(turn_rewards) != groups.size:
        raise ValueError(f"{len(turn_rewards)} members' turn rewards for {groups.size} group codes")
    rs = [np.asarray(r, np.float64) for r in turn_rewards]
    for i, r in enumerate(rs):
        if r.ndim != 1 or r.size == 0 or not np.isfinite(r).all():
            raise ValueError(f"member {i}: turn rewards must be a non-empty list of finite numbers, got {r.tolist()}")
    if not rs:
        return []
    flat = np.concatenate(rs)                                                   # [sum K]
    owner = np.repeat(groups, [r.size for r in rs])                             # [sum K] group of each turn
    n_groups = int(groups.max()) + 1
    count = np.bincount(owner, minlength=n_groups).astype(np.float64)           # [G]
    mean = np.bincount(owner, weights=flat, minlength=n_groups) / np.maximum(count, 1)
    dev = flat - mean[owner]
    std = np.sqrt(np.bincount(owner, weights=dev * dev, minlength=n_groups) / np.maximum(count, 1))
    scale = std[owner] + eps
    norm = np.divide(dev, scale, out=np.zeros_like(dev), where=scale > 0)      # [sum K]; equal rewards: 0
    out, at = [], 0
    for r in rs:
        part = norm[at:at + r.size]
        out.append(np.cumsum(part[::-1])[::-1].copy())                          # returns-to-go [K_i]
        at += r.size
    return out
