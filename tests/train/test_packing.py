"""Length-bucketed micro-batches: budget, determinism, padding, world-size independence, step order."""

from __future__ import annotations

import numpy as np
import pytest

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


# -- step order: which micro-batches share an optimizer step ----------------------------------------
def _lengths_and_advantages(n=240, seed=0):
    """Agent-like mix: long responses mostly fail (negative advantage), short ones succeed."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(4, rng.lognormal(np.log(60), 0.7, n)).astype(int)
    adv = np.where(lengths > np.median(lengths), -1.0, 1.0) + rng.normal(0, 0.3, n)
    return lengths, adv


@pytest.mark.parametrize("order", ["stratified", "shuffled", "length"])
def test_every_row_is_trained_exactly_once_per_epoch_under_every_order(order):
    lengths, _ = _lengths_and_advantages()
    steps = plan_steps(lengths, budget_tokens=512, grad_accum=4, epochs=3, seed=7, order=order)
    assert [s.index for s in steps] == list(range(len(steps)))
    for epoch in range(3):
        rows = [i for s in steps if s.epoch == epoch for mb in s.micro_batches for i in mb]
        assert sorted(rows) == list(range(len(lengths)))
    n_mb = len(pack_by_length(lengths, 512))
    assert len(steps) == 3 * -(-n_mb // 4)          # the same number of optimizer steps under every order


def test_step_order_is_seeded():
    lengths, _ = _lengths_and_advantages()
    a = plan_steps(lengths, budget_tokens=512, grad_accum=4, epochs=2, seed=1)
    assert a == plan_steps(lengths, budget_tokens=512, grad_accum=4, epochs=2, seed=1)
    assert a != plan_steps(lengths, budget_tokens=512, grad_accum=4, epochs=2, seed=2)
    assert [s.micro_batches for s in a if s.epoch == 0] != [s.micro_batches for s in a if s.epoch == 1]
    # length order is the pack order: no seed in it
    assert plan_steps(lengths, budget_tokens=512, grad_accum=4, epochs=1, seed=1, order="length") == \
        plan_steps(lengths, budget_tokens=512, grad_accum=4, epochs=1, seed=2, order="length")
    with pytest.raises(ValueError, match="unknown step order"):
        plan_steps(lengths, budget_tokens=512, grad_accum=4, epochs=1, seed=1, order="random")


def _step_means(steps, adv):
    return np.array([adv[[i for mb in s.micro_batches for i in mb]].mean() for s in steps])


def test_stratified_steps_mix_lengths_and_keep_the_padding():
    lengths, adv = _lengths_and_advantages()
    plans = {o: plan_steps(lengths, budget_tokens=512, grad_accum=4, epochs=1, seed=3, order=o)
             for o in ("stratified", "shuffled", "length")}
    spread = {o: float(_step_means(p, adv).std()) for o, p in plans.items()}
    assert spread["stratified"] < 0.5 * spread["length"], spread
    flips = {o: int((np.diff(np.sign(_step_means(p, adv))) != 0).sum()) for o, p in plans.items()}
    assert flips["length"] == 1                      # + for the short strata, - for the long ones: one flip
    # every stratified step holds one micro-batch of each length band (a band one short skips one step)
    pack = [tuple(b) for b in pack_by_length(lengths, 512)]
    band_of = {j: k for k, band in enumerate(np.array_split(np.arange(len(pack)), 4)) for j in band.tolist()}
    for s in plans["stratified"]:
        bands = sorted(band_of[pack.index(mb)] for mb in s.micro_batches)
        assert len(bands) == len(set(bands)) >= 3
    # the same micro-batches under every order: the padding figures do not move
    for p in plans.values():
        mbs = [list(mb) for s in p for mb in s.micro_batches]
        assert sorted(map(tuple, mbs)) == sorted(pack)
        assert padding_ratio(lengths, mbs) == padding_ratio(lengths, [list(b) for b in pack])
