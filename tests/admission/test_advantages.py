"""Advantage estimators against hand-computed values, and vectorized == a loop."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.admission.advantages import (ESTIMATORS, compute_advantages, register, running_baseline,
                                           token_advantages)


def adv(name, rewards, groups, **kw):
    kw.setdefault("eps", 0.0)
    return compute_advantages(name, np.array(rewards, float), np.array(groups), **kw).tolist()


def test_grpo_by_hand():
    # group 0: 1,0,0,1 -> mean .5, population std .5 -> +-1
    # group 1: 2,0,1   -> mean 1, std sqrt(2/3)
    got = adv("grpo", [1, 0, 0, 1, 2, 0, 1], [0, 0, 0, 0, 1, 1, 1])
    s = math.sqrt(2 / 3)
    assert got == pytest.approx([1, -1, -1, 1, 1 / s, -1 / s, 0])


def test_grpo_eps_and_batch_scaling():
    got = adv("grpo", [1, 0], [0, 0], eps=0.5)           # (1-.5)/(.5+.5)
    assert got == pytest.approx([0.5, -0.5])
    # batch: centred (.5,-.5, 1,-1) / rms 0.790569 = sqrt((.25+.25+1+1)/4)
    got = adv("grpo", [1, 0, 2, 0], [0, 0, 1, 1], scaling="batch")
    rms = math.sqrt(2.5 / 4)
    assert got == pytest.approx([0.5 / rms, -0.5 / rms, 1 / rms, -1 / rms])
    assert adv("grpo", [1, 0, 2, 0], [0, 0, 1, 1], scaling="none") == pytest.approx([.5, -.5, 1, -1])


def test_dr_grpo_by_hand():
    assert adv("dr_grpo", [1, 0, 0], [0, 0, 0]) == pytest.approx([2 / 3, -1 / 3, -1 / 3])


def test_rloo_by_hand():
    # r_i - mean of the others: 1 - 0 = 1; 0 - (1+0)/2 = -.5
    assert adv("rloo", [1, 0, 0], [0, 0, 0]) == pytest.approx([1, -0.5, -0.5])
    assert adv("rloo", [3, 1], [0, 0]) == pytest.approx([2, -2])


def test_reinforce_batch_norm_by_hand():
    # batch mean .25, population std sqrt(.1875)
    s = math.sqrt(0.1875)
    assert adv("reinforce_batch_norm", [1, 0, 0, 0], [0, 1, 2, 3]) == pytest.approx(
        [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s])
    # a running baseline replaces the batch mean
    assert adv("reinforce_batch_norm", [1, 0], [0, 1], baseline=0.8) == pytest.approx([0.2 / 0.5, -0.8 / 0.5])


def test_running_baseline():
    assert running_baseline(None, np.array([1.0, 0.0]), 0.9) == 0.5
    assert running_baseline(0.5, np.array([1.0, 1.0]), 0.9) == pytest.approx(0.9 * 0.5 + 0.1 * 1.0)
    assert running_baseline(0.5, np.array([1.0]), None) is None


def test_registering_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register("grpo", group_baseline=True)(lambda *a, **k: None)
    assert {"grpo", "dr_grpo", "rloo", "reinforce_batch_norm"} <= set(ESTIMATORS)


def test_token_advantages_broadcast_over_loss_mask():
    assert token_advantages(0.5, np.array([1, 0, 0, 1], np.int8)).tolist() == [0.5, 0, 0, 0.5]


def _loop(name, rewards, groups, eps):
    out = []
    for i, r in enumerate(rewards):
        g = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(g) / len(g)
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / len(g))
        if name == "grpo":
            out.append((r - mean) / (std + eps))
        elif name == "dr_grpo":
            out.append(r - mean)
        elif name == "rloo":
            out.append(r - (sum(g) - r) / (len(g) - 1) if len(g) > 1 else 0.0)
        else:
            bm = sum(rewards) / len(rewards)
            bs = math.sqrt(sum((x - bm) ** 2 for x in rewards) / len(rewards))
            out.append((r - bm) / (bs + eps))
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_batch_norm"])
@pytest.mark.parametrize("seed", range(5))
def test_vectorized_equals_reference_loop(name, seed):
    rng = np.random.default_rng(seed)
    groups = np.sort(rng.integers(0, 6, 40))
    groups = np.unique(groups, return_inverse=True)[1]
    rewards = rng.choice([0.0, 0.25, 1.0], size=40)
    got = compute_advantages(name, rewards, groups, eps=1e-6)
    assert got == pytest.approx(_loop(name, rewards.tolist(), groups.tolist(), 1e-6), abs=1e-9)
