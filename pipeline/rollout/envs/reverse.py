"""``reverse-digits``: single-turn; reverse a short digit string (``r:4021=`` ->
``<ans>1204<eos>``). Reward 1 for the exact reversal, 0 otherwise (a malformed
answer is a format failure, also 0). Difficulty: ``easy`` up to 4 digits."""

from __future__ import annotations

import random
import re

from pipeline.rollout.envs.base import Task, ToolError, Verification, register_env, split_of

_DIGITS = re.compile(r"^\d{1,12}$")


@register_env
class ReverseDigits:
    name = "reverse-digits"
    version = "1"
    env_version = "reverse-digits/1"
    verifier_version = "reverse-verifier/1"
    prompt_template_rev = "r:digits=/1"
    component_tags = {"task_success": "fact", "format": "heuristic"}
    multi_turn = False
    idempotent = True

    def __init__(self, min_len: int = 3, max_len: int = 6) -> None:
        self.min_len, self.max_len = min_len, max_len

    def reset(self, seed: int, split: str = "train") -> Task:
        rng = random.Random(seed)
        while True:
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_len, self.max_len)))
            if split_of("r" + digits) == split:
                return Task(task_id=f"rev-{digits}", prompt=f"r:{digits}=", answer=digits[::-1],
                            difficulty="easy" if len(digits) <= 4 else "hard", meta={"digits": digits})

    def step(self, task: Task, action: str, *, key: str) -> str:
        raise ToolError("reverse-digits has no tools")

    def verify(self, task: Task, answer: str | None, num_tool_calls: int) -> Verification:
        if answer is None or not _DIGITS.match(answer):
            return Verification("FAIL", 0.0, {"task_success": 0.0, "format": 0.0}, format_ok=False)
        ok = answer == task.answer
        return Verification("PASS" if ok else "FAIL", float(ok), {"task_success": float(ok), "format": 1.0})

    def demonstration(self, task: Task, rng: random.Random, tool_fraction: float = 0.0) -> list[tuple[str, bool]]:
        return [(f"<ans>{task.answer}<eos>", True)]
