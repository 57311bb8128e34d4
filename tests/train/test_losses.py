"""Loss values worked out by hand; gradients only through masked-in, unclipped tokens."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.train import losses as L

# Two sequences, T = 3, old log-probs 0, so ratio = exp(logp):
#   seq 0: ratios [1.5, 0.5, 1.0], mask [1, 1, 1], advantage +1
#   seq 1: ratios [1.1, 2.0, 1.0], mask [1, 1, 0], advantage -1
RATIOS = [[1.5, 0.5, 1.0], [1.1, 2.0, 1.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
ADV = torch.tensor([[1.0], [-1.0]], dtype=torch.float64) * MASK


def _inputs():
    logp = torch.log(torch.tensor(RATIOS, dtype=torch.float64)).requires_grad_(True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    return logp, old


# Per-token loss max(-A r, -A clip(r, 0.8, 1.2)):
#   seq 0 (A=+1): r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped above); r=0.5 -> max(-0.5, -0.8) = -0.5; r=1 -> -1.0
#   seq 1 (A=-1): r=1.1 -> 1.1; r=2.0 -> max(2.0, 1.2) = 2.0; third token masked out
#   sums: seq 0 = -2.7 (3 tokens), seq 1 = 3.1 (2 tokens), all = 0.4 (5 tokens)
@pytest.mark.parametrize("agg,expected", [
    ("token-mean", 0.4 / 5),                      # 0.08
    ("seq-mean-token-mean", (-2.7 / 3 + 3.1 / 2) / 2),  # (-0.9 + 1.55) / 2 = 0.325
    ("seq-mean-token-sum", (-2.7 + 3.1) / 2),     # 0.2
    ("seq-mean-token-sum-norm", 0.4 / (2 * 3)),   # Dr.GRPO: / (B * L), L = T = 3
])
def test_policy_loss_each_agg(agg, expected):
    logp, old = _inputs()
    loss, m = L.policy_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.2, agg=agg)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-12)
    assert m["clip_frac_high"] == pytest.approx(1 / 5)   # seq 0, token 0
    assert m["clip_frac_low"] == 0.0


def test_gradients_only_through_masked_in_unclipped_tokens():
    logp, old = _inputs()
    loss, _ = L.policy_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.2, agg="token-mean")
    loss.backward()
    # d/dlogp of -A r / 5 = -A r / 5 where unclipped; 0 where clipped (seq 0 tok 0) or masked (seq 1 tok 2)
    expected = torch.tensor([[0.0, -0.5 / 5, -1.0 / 5], [1.1 / 5, 2.0 / 5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)


def test_clip_higher_dapo():
    # clip_high = 0.6: r = 1.5 < 1.6 is no longer clipped: seq 0 token 0 contributes -1.5
    logp, old = _inputs()
    loss, m = L.policy_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.6, agg="token-mean")
    assert float(loss.detach()) == pytest.approx((-1.5 - 0.5 - 1.0 + 1.1 + 2.0) / 5, abs=1e-12)  # 0.02
    assert m["clip_frac_high"] == 0.0


def test_clip_low_counts_negative_advantages():
    # A = -1, r = 0.5: max(0.5, 0.8) = 0.8, clipped below; r = 1 -> 1.0
    logp = torch.log(torch.tensor([[0.5, 1.0]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, m = L.policy_loss(logp, torch.zeros(1, 2, dtype=torch.float64), -mask, mask, clip_low=0.2, clip_high=0.2)
    assert float(loss.detach()) == pytest.approx((0.8 + 1.0) / 2)
    assert m["clip_frac_low"] == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.5]], dtype=torch.float64))


def test_gspo_sequence_ratio():
    # seq 0: s = (1.5 * 0.5 * 1.0)^(1/3) = 0.75^(1/3) = 0.908560; within [0.8, 1.2]: tokens -0.908560
    # seq 1: s = (1.1 * 2.0)^(1/2) = 2.2^(1/2) = 1.483240; A = -1: max(1.48324, 1.2) = 1.48324
    # seq-mean-token-mean: (-0.908560 + 1.483240) / 2 = 0.287340
    logp, old = _inputs()
    loss, _ = L.policy_loss(logp, old, ADV, MASK, clip_low=0.2, clip_high=0.2, ratio_level="sequence",
                            agg="seq-mean-token-mean")
    s0, s1 = 0.75 ** (1 / 3), 2.2 ** 0.5
    assert float(loss.detach()) == pytest.approx((-s0 + s1) / 2, abs=1e-12)
    loss.backward()
    # GSPO gradient: -A s_i / |y_i| / B per token of sequence i
    expected = torch.tensor([[-s0 / 3 / 2] * 3, [s1 / 2 / 2, s1 / 2 / 2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected, atol=1e-12, rtol=0)


def test_gspo_clips_whole_sequences():
    # seq 1 with A = +1: s = 1.48324 > 1.2: every token clipped, no gradient
    logp, old = _inputs()
    adv = torch.tensor([[1.0], [1.0]], dtype=torch.float64) * MASK
    loss, m = L.policy_loss(logp, old, adv, MASK, clip_low=0.2, clip_high=0.2, ratio_level="sequence",
                            agg="seq-mean-token-mean")
    assert float(loss.detach()) == pytest.approx((-(0.75 ** (1 / 3)) - 1.2) / 2, abs=1e-12)
    assert m["clip_frac_high"] == pytest.approx(2 / 5)
    loss.backward()
    assert torch.all(logp.grad[1] == 0)


@pytest.mark.parametrize("kind,expected", [
    # logp = [-1, -2], ref = [-1.5, -1]: u = ref - logp = [-0.5, 1.0]
    ("k1", [0.5, -1.0]),                                   # -u
    ("k2", [0.125, 0.5]),                                  # u^2 / 2
    ("k3", [math.exp(-0.5) + 0.5 - 1, math.e - 1 - 1]),    # e^u - u - 1 = [0.106531, 0.718282]
])
def test_kl_kinds(kind, expected):
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    torch.testing.assert_close(L.kl_penalty(logp, ref, kind), torch.tensor([expected], dtype=torch.float64))


def test_k3_is_non_negative_and_zero_at_equality():
    a = torch.randn(4, 7, dtype=torch.float64)
    b = torch.randn(4, 7, dtype=torch.float64)
    assert (L.kl_penalty(a, b, "k3") >= 0).all()
    assert torch.all(L.kl_penalty(a, a, "k3") == 0)


def test_reinforce_no_ratio():
    # -A logp token-mean: seq 0 (A=+1): logp [-1, -2] -> 1 + 2; seq 1 (A=-1): [-0.5] -> -0.5 ; / 3 tokens
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64) * mask
    loss, _ = L.POLICY_LOSSES["reinforce"](logp, None, adv, mask, agg="token-mean")
    assert float(loss.detach()) == pytest.approx((1 + 2 - 0.5) / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 3, -1 / 3], [1 / 3, 0.0]], dtype=torch.float64))


def test_entropy_bonus():
    ent = torch.tensor([[2.0, 4.0], [6.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    # -0.1 * (2 + 4 + 6) / 3 = -0.4
    assert float(L.entropy_bonus(ent, mask, coef=0.1)) == pytest.approx(-0.4)


def test_truncated_is_weights():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.25, 0.9, 0.5]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    # ratios 2.0 (capped at 1.5), 1.0; masked-out token weight 1
    torch.testing.assert_close(L.truncated_is_weights(old, rollout, mask, 1.5),
                               torch.tensor([[1.5, 1.0, 1.0]], dtype=torch.float64))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_with_step_norm_sum_to_the_full_batch(agg):
    torch.manual_seed(0)
    logp = torch.randn(6, 5, dtype=torch.float64) * 0.1
    old = logp + torch.randn(6, 5, dtype=torch.float64) * 0.1
    adv = torch.randn(6, 1, dtype=torch.float64).expand(6, 5).clone()
    mask = (torch.rand(6, 5) > 0.3).double()
    mask[:, 0] = 1
    full, _ = L.policy_loss(logp, old, adv, mask, agg=agg, norm=L.batch_norm(mask, 5))
    norm = L.Norm(float(mask.sum()), 6.0, 5.0)
    parts = sum(L.policy_loss(logp[s], old[s], adv[s], mask[s], agg=agg, norm=norm)[0]
                for s in (slice(0, 2), slice(2, 5), slice(5, 6)))
    assert float(parts) == pytest.approx(float(full), abs=1e-12)


def test_registry_refuses_duplicates():
    with pytest.raises(ValueError, match="registered twice"):
        L.register_policy_loss("ppo")(lambda *a, **k: None)
    assert set(L.POLICY_LOSSES) >= {"ppo", "reinforce"}
