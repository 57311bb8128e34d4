"""The policy as the trainer sees it: token log-probs and entropies of chosen
positions, through the chunked head (never full [B, L, V] logits).

    lp, ent = PolicyLogprobs(hf_causal_lm)(input_ids [B, L], rows [M], targets [M])   # [M], [M]
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.train.logprobs import token_logprobs


class PolicyLogprobs(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, *, chunk: int = 1024, vocab_chunk: int = 0) -> None:
        super().__init__()
        cfg = lm.config
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(cfg, attr, None):
                raise ValueError(f"{type(lm).__name__} uses {attr}; the chunked head computes plain logits")
        head = lm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("LM heads with a bias are not supported by the chunked head")
        self.lm = lm
        self.chunk, self.vocab_chunk = chunk, vocab_chunk

    def forward(self, input_ids: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lm.get_decoder()(input_ids=input_ids, use_cache=False)
        hidden = out.last_hidden_state                                          # [B, L, H]
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)         # [M, H]
        weight = self.lm.get_output_embeddings().weight                        # [V, H]
        return token_logprobs(h, weight, targets, chunk=self.chunk, vocab_chunk=self.vocab_chunk)


def load_causal_lm(hf_dir: str | Path, *, activation_checkpointing: bool = False) -> torch.nn.Module:
    """The HF model of a policy directory, fp32, in train mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    lm = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    if activation_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    lm.train()
    return lm
