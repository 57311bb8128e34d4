"""Length-bucketed micro-batches and the step plan (pure Python, no torch).

A micro-batch is a list of member indices, right-padded to its longest row;
its cost is rows x longest row (the ``micro_batch_tokens`` budget). Sorting by
length before filling keeps rows of similar length together, so padding stays
small on the lognormal length mix of agent rollouts (see bench_train).

The plan of an epoch is a list of optimizer steps, each ``grad_accum``
micro-batches; micro-batch ``i`` of a step runs on rank ``i % world_size``.
The plan depends on (lengths, budget, grad_accum, order, seed, epoch) only,
never on the world size, which is why N processes compute the same steps as one.

Which micro-batches share an optimizer step (``order``, the ``step_order`` key)
never changes the micro-batches themselves, so the padding is the same under
every order:

- ``stratified`` (default): the n packed micro-batches, in length order, are cut
  into ``grad_accum`` consecutive bands of floor or ceil(n / grad_accum)
  micro-batches (``numpy.array_split``; band 0 the longest rows), and each band
  is dealt to the S = ceil(n / grad_accum) steps by a seeded permutation (a band
  one short skips a random step). Every step holds one micro-batch of each length
  band, so its mean advantage is a whole-snapshot mix, not one stratum's (with
  ``grad_accum=1`` there is one band: a step is one micro-batch under any order);
- ``shuffled``: a seeded permutation of all micro-batches, cut into steps of
  ``grad_accum`` (a step may draw all its micro-batches from one band);
- ``length``: the pack order (longest first), cut into steps: each step trains
  one length stratum (the baseline of bench_train's step-order figures).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def pack_by_length(lengths: list[int] | np.ndarray, budget_tokens: int) -> list[list[int]]:
    """Indices grouped so that len(batch) * max(length in batch) <= budget
    (a row longer than the budget gets a batch of its own). Longest first;
    ties keep index order, so the result is deterministic."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order.tolist():
        n = int(lengths[i])
        new_max = max(cur_max, n)
        if cur and (len(cur) + 1) * new_max > budget_tokens:
            batches.append(cur)
            cur, new_max = [], n
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def naive_batches(lengths: list[int] | np.ndarray, rows_per_batch: int) -> list[list[int]]:
    """Baseline: fixed row count in arrival order."""
    n = len(lengths)
    return [list(range(i, min(i + rows_per_batch, n))) for i in range(0, n, rows_per_batch)]


def sorted_batches(lengths: list[int] | np.ndarray, rows_per_batch: int) -> list[list[int]]:
    """Baseline: sort by length (longest first), then fixed row count. No token budget:
    a batch of the longest rows may cost many times what a batch of short ones does."""
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable").tolist()
    return [order[i:i + rows_per_batch] for i in range(0, len(order), rows_per_batch)]


def bucketed_batches(lengths: list[int] | np.ndarray, budget_tokens: int) -> list[list[int]]:
    """Baseline: power-of-two length buckets, each with a fixed row count of
    ``budget_tokens // bucket bound`` (the usual bucket-by-sequence-length
    batching: within the same token budget, padding up to the bucket bound)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bound = np.left_shift(1, np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64))
    batches: list[list[int]] = []
    for b in np.unique(bound).tolist():
        idx = np.flatnonzero(bound == b).tolist()
        rows = max(1, budget_tokens // b)
        batches += [idx[i:i + rows] for i in range(0, len(idx), rows)]
    return batches


def batch_slots(lengths: list[int] | np.ndarray, batches: list[list[int]]) -> list[int]:
    """Token slots each batch computes: rows x its longest row (real tokens + padding)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return [len(b) * int(lengths[b].max()) for b in batches if b]


def padding_ratio(lengths: list[int] | np.ndarray, batches: list[list[int]]) -> float:
    """Padded slots / all slots over the batches."""
    real = sum(int(np.asarray(lengths, dtype=np.int64)[b].sum()) for b in batches)
    slots = sum(batch_slots(lengths, batches))
    return 0.0 if slots == 0 else 1.0 - real / slots


@dataclass(frozen=True)
class Step:
    epoch: int
    index: int                       # global optimizer step (0-based)
    micro_batches: tuple[tuple[int, ...], ...]

    def for_rank(self, rank: int, world_size: int) -> list[tuple[int, ...]]:
        """This rank's micro-batches, padded with empty ones so every rank runs
        the same number of forward/backward passes (ZeRO-2 reduces in backward)."""
        mine = [mb for i, mb in enumerate(self.micro_batches) if i % world_size == rank]
        per_rank = -(-len(self.micro_batches) // world_size)
        return mine + [()] * (per_rank - len(mine))


STEP_ORDERS = ("stratified", "shuffled", "length")


def epoch_groups(n_batches: int, grad_accum: int, order: str, rng: np.random.Generator) -> list[list[int]]:
    """Micro-batch indices (into the length-ordered pack) of each optimizer step of one epoch."""
    if order == "length":
        return [list(range(k, min(k + grad_accum, n_batches))) for k in range(0, n_batches, grad_accum)]
    if order == "shuffled":
        perm = rng.permutation(n_batches).tolist()
        return [perm[k:k + grad_accum] for k in range(0, n_batches, grad_accum)]
    if order != "stratified":
        raise ValueError(f"unknown step order {order!r}; one of {STEP_ORDERS}")
    n_steps = -(-n_batches // grad_accum)
    if n_steps == 0:
        return []
    groups: list[list[int]] = [[] for _ in range(n_steps)]
    for band in np.array_split(np.arange(n_batches), min(grad_accum, n_batches)):   # sizes differ by <= 1
        slots = rng.permutation(n_steps).tolist()[:len(band)]    # a short band: a random subset of the steps
        for mb, st in zip(band.tolist(), slots):
            groups[st].append(mb)
    return groups


def plan_steps(lengths: list[int] | np.ndarray, *, budget_tokens: int, grad_accum: int, epochs: int, seed: int,
               order: str = "stratified", max_steps: int = 0) -> list[Step]:
    """Every optimizer step of the run, in order; each epoch trains every micro-batch once."""
    batches = pack_by_length(lengths, budget_tokens)
    steps: list[Step] = []
    for epoch in range(epochs):
        rng = np.random.default_rng([seed, epoch])
        for group in epoch_groups(len(batches), grad_accum, order, rng):
            steps.append(Step(epoch, len(steps), tuple(tuple(batches[j]) for j in group)))
            if max_steps and len(steps) >= max_steps:
                return steps
    return steps
