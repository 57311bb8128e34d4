"""The policy as the trainer sees it: token log-probs and entropies of chosen
positions, through the chunked head (never full [B, L, V] logits).

    lp, ent = PolicyLogprobs(hf_causal_lm)(input_ids [B, L], rows [M], targets [M])   # [M], [M]

The LM head is *called as a module* (``ChunkedHead``, the model's own
``nn.Linear`` with a second forward signature) rather than read as a tensor:
under ZeRO-3 the head's weight is partitioned across ranks, and DeepSpeed's
module hooks gather it right before that call and release it right after, and
again around the head's own backward. So the full [V, H] weight exists only
while the chunked log-prob computation runs (once per micro-batch forward and
once in its backward), and [T, V] logits still never exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.train.logprobs import token_logprobs

if TYPE_CHECKING:  # transformers is imported where a model is loaded
    from transformers import PreTrainedModel


class ChunkedHead(torch.nn.Linear):
    """``head(hidden, targets)`` -> (log-prob of each target, entropy), chunked;
    ``head(hidden)`` -> full logits (the plain ``nn.Linear``, for HF's own forward)."""

    chunk: int = 1024
    vocab_chunk: int = 0

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None):
        if targets is None:
            return torch.nn.functional.linear(hidden, self.weight)
        return token_logprobs(hidden, self.weight, targets, chunk=self.chunk, vocab_chunk=self.vocab_chunk)


class PolicyLogprobs(torch.nn.Module):
    def __init__(self, lm: PreTrainedModel, *, chunk: int = 1024, vocab_chunk: int = 0) -> None:
        super().__init__()
        cfg = lm.config
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(cfg, attr, None):
                raise ValueError(f"{type(lm).__name__} uses {attr}; the chunked head computes plain logits")
        head = lm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("LM heads with a bias are not supported by the chunked head")
        if type(head) not in (torch.nn.Linear, ChunkedHead):
            raise ValueError(f"LM head {type(head).__name__} is not a plain nn.Linear")
        head.__class__ = ChunkedHead        # same module, parameters and hooks; adds the chunked call
        head.chunk, head.vocab_chunk = chunk, vocab_chunk
        self.lm = lm
        self.chunk, self.vocab_chunk = chunk, vocab_chunk

    def forward(self, input_ids: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lm.get_decoder()(input_ids=input_ids, use_cache=False)
        hidden = out.last_hidden_state                                          # [B, L, H]
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)         # [M, H]
        return self.lm.get_output_embeddings()(h, targets)                     # ([M], [M])


def load_causal_lm(hf_dir: str | Path, *, activation_checkpointing: bool = False,
                   ds_config: dict | None = None) -> PreTrainedModel:
    """The HF model of a policy directory, fp32, in train mode. With a ZeRO-3
    ``ds_config`` the model is built partitioned and rank 0 streams the weights
    in one tensor at a time (``_load_partitioned``): the full model never sits
    in one process's memory."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from pipeline.train.ds_adapter import is_zero3, zero3_init

    hf_logging.disable_progress_bar()
    if is_zero3(ds_config):
        from transformers.initialization import no_init_weights

        # no random init (it would index the empty partitioned tensors; every weight is loaded next)
        with zero3_init(ds_config), no_init_weights():
            lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(hf_dir)), dtype=torch.float32)
        lm.tie_weights()                     # no_init_weights skipped the tying init_weights does
        _load_partitioned(lm, Path(hf_dir))
    else:
        lm = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    if activation_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    lm.train()
    return lm


def _load_partitioned(lm: PreTrainedModel, hf_dir: Path) -> None:
    """Copy the safetensors weights of ``hf_dir`` into a ZeRO-3-partitioned
    model: per parameter, gather, rank 0 overwrites it from the file (read
    lazily), DeepSpeed re-partitions. Every parameter must be in the files."""
    import json

    import torch.distributed as dist
    from safetensors import safe_open

    from pipeline.errors import IntegrityError
    from pipeline.train.ds_adapter import gathered_for_write

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        where = {k: hf_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        single = hf_dir / "model.safetensors"
        if not single.is_file():
            raise IntegrityError(f"{hf_dir}: no model.safetensors(.index.json)",
                                 hint="ZeRO-3 loads safetensors weights; re-save the model with safe_serialization")
        with safe_open(str(single), framework="pt") as f:
            where = {k: single for k in f.keys()}
    # every rank checks names and shapes from the file headers first: an error raised on rank 0 alone,
    # inside a gather, would leave the other ranks waiting in the next collective
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(set(where.values())):
        with safe_open(str(f), framework="pt") as h:
            shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    for name, param in lm.named_parameters():
        want = tuple(getattr(param, "ds_shape", param.shape))
        if name not in shapes:
            raise IntegrityError(f"{hf_dir}: weight {name} is missing from the safetensors files")
        if shapes[name] != want:
            raise IntegrityError(f"{hf_dir}: {name} has shape {shapes[name]}, the config says {want}")
    rank0 = dist.get_rank() == 0
    handles: dict[Path, Any] = {}
    try:
        for name, param in lm.named_parameters():
            with gathered_for_write(param):
                if rank0:
                    if where[name] not in handles:
                        handles[where[name]] = safe_open(str(where[name]), framework="pt")
                    with torch.no_grad():
                        param.copy_(handles[where[name]].get_tensor(name).to(param.dtype))
    finally:
        handles.clear()
