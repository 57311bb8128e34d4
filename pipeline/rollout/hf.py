"""The transformers adapter of the rollout stage (the only rollout module that
imports torch/transformers/tokenizers).

- ``build_tokenizer``: the char vocabulary (``vocab.py``) as a
  ``PreTrainedTokenizerFast`` (tokenizer.json), loadable by vLLM and the trainer.
- ``build_model`` / ``save_policy``: a tiny Llama causal LM in the Hugging Face
  format (config.json + model.safetensors). ``load_model`` loads ANY causal LM
  directory as what its config says it is (``AutoModelForCausalLM``: an
  imported Qwen2 keeps its q/k/v biases, a Llama its tied embeddings).
- ``HFEngine``: generation with ``model.generate``. Sampling is Gumbel-max with
  one ``torch.Generator`` per sample (a logits processor adds Gumbel noise to
  ``logits / T`` and generate picks the argmax), so every sample depends only
  on its own seed, not on which other requests share the batch; behaviour
  log-probs come from the raw ``output_logits`` (docs/dependency-notes.md).
- ``teacher_forced_logprobs``: the reference the engines are tested against.
- ``warm_start``: the short supervised pass that makes policy version 0.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM, LogitsProcessor,
                          LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerFast)

from pipeline import vocab
from pipeline.rollout.engine import Completion, Request, Sampling, derive_seed, same_arch, served_config, truncate_at_stop


# -- tokenizer + model ----------------------------------------------------------------------
def build_tokenizer() -> PreTrainedTokenizerFast:
    """The char vocabulary as a fast tokenizer: markers are special tokens, every
    other character one token."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab.TOKENS)}, unk_token=vocab.UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(vocab.SPECIAL))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=vocab.BOS, eos_token=vocab.EOS,
                                   unk_token=vocab.UNK, pad_token=vocab.PAD, padding_side="left",
                                   additional_special_tokens=[vocab.CALL, vocab.END_CALL, vocab.OBS,
                                                              vocab.END_OBS, vocab.ANS])


@dataclass(frozen=True)
class Arch:
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2      # head_dim 32: the smallest head size vLLM's CPU attention takes
    max_position_embeddings: int = 128


def build_model(arch: Arch, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab.VOCAB_SIZE, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_attention_heads, max_position_embeddings=arch.max_position_embeddings,
        bos_token_id=vocab.BOS_ID, eos_token_id=vocab.EOS_ID, pad_token_id=vocab.PAD_ID,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype="float32",
    )
    return LlamaForCausalLM(cfg).float()


def save_policy(model: LlamaForCausalLM, hf_dir: Path, extra: dict[str, Any] | None = None) -> None:
    hf_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=vocab.BOS_ID, eos_token_id=vocab.EOS_ID,
                                               pad_token_id=vocab.PAD_ID)
    model.save_pretrained(hf_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(hf_dir)


def load_model(hf_dir: str | Path, device: str = "cpu") -> PreTrainedModel:
    """The causal LM of a policy directory, fp32, as the architecture its config.json
    names (never a fixed class: loading a Qwen2 as a Llama silently drops its biases)."""
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    return model.to(device).eval()


def load_tokenizer(hf_dir: str | Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(hf_dir))


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


# -- log-probs ------------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced_logprobs(model: PreTrainedModel, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """log p(response_ids[t] | prompt + response[:t]) from one forward pass."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=model.device)
    logits = model(input_ids=ids).logits[0].float()                       # [L, V]
    logp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)        # [R, V]
    tgt = torch.tensor(list(response_ids), device=model.device)
    return logp.gather(1, tgt[:, None])[:, 0].tolist()


# -- the engine -----------------------------------------------------------------------------
class _GumbelSampler(LogitsProcessor):
    """Turn generate's greedy pick into a sample: argmax(logits/T + Gumbel) ~ softmax(logits/T).

    The noise of row b at step t comes from row b's own generator, drawn up
    front, so a sample does not depend on its batch neighbours."""

    def __init__(self, seeds: list[int], prompt_len: int, steps: int, vocab_size: int, temperature: float,
                 top_p: float) -> None:
        self.prompt_len = prompt_len
        self.temperature = temperature
        self.top_p = top_p
        noise = torch.empty(len(seeds), steps, vocab_size)
        for b, s in enumerate(seeds):
            g = torch.Generator().manual_seed(s)
            u = torch.rand(steps, vocab_size, generator=g).clamp_(1e-12, 1 - 1e-7)
            noise[b] = -torch.log(-torch.log(u))
        self.noise = noise                                                  # [B, T, V]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1] - self.prompt_len
        z = scores.float() / self.temperature                               # [B, V]
        if self.top_p < 1.0:
            probs = torch.softmax(z, dim=-1)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= self.top_p    # keep the first token always
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            z = z.masked_fill(drop, -math.inf)
        return z + self.noise[:, t, : z.shape[1]].to(z.device)


def add_moves(bits: torch.Tensor, where: torch.Tensor | slice, dif: torch.Tensor, *, shift: int) -> None:
    """Add a delta's moves (``dif``, in units of the published dtype's last place) to the
    fp32 bit patterns ``bits`` at ``where``, in place: an fp32 value that holds a bf16
    value exactly has the bf16 bits in its upper half, so a bf16 move of ``d`` is an int32
    add of ``d << 16`` (``shift``; 0 when fp32 is published). The sum is the new pattern:
    the int32 add wraps exactly where the published pattern's sign bit flips. One pass
    over the tensor for a dense change (no gather of the old values), the changed
    elements only for indices."""
    moves = (dif.to(torch.int64) << shift).to(torch.int32) if dif.element_size() > 2 else dif.to(torch.int32) << shift
    if isinstance(where, slice):        # a dense delta: a move for every element, one pass
        bits.add_(moves)
    else:       # distinct indices (a delta's are ascending): scatter_add_ is ~3x index_add_ on one thread
        bits.scatter_add_(0, where, moves)


class HFEngine:
    """transformers ``generate`` on CPU (or a GPU when ``device`` says so)."""

    name = "hf"

    def __init__(self, hf_dir: Path, *, threads: int | None = None, device: str | None = None,
                 max_batch: int = 512) -> None:
        set_threads(threads)
        self.hf_dir = Path(hf_dir)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model(self.hf_dir, self.device)
        # the served policy's config.json, kept: its directory may be a cache entry pruned while serving
        self.config = served_config(self.hf_dir)
        self.max_batch = max_batch

    def close(self) -> None:
        self.model = None

    def load_weights(self, hf_dir: Path) -> bool:
        """Switch to the policy in ``hf_dir`` in place (``load_state_dict(assign=True)``
        into the running model, no new engine). False, changing nothing, when its
        architecture (config.json, version stamps aside) differs from the served one."""
        from safetensors.torch import load_file

        hf_dir = Path(hf_dir)
        config = served_config(hf_dir)
        if not same_arch(config, self.config):
            return False
        state: dict[str, torch.Tensor] = {}
        for f in sorted(hf_dir.glob("*.safetensors")):
            state.update(load_file(str(f), device=str(self.device)))
        if not state:
            return False
        # weights published in another dtype (publish_dtype=bfloat16) are served in the engine's (fp32), as a
        # fresh engine loads them: assign would otherwise make the parameters the file's dtype
        want = self.model.dtype
        state = {k: (v.to(want) if v.is_floating_point() and v.dtype != want else v) for k, v in state.items()}
        # assign: the parameters take the loaded (memory-mapped) tensors instead of copying into the
        # old ones: copying 450 MB of a 113M model took 4.3 s here, assigning 0.7 s (from_pretrained
        # maps the file the same way)
        missing, unexpected = self.model.load_state_dict(state, strict=False, assign=True)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or ())
        if unexpected or any(k not in tied and "lm_head" not in k for k in missing):
            from pipeline.errors import PipelineError

            raise PipelineError(f"weights in {hf_dir} do not match the served model: missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]}", hint="publish a checkpoint of the same architecture")
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()         # assign replaced the tied tensors: tie them again
        self.model.eval()
        self.hf_dir, self.config = hf_dir, config
        return True

    @torch.no_grad()
    def apply_weight_deltas(self, hf_dir: Path, deltas: list[tuple[dict[str, torch.Tensor], list[str]]]) -> bool:
        """Switch to the policy in ``hf_dir`` by applying its sparse weight deltas
        (pipeline.policy_store.delta, oldest first, each already checked against its
        row) to the weights served, in place: only the changed elements are written.
        The deltas are in the published dtype (``hf_dir``'s config.json ``dtype``); the
        served fp32 parameters hold those values exactly. False, changing nothing,
        when the architecture or the dtype is not one this can apply to."""
        from pipeline.policy_store.delta import bit_pattern, changes, new_bits, write

        hf_dir = Path(hf_dir)
        config = served_config(hf_dir)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(config.get("dtype") or "float32")
        if dtype is None or not same_arch(config, self.config, "dtype"):
            return False
        served = self.model.state_dict()
        numel = {k: v.numel() for k, v in served.items()}
        width = torch.empty(0, dtype=dtype).element_size()
        for _, names in deltas:
            if any(n not in served or not served[n].is_contiguous() for n in names):
                return False
        # every change checked (indices in range, values of the published width) before one is written:
        # a delta that does not fit raises with the served weights untouched
        todo = [c for delta, _ in deltas for c in changes(delta, numel)]
        for name, _idx, val, _dif, full in todo:
            if val is not None and val.element_size() != width:
                from pipeline.errors import IntegrityError

                raise IntegrityError(f"weight delta of {name} has {val.element_size()}-byte values, the "
                                     f"published dtype {dtype} {width}", hint="the delta does not belong here")
            if full is not None and full.shape != served[name].shape:
                return self.load_weights(hf_dir)           # a reshaped tensor: the full load decides
        for name, where, val, dif, full in todo:
            p = served[name]
            if full is not None:
                p.copy_(full.to(p.dtype))
                continue
            flat = p.view(-1)
            if val is None and p.dtype == torch.float32 and dtype in (torch.float32, torch.bfloat16):
                add_moves(flat.view(torch.int32), where, dif, shift=16 if dtype == torch.bfloat16 else 0)
                continue
            if val is None:     # the served values hold the previous version's published bits exactly
                val = new_bits(bit_pattern(flat[where].to(dtype)), None, dif)
            write(flat, where, val.view(dtype).to(p.dtype))   # in the published dtype, into the served (fp32) one
        self.hf_dir, self.config = hf_dir, config
        return True

    @torch.no_grad()
    def generate(self, requests: list[Request], sampling: Sampling) -> list[list[Completion]]:
        rows = [(r, i) for r in requests for i in range(r.n)]
        flat: list[Completion] = []
        for start in range(0, len(rows), self.max_batch):
            flat.extend(self._generate_rows(rows[start:start + self.max_batch], sampling))
        out: list[list[Completion]] = []
        pos = 0
        for r in requests:
            out.append(flat[pos:pos + r.n])
            pos += r.n
        return out

    def _generate_rows(self, rows: list[tuple[Request, int]], sampling: Sampling) -> list[Completion]:
        width = max(len(r.context) for r, _ in rows)
        # left padding; generate derives position ids from the attention mask
        ids = torch.tensor([[vocab.PAD_ID] * (width - len(r.context)) + list(r.context) for r, _ in rows],
                           device=self.device)                                # [B, L]
        attn = (torch.arange(width)[None, :] >= torch.tensor([width - len(r.context) for r, _ in rows])[:, None])
        seeds = [derive_seed(r.seed, i) for r, i in rows]
        greedy = sampling.temperature == 0
        procs = LogitsProcessorList([] if greedy else [_GumbelSampler(
            seeds, ids.shape[1], sampling.max_new_tokens, self.model.config.vocab_size,
            sampling.temperature, sampling.top_p)])
        gen = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=False, num_beams=1,
                               eos_token_id=list(sampling.stop_ids), pad_token_id=vocab.PAD_ID,
                               output_logits=True, return_dict_in_generate=True)
        out = self.model.generate(input_ids=ids, attention_mask=attn.long().to(self.device), generation_config=gen,
                                  logits_processor=procs)
        new = out.sequences[:, ids.shape[1]:]                                         # [B, T]
        logits = torch.stack(out.logits, dim=1).float()                               # [B, T, V]
        logp = torch.log_softmax(logits, dim=-1).gather(2, new[:, :, None])[:, :, 0]  # [B, T]
        comps = []
        for b in range(len(rows)):
            c = truncate_at_stop(new[b].tolist(), logp[b].tolist(), sampling.stop_ids, sampling.max_new_tokens)
            c.seed = seeds[b]
            comps.append(c)
        return comps


# -- the supervised warm start ---------------------------------------------------------------
def warm_start(model: PreTrainedModel, sequences: list[list[int]], masks: list[list[int]], *, steps: int,
               batch_size: int = 64, lr: float = 3e-3, seed: int = 0, log_every: int = 0,
               progress=None) -> dict[str, float]:
    """Next-token cross-entropy on the tokens whose mask is 1 (the demonstration's
    policy tokens), AdamW with linear warmup/decay. Deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    n = len(sequences)
    width = max(len(s) for s in sequences)
    ids = torch.full((n, width), vocab.PAD_ID, dtype=torch.long)
    tmask = torch.zeros((n, width), dtype=torch.float32)
    for k, (seq, mask) in enumerate(zip(sequences, masks)):
        ids[k, :len(seq)] = torch.tensor(seq)
        tmask[k, :len(mask)] = torch.tensor(mask, dtype=torch.float32)
    t0 = time.perf_counter()
    loss_val = float("nan")
    for step in range(steps):
        frac = step / max(steps, 1)
        for grp in opt.param_groups:
            grp["lr"] = lr * min(1.0, (step + 1) / 20) * (1.0 - 0.9 * frac)
        idx = torch.randint(0, n, (batch_size,), generator=g)
        x, m = ids[idx], tmask[idx]                                         # [B, W]
        logits = model(input_ids=x).logits[:, :-1].float()                  # [B, W-1, V]
        tgt, w = x[:, 1:], m[:, 1:]                                         # [B, W-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1),
                                                reduction="none").view_as(w)
        loss = (nll * w).sum() / w.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(loss.detach())
        if log_every and step % log_every == 0:
            print(f"warm start step {step}: loss {loss_val:.4f}", flush=True)
        if progress is not None:
            progress(1)
    model.eval()
    return {"loss": loss_val, "steps": steps, "seconds": time.perf_counter() - t0}

