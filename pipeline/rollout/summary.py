"""What a rollout reports: ``RolloutSummary`` (one worker's, or the run's once
``merge_summaries`` has added up its workers') and the wait percentiles in it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from pipeline.rollout.config import RolloutConfig


BoundBy = Literal["engine", "tool_pool", "verify_pool"]


@dataclass
class RolloutSummary:
    run_id: str
    env: str
    engine: str
    trajectories: int = 0                       # finished by this invocation
    landed: int = 0                             # rows landed in the trajectories table
    events: int = 0
    quarantined: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    reward_mean: float | None = None
    success_rate: float | None = None           # PASS / trajectories with a verdict PASS or FAIL
    policy_versions: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    seconds: float = 0.0                        # wall time, engine start included
    rollout_seconds: float = 0.0                # time in the harness (generation, tools, verification, spool)
    tokens_per_s: float = 0.0                   # generated (policy) tokens / rollout_seconds
    tool_executions: int = 0
    tools_abandoned: int = 0                    # tool calls past their deadline (threads left behind)
    retries: int = 0                            # retry episodes started by this invocation
    retries_denied: int = 0                     # failed members not retried: a budget was spent or the policy moved on
    resumed: int = 0
    workers: int = 1
    schedule: str = "stream"
    engine_busy_s: float = 0.0                  # time the engine was generating (all workers)
    engine_busy_share: float = 0.0              # engine_busy_s / (rollout_seconds of the engines)
    engine_steps: int = 0
    verifiers_abandoned: int = 0                # verifier calls past their deadline
    waits_ms: dict[str, dict[str, float]] = field(default_factory=dict)   # stage -> {p50, p95, n}
    pool_bounds: dict[str, int] = field(default_factory=dict)   # tool / verify -> threads of the pool (a worker's)
    pool_wait_s: dict[str, float] = field(default_factory=dict)  # tool / verify -> s a call waited for a slot
    bound_by: BoundBy = "engine"                # engine | tool_pool | verify_pool: pool wait > engine busy
    cancelled: int = 0                          # stragglers cancelled (group_redundancy): EXPIRED / cancelled
    carried: int = 0                            # stragglers carried into a later round (straggler_policy=carry)
    groups_complete: int | None = None          # complete groups (group_redundancy > 0 only)
    rounds: int = 1                             # rounds of `groups` planned (continuous mode: more than 1)
    weight_switches: list[dict[str, Any]] = field(default_factory=list)   # {version, mode, seconds}
    samples: dict[str, list[float]] = field(default_factory=dict, repr=False)   # raw waits, merged across workers

    def as_dict(self, samples: bool = False) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not samples:
            d.pop("samples")
        return d


def percentiles(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """stage -> {p50, p95, n} (nearest-rank) of the wait samples."""
    out = {}
    for stage, xs in samples.items():
        if not xs:
            continue
        ys = sorted(xs)

        def rank(q: float, ys=ys) -> float:
            return round(ys[min(len(ys) - 1, max(0, int(q * len(ys) + 0.999999) - 1))], 3)

        out[stage] = {"p50": rank(0.5), "p95": rank(0.95), "n": len(ys)}
    return out


def merge_summaries(cfg: RolloutConfig, parts: list[dict[str, Any]], seconds: float) -> RolloutSummary:
    s = RolloutSummary(cfg.run_id, cfg.env, cfg.engine, workers=cfg.workers, schedule=cfg.schedule)
    n_reward = 0
    reward_sum = 0.0
    pass_n = judged = 0
    for p in parts:
        for k in ("trajectories", "landed", "events", "quarantined", "generated_tokens", "tool_executions", "resumed",
                  "rollout_seconds", "tools_abandoned", "retries", "retries_denied", "engine_busy_s", "engine_steps",
                  "verifiers_abandoned", "weight_switches", "cancelled", "carried"):
            setattr(s, k, getattr(s, k) + p[k])
        if p["groups_complete"] is not None:
            s.groups_complete = (s.groups_complete or 0) + p["groups_complete"]
        for kind, v in p["pool_wait_s"].items():
            s.pool_wait_s[kind] = s.pool_wait_s.get(kind, 0.0) + v
        s.pool_bounds = s.pool_bounds or dict(p["pool_bounds"])
        s.rounds = max(s.rounds, p["rounds"])
        for stage, xs in p.get("samples", {}).items():
            s.samples.setdefault(stage, []).extend(xs)
        for k in ("statuses", "verdicts"):
            for name, v in p[k].items():
                getattr(s, k)[name] = getattr(s, k).get(name, 0) + v
        if p["reward_mean"] is not None:
            n = sum(v for st, v in p["statuses"].items() if st in ("ACCEPTED", "REJECTED"))
            reward_sum += p["reward_mean"] * n
            n_reward += n
        pass_n += p["verdicts"].get("PASS", 0)
        judged += p["verdicts"].get("PASS", 0) + p["verdicts"].get("FAIL", 0)
        s.policy_versions = sorted(set(s.policy_versions) | set(p["policy_versions"]))
    s.reward_mean = reward_sum / n_reward if n_reward else None
    s.success_rate = pass_n / judged if judged else None
    s.seconds = seconds
    # workers run in parallel: aggregate throughput = tokens / the slowest worker's harness time
    slowest = max((p["rollout_seconds"] for p in parts), default=0.0)
    s.tokens_per_s = s.generated_tokens / slowest if slowest else 0.0
    s.engine_busy_share = s.engine_busy_s / s.rollout_seconds if s.rollout_seconds else 0.0   # per engine
    s.waits_ms = percentiles(s.samples)
    s.bound_by = bound_by(s.engine_busy_s, s.pool_wait_s)
    return s


def bound_by(engine_busy_s: float, pool_wait_s: dict[str, float]) -> BoundBy:
    """``engine``, or the pool (``tool_pool`` / ``verify_pool``) whose calls waited for a
    free slot longer than the engine was busy: that pool, not the engine, bounded the run."""
    kind, waited = max(pool_wait_s.items(), key=lambda kv: kv[1], default=("", 0.0))
    if waited <= engine_busy_s:
        return "engine"
    return "tool_pool" if kind == "tool" else "verify_pool"
