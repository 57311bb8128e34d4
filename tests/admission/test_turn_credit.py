"""Per-turn credit end to end (advantage grpo_turn): turn_rewards landed with the
trajectories -> turn_advantages in the snapshot payload (group-normalized turn
rewards summed to go, DeepSeekMath 4.1.3) -> each turn's tokens in the trainer's
batch and in the public reader's collate. A group lacking complete turn rewards
trains on its sequence-level advantage; the default estimator's snapshot has no
such column."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit
from pipeline.lake.delta import Lake

from admission_rows import NOW, land, traj


def _row(tid, gid, reward, mask, turn_rewards):
    r = traj(tid, gid, reward=reward, group_size=2, response_len=len(mask))
    r.update(loss_mask=mask, response_logprobs=[-0.5 if m else 0.0 for m in mask],
             token_policy_versions=[5 if m else -1 for m in mask], num_turns=sum(
                 1 for j, m in enumerate(mask) if m and (j == 0 or not mask[j - 1])), turn_rewards=turn_rewards)
    return r


ROWS = [
    _row("a", "g1", 1.0, [1, 1, 0, 1], [1.0, 0.0]),                  # 2 turns
    _row("b", "g1", 0.0, [1, 0, 0, 1, 1, 0, 1], [0.0, 0.0, 1.0]),    # 3 turns
    _row("c", "g2", 1.0, [1, 1], [2.0]),
    _row("d", "g2", 0.0, [1, 0, 1], None),                           # no turn rewards: g2 falls back
]


def _admitted(tmp_path, advantage):
    lake = Lake(tmp_path / advantage)
    land(lake, ROWS)
    res = admit(lake, AdmissionConfig(advantage=advantage, eps=0.0, quality=False), current_policy_version=5,
                now=NOW)
    assert res.snapshot_id and sorted(res.members.column("trajectory_id").to_pylist()) == ["a", "b", "c", "d"]
    return lake, res.snapshot_id


def test_turn_advantages_reach_the_trainer_by_hand(tmp_path):
    import pipeline.snapshots
    from pipeline.train.data import check_members, collate, load_members

    lake, sid = _admitted(tmp_path, "grpo_turn")
    snap = pipeline.snapshots.open(lake, sid)
    assert snap.manifest["turn_credit"] is True and "turn_advantages" in snap.columns
    t = snap.table()
    got = dict(zip(t.column("trajectory_id").to_pylist(), t.column("turn_advantages").to_pylist()))
    # g1 turn rewards 1,0 | 0,0,1: mean .4, population std sqrt(.24); normalized .6,-.4 | -.4,-.4,.6; summed to go
    s = math.sqrt(0.24)
    assert got["a"] == pytest.approx([0.2 / s, -0.4 / s])
    assert got["b"] == pytest.approx([-0.2 / s, 0.2 / s, 0.6 / s])
    assert got["c"] is None and got["d"] is None          # d has no turn rewards: g2 keeps grpo's +-1
    seq = dict(zip(t.column("trajectory_id").to_pylist(), t.column("advantage").to_pylist()))
    assert seq == pytest.approx({"a": 1.0, "b": -1.0, "c": 1.0, "d": -1.0})   # grpo over the scalar rewards
    # the trainer's batch: turn k's advantage on turn k's tokens, 0 on observations
    m, _ = load_members(lake, sid)
    check_members(m, vocab_size=64)
    order = m.trajectory_id
    b = collate(m, list(range(len(m))))
    adv = b["advantages"].numpy()
    ia, ib, idd = order.index("a"), order.index("b"), order.index("d")
    assert adv[ia, :4] == pytest.approx(np.float32([0.2 / s, 0.2 / s, 0, -0.4 / s]))
    assert adv[ib, :7] == pytest.approx(np.float32([-0.2 / s, 0, 0, 0.2 / s, 0.2 / s, 0, 0.6 / s]))
    assert adv[idd, :3].tolist() == [-1.0, 0.0, -1.0]
    # the public reader's collate (any trainer) places them the same way, at input positions
    ds = snap.dataset()
    items = [ds[i] for i in range(len(ds))]
    rb = pipeline.snapshots.collate(items)
    i = rb["trajectory_id"].index("b")
    p = len(items[i]["prompt_ids"])
    assert rb["advantages"][i, p:p + 7].numpy() == pytest.approx(adv[ib, :7])


def test_the_default_estimator_has_no_turn_column(tmp_path):
    import pipeline.snapshots

    lake, sid = _admitted(tmp_path, "grpo")
    snap = pipeline.snapshots.open(lake, sid)
    assert "turn_credit" not in snap.manifest and snap.columns == pipeline.snapshots.MEMBER_COLUMNS
    assert "turn_advantages" not in snap.table().column_names
