"""``tool-relay``: a load generator for multi-turn rollouts. Every episode makes
exactly ``tool_turns`` tool calls (3 by default) whatever the policy writes, so
a benchmark can drive the harness with an untrained (random-weight) policy
that would never emit the ``<call>…</call>`` syntax itself.

The environment declares ``scripted_tool_turns``: the harness takes the text
of each of the episode's first ``tool_turns`` model turns as that turn's tool
call (its argument, special tokens and all), whether the turn stopped on a
stop token or on its per-turn token budget; the turn after the last
observation is the final one and goes to the verifier, whatever it says. The
tool answers with a short deterministic digest of (task, argument), so an
episode's tokens depend only on its seed and the policy, never on timing.

Reward: 1 when all ``tool_turns`` calls ran (PASS), else 0 (FAIL); component
``tool_calls`` = calls made / ``tool_turns`` (a fact). It measures the harness,
not the policy: use it for throughput and tail-latency benchmarks
(benchmarks/bench_rollout.py), not for training.

    pipeline rollout --env tool-relay --groups 8 \\
        --set tool_latency_ms=300 --set tool_latency_sigma=1 --set slow_tool_p=0.05

(``max_turns``, 4 by default, must exceed ``tool_turns``: the turn after the
last call is the final one.)
"""

from __future__ import annotations

import hashlib
import random

from pipeline.errors import ConfigError
from pipeline.rollout.envs.base import Task, Verification, register_env, split_of


@register_env
class ToolRelay:
    name = "tool-relay"
    version = "1"
    env_version = "tool-relay/1"
    verifier_version = "tool-relay-verifier/1"
    prompt_template_rev = "k:digits=/1"
    tool_schema_version = "relay/1"
    component_tags = {"tool_calls": "fact"}
    multi_turn = True
    idempotent = True            # the digest is a pure function of (task, argument)

    def __init__(self, tool_turns: int = 3, digits: int = 4) -> None:
        if tool_turns < 1 or digits < 1:
            raise ConfigError(f"tool-relay: tool_turns ({tool_turns}) and digits ({digits}) must be >= 1")
        self.tool_turns = tool_turns
        self.digits = digits

    @property
    def scripted_tool_turns(self) -> int:
        """Turns the harness takes as tool calls whatever their text (see the module doc)."""
        return self.tool_turns

    def reset(self, seed: int, split: str = "train") -> Task:
        rng = random.Random(seed)
        while True:
            digits = "".join(rng.choice("0123456789") for _ in range(self.digits))
            if split_of("k" + digits) == split:
                return Task(task_id=f"relay-{digits}", prompt=f"k:{digits}=", answer=self.tool_turns,
                            difficulty="easy", meta={"digits": digits})

    def step(self, task: Task, action: str, *, key: str) -> str:
        h = hashlib.sha256(f"{task.task_id}|{action}".encode()).digest()
        return str(int.from_bytes(h[:4], "big") % 10 ** self.digits).zfill(self.digits)

    def verify(self, task: Task, answer: str | None, num_tool_calls: int) -> Verification:
        ok = num_tool_calls >= self.tool_turns
        return Verification("PASS" if ok else "FAIL", float(ok),
                            {"tool_calls": min(1.0, num_tool_calls / self.tool_turns)},
                            evidence=f"{num_tool_calls} of {self.tool_turns} tool calls ran")
