"""Rollout health metrics as pure functions (numpy only).

The named queries in sql/ compute the same numbers in SQL; tests/query checks
that both agree, so a chart in the report and a number in a notebook never
disagree.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> np.ndarray | float:
    """Unbiased pass@k of one problem sampled ``n`` times with ``c`` correct.

    pass@k = 1 - C(n-c, k) / C(n, k)  (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1). The binomials overflow for
    realistic n, so we use the paper's product form
    C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), every factor in (0, 1],
    and pass@k = 1 exactly when fewer than k samples are wrong (n - c < k).
    Vectorized over ``n`` and ``c``; ``k`` must be <= every n.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n_arr = np.asarray(n, dtype=np.int64)
    c_arr = np.asarray(c, dtype=np.int64)
    n_b, c_b = np.broadcast_arrays(n_arr, c_arr)
    if np.any(n_b < k):
        raise ValueError(f"pass@{k} needs at least {k} samples per problem (got n={int(n_b.min())})")
    if np.any((c_b < 0) | (c_b > n_b)):
        raise ValueError("c must lie in [0, n]")
    out = np.empty(n_b.shape, dtype=np.float64)
    for idx in np.ndindex(n_b.shape):
        ni, ci = int(n_b[idx]), int(c_b[idx])
        if ni - ci < k:
            out[idx] = 1.0
        else:
            i = np.arange(ni - ci + 1, ni + 1, dtype=np.float64)  # [c]
            out[idx] = 1.0 - float(np.prod(1.0 - k / i))
    return float(out) if out.ndim == 0 else out


def mean_pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> float:
    """pass@k averaged over problems that have at least ``k`` samples (NaN when none)."""
    n_arr = np.asarray(n, dtype=np.int64)
    c_arr = np.asarray(c, dtype=np.int64)
    keep = n_arr >= k
    if not keep.any():
        return float("nan")
    return float(np.mean(pass_at_k(n_arr[keep], c_arr[keep], k)))


def mixed_group_probability(p: ArrayLike, group_size: ArrayLike) -> np.ndarray | float:
    """Probability that a group of ``group_size`` independent samples, each
    succeeding with probability ``p``, holds both a success and a failure:
    1 - p^G - (1-p)^G. Only mixed groups give GRPO a non-zero advantage.

    1 - (1-p)^G is computed as -expm1(G * log1p(-p)) so small p keeps its
    digits (the naive form cancels catastrophically for p ~ 1e-9).
    For p = 0.2, G = 8: 1 - 0.2^8 - 0.8^8 = 0.83222528.
    """
    p_arr = np.asarray(p, dtype=np.float64)
    g_arr = np.asarray(group_size, dtype=np.float64)
    if np.any((p_arr < 0) | (p_arr > 1)):
        raise ValueError("p must lie in [0, 1]")
    if np.any(g_arr < 1):
        raise ValueError("group_size must be >= 1")
    with np.errstate(divide="ignore"):
        some_success = -np.expm1(g_arr * np.log1p(-p_arr))  # 1 - (1-p)^G
    out = np.maximum(some_success - p_arr ** g_arr, 0.0)
    return float(out) if out.ndim == 0 else out


def group_outcome(passes: int, valid: int) -> str:
    """``mixed`` / ``all_correct`` / ``all_wrong`` for a group with ``valid``
    evaluated members of which ``passes`` passed; ``too_few`` below 2 members."""
    if valid < 2:
        return "too_few"
    if passes == valid:
        return "all_correct"
    if passes == 0:
        return "all_wrong"
    return "mixed"
