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


def test_turn_advantages_by_hand():
    """Process-supervision GRPO (DeepSeekMath 4.1.3): normalize every turn reward by its group's
    turn-reward mean and population std, then sum the normalized rewards of this and later turns."""
    from pipeline.admission.advantages import turn_advantages, turn_token_advantages

    # group 0: member a turns (1, 0), member b turns (0, 0, 1); group 1: c (2,), d (0, 0)
    got = turn_advantages([np.array([1.0, 0.0]), np.array([0.0, 0.0, 1.0]), np.array([2.0]),
                           np.array([0.0, 0.0])], np.array([0, 0, 1, 1]), eps=0.0)
    # group 0: rewards 1,0,0,0,1 -> mean .4, population std sqrt((.36*2 + .16*3)/5) = sqrt(.24)
    s0 = math.sqrt(0.24)
    a = [0.6 / s0, -0.4 / s0]
    b = [-0.4 / s0, -0.4 / s0, 0.6 / s0]
    assert got[0] == pytest.approx([a[0] + a[1], a[1]])                  # [0.2/s0, -0.4/s0]
    assert got[1] == pytest.approx([b[0] + b[1] + b[2], b[1] + b[2], b[2]])
    # group 1: rewards 2,0,0 -> mean 2/3, std sqrt((16/9 + 4/9 + 4/9)/3) = sqrt(8/9)
    s1 = math.sqrt(8 / 9)
    assert got[2] == pytest.approx([(4 / 3) / s1])
    assert got[3] == pytest.approx([-(4 / 3) / s1, -(2 / 3) / s1])
    # one turn per member: the group-normalized outcome reward, i.e. GRPO itself
    one = turn_advantages([np.array([r]) for r in (1.0, 0.0, 0.0, 1.0)], np.array([0, 0, 0, 0]), eps=0.0)
    assert [float(x[0]) for x in one] == adv("grpo", [1, 0, 0, 1], [0, 0, 0, 0])
    # tokens: policy run k gets turn k's advantage, observations 0
    mask = np.array([1, 1, 0, 0, 1, 0, 1, 1], np.int8)
    assert turn_token_advantages(np.array([3.0, 2.0, 1.0]), mask).tolist() == [3, 3, 0, 0, 2, 0, 1, 1]
    with pytest.raises(ValueError, match="2 turn advantages for 3 policy turns"):
        turn_token_advantages(np.array([3.0, 2.0]), mask)
    with pytest.raises(ValueError, match="member 1: turn rewards must be a non-empty list of finite numbers"):
        turn_advantages([np.array([1.0]), np.array([])], np.array([0, 0]), eps=0.0)


def test_turn_rewards_land_outside_the_hash_and_are_validated(lake):
    """The contract field an environment fills: one finite reward per policy turn; not hashed."""
    import pyarrow as pa

    from pipeline.ingest import ingest_table
    from pipeline.lake.contenthash import content_hashes
    from pipeline.testing.trajectories import make_trajectories

    t = make_trajectories(3, seed=1, group_size=3, with_hash=False)
    before = content_hashes(t).to_pylist()
    i = t.schema.get_field_index("turn_rewards")
    t = t.set_column(i, t.schema.field(i), pa.array([[0.0, 1.0], [float("nan")], None], pa.list_(pa.float64())))
    assert content_hashes(t).to_pylist() == before           # hashed: false (hash version 1 unchanged)
    rep = ingest_table(lake, t)
    assert (rep.landed, rep.quarantined, rep.reasons) == (2, 1, {"not_finite": 1})
    got = {r["trajectory_id"]: r["turn_rewards"] for r in lake.read("trajectories").to_pylist()}
    assert sorted(got.values(), key=str) == [None, [0.0, 1.0]]
