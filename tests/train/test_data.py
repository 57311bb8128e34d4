"""Pre-training assertions name the trajectory; collate puts every token where the loss expects it."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.train.data import TrainDataError, check_members, collate, members_from_table
from pipeline.testing.train_fixtures import synthetic_payload


@pytest.fixture(scope="module")
def payload():
    return synthetic_payload(12, seed=3, vocab_size=64, median_len=16)


def test_valid_snapshot_passes(payload):
    check_members(members_from_table(payload), vocab_size=64)


@pytest.mark.parametrize("breakage,message", [
    ("all_masked", "no policy-sampled token"),
    ("short_logprobs", "rollout log-probs for"),
    ("short_mask", "loss_mask has"),
    ("mask_on_observation", "observation token"),
    ("logprob_off_mask", "at masked-out token"),
    ("vocab", "outside the model's vocabulary"),
    ("empty_response", "no response tokens"),
    ("nan_advantage", "not finite"),
])
def test_assertions_name_the_trajectory(payload, breakage, message):
    m = members_from_table(payload)
    i = 5
    if breakage == "all_masked":
        m.loss_mask[i][:] = 0
        m.rollout_logprobs[i][:] = 0
    elif breakage == "short_logprobs":
        m.rollout_logprobs[i] = m.rollout_logprobs[i][:-1]
    elif breakage == "short_mask":
        m.loss_mask[i] = m.loss_mask[i][:-1]
    elif breakage == "mask_on_observation":
        j = int(np.flatnonzero(m.token_versions[i] < 0)[0])
        m.loss_mask[i][j] = 1
    elif breakage == "logprob_off_mask":
        j = int(np.flatnonzero(m.loss_mask[i] == 0)[0])
        m.rollout_logprobs[i][j] = -0.5
    elif breakage == "vocab":
        m.response[i][0] = 64
    elif breakage == "empty_response":
        m.response[i] = m.response[i][:0]
    elif breakage == "nan_advantage":
        m.advantage[i] = np.nan
    with pytest.raises(TrainDataError, match=message) as exc:
        check_members(m, vocab_size=64)
    assert m.trajectory_id[i] in str(exc.value)


def test_group_count_must_match_receipt(payload):
    m = members_from_table(payload)
    g = m.group_id[0]
    with pytest.raises(TrainDataError, match="receipt lists 3 valid members"):
        check_members(m, vocab_size=64, valid_counts={g: 3})
    check_members(m, vocab_size=64, valid_counts={g: m.group_id.count(g)})


def test_collate_layout_by_hand():
    from pipeline.train.data import Members

    # member 0: prompt [5, 6], response [7, 8, 9] with mask [1, 0, 1] (8 is an observation)
    # member 1: prompt [4], response [3] mask [1]
    m = Members(trajectory_id=["a", "b"], group_id=["g", "g"], group_size=np.array([2, 2]),
                advantage=np.array([1.0, -1.0]), reward=np.array([1.0, 0.0]), policy_lag=np.array([0, 0]),
                prompt=[np.array([5, 6]), np.array([4])], response=[np.array([7, 8, 9]), np.array([3])],
                rollout_logprobs=[np.array([-0.1, 0, -0.3], np.float32), np.array([-0.2], np.float32)],
                loss_mask=[np.array([1, 0, 1], np.int8), np.array([1], np.int8)], token_versions=[None, None])
    b = collate(m, [0, 1], need=("rollout",))
    # L = 5, R = 3; input rows: [5 6 7 8 9], [4 3 0 0 0]
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [4, 3, 0, 0, 0]]
    # response token j of row b is predicted at flat position b*L + P_b - 1 + j; only loss tokens
    assert b["rows"].tolist() == [1, 3, 5]
    assert b["targets"].tolist() == [7, 9, 3]
    assert b["cols"].tolist() == [0, 2, 3]
    assert b["mask"].tolist() == [[1, 0, 1], [1, 0, 0]]
    assert b["advantages"].tolist() == [[1, 0, 1], [-1, 0, 0]]
    np.testing.assert_allclose(b["rollout"].numpy(), [[-0.1, 0, -0.3], [-0.2, 0, 0]], rtol=1e-6)
