"""pass@k and the mixed-group probability against values worked out by hand."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from pipeline.query.metrics import group_outcome, mean_pass_at_k, mixed_group_probability, pass_at_k


def test_mixed_group_probability_by_hand():
    # p = 0.2, G = 8: 1 - 0.2^8 - 0.8^8 = 1 - 0.00000256 - 0.16777216 = 0.83222528
    assert mixed_group_probability(0.2, 8) == pytest.approx(0.83222528, abs=1e-12)
    # G = 2: mixed iff one success and one failure: 2 p (1-p); p = 0.5 -> 0.5
    assert mixed_group_probability(0.5, 2) == pytest.approx(0.5, abs=1e-15)
    # a single sample is never mixed; p = 0 or 1 never mixed
    assert mixed_group_probability(0.3, 1) == pytest.approx(0.0, abs=1e-15)
    assert mixed_group_probability(0.0, 8) == 0.0
    assert mixed_group_probability(1.0, 8) == 0.0


def test_mixed_group_probability_small_p_keeps_digits():
    # 1 - p^G - (1-p)^G ~ G p for tiny p; the naive form loses most digits at 1e-12
    p, g = 1e-12, 8
    exact = g * p - comb(g, 2) * p**2  # binomial expansion, the p^2 term is far below 1 ulp
    assert mixed_group_probability(p, g) == pytest.approx(exact, rel=1e-9)


def test_mixed_group_probability_vectorized_and_bounds():
    got = mixed_group_probability(np.array([0.2, 0.5]), np.array([8, 2]))
    assert np.allclose(got, [0.83222528, 0.5])
    with pytest.raises(ValueError):
        mixed_group_probability(1.5, 4)
    with pytest.raises(ValueError):
        mixed_group_probability(0.5, 0)


def test_pass_at_k_by_hand():
    # n = 10, c = 3, k = 2: 1 - C(7,2)/C(10,2) = 1 - 21/45 = 8/15
    assert pass_at_k(10, 3, 2) == pytest.approx(8 / 15, abs=1e-15)
    # k = 1 is the plain success rate c / n
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8, abs=1e-15)
    # fewer than k wrong samples: every k-subset holds a correct one
    assert pass_at_k(5, 4, 2) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0
    # n = k: pass@n is 1 if any sample is correct
    assert pass_at_k(4, 1, 4) == 1.0


@pytest.mark.parametrize("n,c,k", [(n, c, k) for n in (1, 2, 5, 16, 40) for c in range(0, n + 1, max(1, n // 4))
                                   for k in (1, 2, 5) if k <= n])
def test_pass_at_k_equals_binomial_formula(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_stable_where_binomials_overflow_floats():
    # C(2000, 100) ~ 1e170 and C(1990, 100) too: fine in exact integers, the
    # product form must match them without ever forming the binomials.
    n, c, k = 2000, 10, 100
    exact = 1 - comb(n - c, k) / comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-10)
    assert np.isfinite(pass_at_k(5000, 2500, 400))


def test_pass_at_k_vectorized_and_mean():
    n = np.array([4, 4, 8, 2])
    c = np.array([0, 2, 8, 1])
    got = pass_at_k(n[:3], c[:3], 2)
    assert np.allclose(got, [0.0, 1 - comb(2, 2) / comb(4, 2), 1.0])
    # groups with n < k are left out of the mean: only the first three count for k = 3
    assert mean_pass_at_k(n, c, 3) == pytest.approx(np.mean([0.0, 1.0, 1.0]))
    assert np.isnan(mean_pass_at_k([1, 2], [1, 1], 3))
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_group_outcome():
    assert group_outcome(0, 4) == "all_wrong"
    assert group_outcome(4, 4) == "all_correct"
    assert group_outcome(1, 4) == "mixed"
    assert group_outcome(1, 1) == "too_few"
