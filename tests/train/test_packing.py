"""Length-bucketed micro-batches: budget, determinism, padding, world-size independence."""

from __future__ import annotations

import numpy as np

from pipeline.testing.trajectories import response_lengths
from pipeline.train.packing import (batch_slots, bucketed_batches, naive_batches, pack_by_length, padding_ratio,
                                    plan_steps, sorted_batches)


def test_budget_and_cover():
    lengths = [5, 100, 7, 30, 30, 31, 2, 64, 64, 10]
    batches = pack_by_length(lengths, 128)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) * max(lengths[i] for i in b) <= 128 or len(b) == 1
    assert pack_by_length(lengths, 128) == batches


def test_oversized_row_gets_its_own_batch():
    assert pack_by_length([300, 10, 10], 100) == [[0], [1, 2]]


def test_hand_worked_padding_ratio():
    # batches [4, 2] -> slots 2 x 4 = 8, real 6; [3] -> 3/3: ratio = 1 - 9/11
    assert padding_ratio([4, 2, 3], [[0, 1], [2]]) == 1 - 9 / 11


def test_packer_pads_far_less_than_arrival_order_on_lognormal_mix():
    rng = np.random.default_rng(0)
    lengths = response_lengths(rng, 2000, median_len=300, sigma=1.0, max_len=4096)
    packed = pack_by_length(lengths, 16384)
    naive = naive_batches(lengths, max(1, round(len(lengths) / len(packed))))
    assert padding_ratio(lengths, packed) < 0.5 * padding_ratio(lengths, naive)


def test_benchmark_baselines_by_hand():
    lengths = [5, 100, 7, 30, 31, 2]
    assert sorted_batches(lengths, 2) == [[1, 4], [3, 2], [0, 5]]
    # bounds 8, 128, 8, 32, 32, 2; budget 64 -> rows 8, 0 -> 1, 8, 2, 2, 32
    assert bucketed_batches(lengths, 64) == [[5], [0, 2], [3, 4], [1]]
    assert batch_slots(lengths, [[5], [0, 2], [3, 4], [1]]) == [2, 14, 62, 100]


def test_plan_is_independent_of_world_size_and_ranks_stay_in_lockstep():
    lengths = list(range(3, 40))
    steps = plan_steps(lengths, budget_tokens=64, grad_accum=3, epochs=2, seed=1)
    assert [s.index for s in steps] == list(range(len(steps)))
    assert {s.epoch for s in steps} == {0, 1}
    for s in steps:
        for W in (1, 2, 3):
            per_rank = [s.for_rank(r, W) for r in range(W)]
            assert len({len(x) for x in per_rank}) == 1
            assert sorted(i for x in per_rank for mb in x for i in mb) == sorted(i for mb in s.micro_batches for i in mb)
    assert plan_steps(lengths, budget_tokens=64, grad_accum=3, epochs=2, seed=1) == steps
    assert plan_steps(lengths, budget_tokens=64, grad_accum=3, epochs=2, seed=2) != steps
    assert len(plan_steps(lengths, budget_tokens=64, grad_accum=3, epochs=2, seed=1, max_steps=2)) == 2
