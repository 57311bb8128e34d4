"""``flaky-tool``: a task where not calling the tool is a real alternative.

The prompt is a two-digit product (``37*45=``), as in ``arithmetic-tool``'s
hard items; the calculator answers it exactly (``<call>37*45</call>
<obs>1665</obs><ans>1665<eos>``). A tiny model cannot multiply in its head,
but it can *estimate*: an answer close to the true product earns partial
credit. So the two strategies rank

    working tool (0.95)  >  a direct estimate (0 .. ``estimate_credit``)  >  a failing tool

and a policy should call the tool as long as a failed call is not counted
against it. The calculator fails during training: the rollout's fault
injection (``tool_timeout_p`` of the rollout config, per call; the benchmark
and the tests use ``train_tool_timeout_p`` = ``TRAIN_TOOL_TIMEOUT_P``) makes a call time out, which the
harness records INFRA_FAILED / env_timeout with a null reward, and admission
leaves such members out of the group baseline (the default). Held-out
evaluation (``pipeline.rollout.evaluate``) injects no faults: the tool works.

Scoring a timeout as reward 0 instead (the naive pipeline; the
``<env>-infra0`` variants of benchmarks/bench_gates.py set
``infra_failure_reward = 0.0``) makes a tool call worth ``0.95 * (1 - p)`` on
average, below what a direct estimate earns once ``p`` is large enough, so
GRPO teaches the policy to stop calling the tool; with working tools at
evaluation time that policy only estimates and its held-out success (the
share of exact answers, verdict PASS) falls behind.

Reward (``verifier_version`` ``flaky-verifier/1``)::

    format       1 if the final turn is <ans>INTEGER<eos>, else 0 (a gate)
    task_success 1 if the answer equals a*b exactly
    estimate     estimate_credit * max(0, 1 - |answer - a*b| / (tolerance * a*b))
                 for a wrong DIRECT answer (no tool call); 0 for an exact answer (it
                 gets task_success) and 0 for a wrong answer after a tool call (the
                 tool's result was in hand: a copying slip earns nothing)
    tool_cost    -0.05 per tool call
    reward       = 0                                             if format == 0
                   max(0, task_success + estimate + tool_cost)   otherwise

verdict PASS iff task_success == 1 (an estimate is FAIL with a positive
reward). Defaults: ``tolerance`` 1.0 (an answer within 100% of the product
earns something, linearly more the closer it is), ``estimate_credit`` 0.8.
Held-out split by expression (``split_of``), as in ``arithmetic-tool``.
"""

from __future__ import annotations

import random

from pipeline.errors import ConfigError
from pipeline.rollout.envs.arithmetic import INT_ANSWER, TOOL_COST, ArithmeticTool
from pipeline.rollout.envs.base import Task, Verification, register_env, split_of

TRAIN_TOOL_TIMEOUT_P = 0.5     # the training-time failure rate the benchmark and the sign test use


@register_env
class FlakyTool(ArithmeticTool):
    name = "flaky-tool"
    version = "1"
    env_version = "flaky-tool/1"
    verifier_version = "flaky-verifier/1"
    prompt_template_rev = "a*b=/1"
    component_tags = {"task_success": "fact", "estimate": "fact", "format": "heuristic",
                      "tool_cost": "heuristic"}
    train_tool_timeout_p = TRAIN_TOOL_TIMEOUT_P   # read by benchmarks/bench_gates.py (timeout_p)

    def __init__(self, low: int = 10, high: int = 99, tolerance: float = 1.0, estimate_credit: float = 0.8,
                 tool_log: str | None = None) -> None:
        if not 0 < tolerance:
            raise ConfigError(f"flaky-tool: tolerance {tolerance} must be > 0",
                              hint="the relative error at which an estimate's credit reaches 0, e.g. 0.5")
        if not 0 <= estimate_credit < 1 - TOOL_COST:
            raise ConfigError(f"flaky-tool: estimate_credit {estimate_credit} must be in [0, {1 - TOOL_COST})",
                              hint="an estimate must earn less than a working tool call")
        super().__init__(low, high, "*", tool_log)
        self.tolerance, self.estimate_credit = tolerance, estimate_credit

    def reset(self, seed: int, split: str = "train") -> Task:
        rng = random.Random(seed)
        while True:
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            expr = f"{a}*{b}"
            if split_of(expr) == split:
                return Task(task_id=f"flaky-{expr}", prompt=f"{expr}=", answer=a * b, difficulty="hard",
                            meta={"expr": expr, "a": a, "b": b})

    def estimate_reward(self, answer: int, truth: int) -> float:
        """The partial credit of a wrong answer ``answer`` for the product ``truth``."""
        rel = abs(answer - truth) / (self.tolerance * abs(truth)) if truth else float("inf")
        return self.estimate_credit * max(0.0, 1.0 - rel)

    def verify(self, task: Task, answer: str | None, num_tool_calls: int) -> Verification:
        cost = -TOOL_COST * num_tool_calls
        if answer is None or not INT_ANSWER.match(answer):
            return Verification("FAIL", 0.0, {"task_success": 0.0, "estimate": 0.0, "format": 0.0,
                                              "tool_cost": cost}, format_ok=False)
        value = int(answer)
        ok = value == task.answer
        # an estimate counts as a direct answer only: with the tool's result in hand, a wrong
        # answer is a copying slip and earns nothing
        est = 0.0 if ok or num_tool_calls else self.estimate_reward(value, int(task.answer))
        comps = {"task_success": float(ok), "estimate": est, "format": 1.0, "tool_cost": cost}
        return Verification("PASS" if ok else "FAIL", max(0.0, float(ok) + est + cost), comps)
