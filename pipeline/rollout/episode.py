"""An episode of the rollout harness: the state it is in, the tokens it has so
far with their policy versions, and its outcome once terminal. The harness
(pipeline/rollout/harness.py) advances it; the scheduler (scheduler.py) and
recovery (recovery.py) read it. Its words are the persisted ones (the ``events``
table's ``state``, the ``trajectories`` table's ``status`` / ``verdict``), typed
as ``Literal`` so a typo is a type error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from pipeline.rollout.envs import Task

EpisodeState = Literal["CREATED", "GENERATING", "TOOL_WAITING", "VERIFYING",
                       "ACCEPTED", "REJECTED", "INFRA_FAILED", "EXPIRED"]
Status = Literal["ACCEPTED", "REJECTED", "INFRA_FAILED", "EXPIRED"]     # a terminal state
Verdict = Literal["PASS", "FAIL", "UNKNOWN", "ENV_ERROR"]
# why generation stopped: the harness's share of schemas/trajectories.yaml's stop_reason enum
StopReason = Literal["eos", "stop_sequence", "max_length", "max_steps", "env_timeout", "wall_clock",
                     "verifier_timeout", "cancelled", "obs_budget"]
TERMINAL_STATES: tuple[Status, ...] = ("ACCEPTED", "REJECTED", "INFRA_FAILED", "EXPIRED")


@dataclass(kw_only=True)
class Episode:
    """One episode's record as the harness advances it (pipeline/rollout/harness.py): its context so far,
    with the policy version of every token, its state and, once terminal, its outcome."""

    episode_id: str
    group_id: str
    group_size: int
    task: Task
    seed: int
    prompt_ids: list[int]
    policy_version: int = 0          # behaviour version that started it
    state: EpisodeState = "CREATED"
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    created_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    started: float = field(default_factory=time.monotonic)
    # set when terminal
    status: Status | None = None
    verdict: Verdict | None = None
    stop_reason: StopReason | None = None
    reward: float | None = None
    components: dict[str, float] | None = None
    # a committed action awaiting its observation: {"action_id", "text", "output"?}
    pending: dict[str, Any] | None = None
    final_turn: list[int] | None = None
    finished_mono: float = 0.0       # monotonic time of TERMINAL (the worker's ship lag)
    written: set = field(default_factory=set)   # event keys (step, action, type) already recorded
    env_state_hash: str | None = None   # a stateful environment's starting snapshot (``Stateful.open``)
    # what the verifier returned beside the reward (Verification.evidence / confidence / turn_rewards)
    evidence: str | None = None
    confidence: float | None = None
    turn_rewards: list[float] | None = None
    replay: list[str] | None = None     # rebuilt after a crash: the actions executed so far, to re-apply

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def call(self) -> dict[str, Any]:
        """``pending`` of an episode in the tool phase (only episodes with a committed action reach it)."""
        assert self.pending is not None, f"episode {self.episode_id} has no pending action"
        return self.pending
