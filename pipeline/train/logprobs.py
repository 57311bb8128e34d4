"""Token log-probs and entropies without materializing [N, V] logits.

``token_logprobs(hidden, weight, targets)`` computes, for each row n,
``log softmax(hidden[n] @ weight.T)[targets[n]]`` and the entropy of that
softmax, ``chunk`` rows at a time (and ``vocab_chunk`` columns at a time, with
an online log-sum-exp), in float32. Only the row's log-sum-exp and entropy are
saved; backward recomputes each chunk's logits (FlashREINFORCE / Liger's fused
linear cross-entropy idea), so peak memory is O(chunk x V) instead of O(N x V)
in forward *and* backward.

Gradients (z = logits of one row, p = softmax(z), H = entropy, g/h = upstream
grads of the log-prob and entropy):
    d logp_y / dz = onehot(y) - p
    d H / dz      = -p * (log p + H)
so dz = g * (onehot(y) - p) - h * p * (log p + H); dhidden = dz @ W, dW = dz.T @ hidden.
"""

from __future__ import annotations

import torch


def naive_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: full logits. hidden [N, H], weight [V, H], targets [N] -> ([N], [N])."""
    logits = hidden.to(_cdt(hidden)) @ weight.to(_cdt(hidden)).T                              # [N, V]
    logp_all = torch.log_softmax(logits, dim=-1)                             # [N, V]
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)                 # [N]
    entropy = -(logp_all.exp() * logp_all).sum(-1)                           # [N]
    return logp, entropy


def _cdt(t: torch.Tensor) -> torch.dtype:
    """Compute dtype: float32, or float64 for float64 inputs (exact reference tests)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _row_stats(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, vocab_chunk: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a row chunk: (logsumexp [C], sum_v p*z [C], z_y [C]), online over vocab chunks."""
    V = w.shape[0]
    step = vocab_chunk if vocab_chunk and vocab_chunk < V else V
    m = torch.full((h.shape[0],), -float("inf"), dtype=h.dtype, device=h.device)   # running max [C]
    s = torch.zeros_like(m)                                                   # sum e^(z-m) [C]
    t = torch.zeros_like(m)                                                   # sum e^(z-m) * z [C]
    zy = torch.zeros_like(m)                                                  # target logit [C]
    for v0 in range(0, V, step):
        z = h @ w[v0:v0 + step].to(h.dtype).T                                     # [C, Vc]
        inside = (y >= v0) & (y < v0 + step)                                  # [C]
        if inside.any():
            idx = (y - v0).clamp(0, z.shape[1] - 1)
            zy = torch.where(inside, z.gather(-1, idx[:, None]).squeeze(-1), zy)
        m_new = torch.maximum(m, z.max(-1).values)                            # [C]
        scale = torch.exp(m - m_new)                                          # [C]
        z.sub_(m_new[:, None])                                                # z - m, in place  [C, Vc]
        e = torch.exp(z)                                                      # [C, Vc]
        s_c = e.sum(-1)                                                       # [C]
        # sum e*z without a third [C, Vc] buffer; z was shifted by m_new
        t_c = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1) + m_new * s_c
        s = s * scale + s_c
        t = t * scale + t_c
        m = m_new
    lse = m + torch.log(s)                                                    # [C]
    return lse, t / s, zy


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, vocab_chunk: int):
        N, cdt = hidden.shape[0], _cdt(hidden)
        logp = torch.empty(N, dtype=cdt, device=hidden.device)     # [N]
        ent = torch.empty_like(logp)                                          # [N]
        lse_all = torch.empty_like(logp)                                      # [N]
        for i in range(0, N, chunk):
            h = hidden[i:i + chunk].to(cdt)                                   # [C, H]
            lse, pz, zy = _row_stats(h, weight, targets[i:i + chunk], vocab_chunk)
            logp[i:i + chunk] = zy - lse
            ent[i:i + chunk] = lse - pz                                       # H = lse - sum p z
            lse_all[i:i + chunk] = lse
        ctx.save_for_backward(hidden, weight, targets, lse_all, ent)
        ctx.chunk, ctx.vocab_chunk = chunk, vocab_chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse_all, ent = ctx.saved_tensors
        chunk, vocab_chunk = ctx.chunk, ctx.vocab_chunk
        N, V, cdt = hidden.shape[0], weight.shape[0], _cdt(hidden)
        step = vocab_chunk if vocab_chunk and vocab_chunk < V else V
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_logp = torch.zeros(N, dtype=cdt, device=hidden.device) if g_logp is None else g_logp.to(cdt)
        g_ent = None if g_ent is None else g_ent.to(cdt)
        d_hidden = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        for i in range(0, N, chunk):
            h = hidden[i:i + chunk].to(cdt)                                   # [C, H]
            y = targets[i:i + chunk]                                          # [C]
            lse, H = lse_all[i:i + chunk, None], ent[i:i + chunk, None]      # [C, 1]
            g = g_logp[i:i + chunk, None]                                     # [C, 1]
            for v0 in range(0, V, step):
                w = weight[v0:v0 + step].to(cdt)                              # [Vc, H]
                # two [C, Vc] buffers at most, updated in place
                dz = h @ w.T                                                  # z  [C, Vc]
                dz.sub_(lse)                                                  # log p
                p = torch.exp(dz)                                             # [C, Vc]
                if g_ent is not None:
                    dz.add_(H).mul_(p).mul_(-g_ent[i:i + chunk, None])        # -h * p * (log p + H)
                    dz.sub_(p.mul_(g))                                        # - g * p
                else:
                    dz = p.mul_(-g)
                inside = (y >= v0) & (y < v0 + step)
                if inside.any():
                    rows = torch.nonzero(inside).squeeze(-1)
                    dz[rows, y[rows] - v0] += g[rows, 0]
                if d_hidden is not None:                                      # need_h
                    d_hidden[i:i + chunk] += dz @ w                           # [C, H]
                if d_weight is not None:                                      # need_w
                    d_weight[v0:v0 + step] += dz.T @ h                        # [Vc, H]
        return (d_hidden.to(hidden.dtype) if d_hidden is not None else None,
                d_weight.to(weight.dtype) if d_weight is not None else None, None, None, None)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk: int = 1024,
                   vocab_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], weight [V, H] (the LM head), targets [N] int64 ->
    (log-prob of each target [N], entropy [N]), float32 (float64 for float64 inputs), chunked."""
    if hidden.shape[0] == 0:
        z = hidden.new_zeros(0, dtype=torch.float32) + 0.0 * weight.sum()
        return z, z
    return _ChunkedLogprobs.apply(hidden, weight, targets, int(chunk), int(vocab_chunk))
