"""The settings a harness runs under: frozen value types, each field a knob of
``pipeline rollout`` (pipeline/rollout/run.py builds them from ``RolloutConfig``).

``Limits`` bound an episode (turns, tokens, wall clock) and its calls (tool and
verifier deadlines and concurrency: ``pool_size`` sizes the tool and verifier
pools for I/O); ``Schedule`` says how episodes share the
engine; ``Faults`` injects seeded tool timeouts, environment crashes, verifier
errors and the crash tests' kill / hold points.

``Latency`` injects a seeded latency model into tool and verifier calls (a
lognormal with a given mean and sigma, and a share of 10x slow calls): the
draw is a function of (seed, call key), it is recorded in the CREATED event
(the model) and in each call's event (``injected_ms``), so two runs can be
compared.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from pipeline.rollout.engine import derive_seed


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_turns: int = 4
    max_tokens_per_turn: int = 16
    max_total_tokens: int = 64       # response tokens: policy + observation, or the policy's alone with an obs cap
    wall_clock_s: float = 120.0      # per trajectory
    tool_timeout_s: float = 0.0      # per tool call (0: the environment's tool_timeout_s, else 30s)
    tool_concurrency: int = 0        # tool calls running at once (0: auto, ``pool_size``)
    verify_timeout_s: float = 30.0   # per verifier call (INFRA_FAILED / verifier_timeout past it)
    verifier_concurrency: int = 0    # verifier calls running at once (0: auto, ``pool_size``)
    # the observation budget (pipeline/rollout/observe.py; 0 = off: observations count toward max_total_tokens)
    max_obs_tokens_per_turn: int = 0  # observation tokens one tool result may add (cut to fit, with a marker)
    max_obs_tokens: int = 0          # observation tokens of a whole episode
    obs_keep: Literal["head", "tail"] = "head"   # which end of an over-long tool output the policy sees: head | tail

    @property
    def obs_budget(self) -> bool:
        """Observations have their own budget (a cap is set): max_total_tokens is the policy's alone."""
        return self.max_obs_tokens_per_turn > 0 or self.max_obs_tokens > 0


# The most tool (or verifier) calls an auto-sized pool runs at once: each is a
# thread mostly waiting on I/O, so the pool follows the episodes in flight, up
# to this many threads per worker.
POOL_CAP = 256


def pool_size(requested: int, inflight: int, declared: int | None = None) -> int:
    """Threads of a tool or verifier pool. ``requested`` > 0 is the run's explicit
    ``tool_concurrency`` / ``verifier_concurrency``; 0 (the default) sizes the pool
    for I/O: the episodes in flight (``inflight``; 0 = unbounded), at most
    ``POOL_CAP``. Either way an environment's declared limit
    (``max_tool_concurrency`` / ``max_verifier_concurrency``, ``declared`` > 0)
    bounds it: tools are usually I/O waits, not CPU work, but a backend may
    allow only so many calls at once."""
    n = int(requested) if requested and requested > 0 else min(POOL_CAP, int(inflight) if inflight > 0 else POOL_CAP)
    if declared is not None and declared > 0:
        n = min(n, int(declared))
    return max(1, n)


@dataclass(frozen=True)
class Schedule:
    """How episodes share the engine."""

    order: Literal["stream", "waves"] = "stream"   # waves: the lockstep baseline
    max_batch: int = 256             # rows of one engine call (engines without continuous batching)
    max_wait_ms: float = 20.0        # a partial micro-batch waits this long for more ready episodes
    max_inflight: int = 0            # episodes active at once when fed (0: no bound)


@dataclass(frozen=True, kw_only=True)
class Latency:
    """Injected latency of tool and verifier calls: lognormal with mean ``*_ms``
    and log-sd ``*_sigma``; a share ``slow_*_p`` of the calls takes 10x. Seeded
    per call key, so a call's latency does not depend on timing or workers."""

    tool_ms: float = 0.0
    tool_sigma: float = 0.0
    slow_tool_p: float = 0.0
    verifier_ms: float = 0.0
    verifier_sigma: float = 0.0
    slow_verifier_p: float = 0.0
    seed: int = 0

    @property
    def active(self) -> bool:
        return self.tool_ms > 0 or self.verifier_ms > 0

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("tool_ms", "tool_sigma", "slow_tool_p", "verifier_ms",
                                              "verifier_sigma", "slow_verifier_p", "seed")}

    def draw(self, kind: str, key: str) -> float:
        """Seconds to wait before the call ``key`` of ``kind`` (``tool`` | ``verify``)."""
        mean, sigma, slow = ((self.tool_ms, self.tool_sigma, self.slow_tool_p) if kind == "tool"
                             else (self.verifier_ms, self.verifier_sigma, self.slow_verifier_p))
        if mean <= 0:
            return 0.0
        rng = random.Random(derive_seed(self.seed, "latency", kind, key))
        # E[exp(N(mu, s^2))] = exp(mu + s^2/2) = mean
        ms = math.exp(rng.gauss(math.log(mean) - sigma * sigma / 2, sigma)) if sigma > 0 else mean
        if rng.random() < slow:
            ms *= 10
        return ms / 1000


@dataclass(frozen=True, kw_only=True)
class Faults:
    """Fault injection (probabilities per tool call / verification)."""

    tool_timeout: float = 0.0
    env_crash: float = 0.0
    verifier_error: float = 0.0
    kill_after_executed: int = 0     # SIGKILL this process right after the Nth ACTION_EXECUTED is durable
    seed: int = 0
    # hold (sleep until killed) right after the Nth ACTION_EXECUTED is durable, once
    # ``<hold_file>.<pid>`` is written: the readiness marker crash tests kill on
    hold_after_executed: int = 0
    hold_file: str = ""
