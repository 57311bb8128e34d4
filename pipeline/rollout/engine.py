"""The engine interface both generation backends implement (no heavy imports;
the factory that picks a backend by name is pipeline/rollout/backends.py).

An engine takes requests (a token context + how many samples + a seed) and
returns, for every sample, the sampled token ids and the log-prob of every
sampled token. A multi-turn harness "continues a context" by sending the whole
context so far (prompt + earlier turns + observations) as the next request.

Log-probs are those of the *model* distribution, ``log_softmax(raw logits)``,
before temperature/top-p (vLLM's default ``raw_logprobs``; for transformers the
``output_logits`` of generate, not its processed ``scores``: docs/dependency-notes.md).
At temperature 1, top_p 1 this is exactly the behaviour distribution; a trainer
recomputing log-probs with a teacher-forced forward pass gets the same numbers
(tests/rollout/test_engines.py checks 1e-4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from pipeline import vocab

EngineName = Literal["hf", "vllm"]


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0           # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 16           # per turn
    stop_ids: tuple[int, ...] = (vocab.EOS_ID, vocab.END_CALL_ID)  # included in the output when hit


@dataclass(frozen=True)
class Request:
    context: tuple[int, ...]           # token ids so far
    n: int = 1                         # samples of this context
    seed: int = 0                      # sample i uses derive_seed(seed, i)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]              # one per token_ids entry
    finish: Literal["stop", "length"]  # stop: last token is a stop id
    seed: int = 0
    extra: dict = field(default_factory=dict)


class Engine(Protocol):
    name: str
    hf_dir: Path

    def generate(self, requests: list[Request], sampling: Sampling) -> list[list[Completion]]:
        """One list of ``request.n`` completions per request, in order."""
        ...

    def close(self) -> None: ...


class ContinuousEngine(Engine, Protocol):
    """An engine with continuous batching (vLLM): requests join the running batch
    as they arrive and each ``step`` advances every running request by one
    token, returning the ones that finished. The harness uses it when present."""

    def add_request(self, request_id: str, request: Request, sampling: Sampling) -> None: ...

    def step(self) -> list[tuple[str, Completion]]: ...


_MASK = (1 << 63) - 1


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from parts (stable across processes and Python versions)."""
    import hashlib

    h = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "big") & _MASK


def truncate_at_stop(ids: list[int], logprobs: list[float], stop_ids: tuple[int, ...],
                     max_new_tokens: int) -> Completion:
    for k, t in enumerate(ids[:max_new_tokens]):
        if t in stop_ids:
            return Completion(list(ids[:k + 1]), list(logprobs[:k + 1]), "stop")
    return Completion(list(ids[:max_new_tokens]), list(logprobs[:max_new_tokens]), "length")


def served_config(hf_dir: Path) -> dict:
    """``hf_dir``'s config.json, as an engine keeps it while it serves those weights."""
    import json

    return json.loads((Path(hf_dir) / "config.json").read_text())


def same_arch(a: dict, b: dict, *ignore: str) -> bool:
    """Whether two configs match but for their version stamps (and ``ignore``): what must
    match to switch weights in place."""
    def arch(c: dict) -> dict:
        return {k: v for k, v in c.items() if k not in ("transformers_version", "_name_or_path", *ignore)}
    return arch(a) == arch(b)
