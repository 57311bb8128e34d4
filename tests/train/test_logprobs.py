"""The chunked log-prob head equals the naive full-logits computation (values and grads)."""

from __future__ import annotations

import pytest
import torch

from pipeline.train.logprobs import naive_token_logprobs, token_logprobs


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk,vocab_chunk", [(7, 0), (16, 29), (1000, 64), (1, 50)])
def test_chunked_equals_naive(seed, chunk, vocab_chunk):
    g = torch.Generator().manual_seed(seed)
    N, H, V = 53, 24, 211
    hidden = (torch.randn(N, H, generator=g) * 0.7).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.3).requires_grad_(True)
    targets = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    lp, ent = naive_token_logprobs(hidden, weight, targets)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    ref = (lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None

    lp2, ent2 = token_logprobs(hidden, weight, targets, chunk=chunk, vocab_chunk=vocab_chunk)
    ((lp2 * g_lp).sum() + (ent2 * g_ent).sum()).backward()
    for got, want in zip((lp2.detach(), ent2.detach(), hidden.grad, weight.grad), ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_float64_is_exact():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (40,), generator=g)
    lp, ent = naive_token_logprobs(hidden, weight, targets)
    (lp.sum() - ent.sum()).backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp2, ent2 = token_logprobs(hidden, weight, targets, chunk=9, vocab_chunk=11)
    (lp2.sum() - ent2.sum()).backward()
    for got, want in ((lp2, lp), (ent2, ent), (hidden.grad, gh), (weight.grad, gw)):
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-10, rtol=0)


def test_only_logprob_grad_when_entropy_unused():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(10, 6, generator=g, requires_grad=True)
    weight = torch.randn(30, 6, generator=g, requires_grad=True)
    targets = torch.randint(0, 30, (10,), generator=g)
    lp, _ = token_logprobs(hidden, weight, targets, chunk=3)
    lp.sum().backward()
    ref = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    gh = torch.autograd.grad(-ref, hidden)[0]
    torch.testing.assert_close(hidden.grad, gh, atol=1e-5, rtol=1e-5)


def test_policy_wrapper_matches_hf_logits():
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.train.model import PolicyLogprobs

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    ids = torch.randint(0, 97, (2, 12))
    rows = torch.tensor([3, 4, 5, 12 + 7, 12 + 10])         # positions predicting the next token
    targets = ids.reshape(-1)[rows + 1]
    lp, _ = PolicyLogprobs(lm, chunk=2)(ids, rows, targets)
    full = torch.log_softmax(lm(input_ids=ids).logits.float(), -1).reshape(-1, 97)
    torch.testing.assert_close(lp, full[rows, targets], atol=1e-5, rtol=1e-5)
