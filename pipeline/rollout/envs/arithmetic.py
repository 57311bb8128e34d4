"""``arithmetic-tool``: multi-turn arithmetic with a calculator tool.

The prompt is a small expression (``37*45=``). The policy may call the
calculator (``<call>37*45</call>``); the harness appends the tool's output as
observation tokens (``<obs>1665</obs>``, loss_mask 0) and the policy answers
(``<ans>1665<eos>``). Answering directly is allowed; multiplying two-digit
numbers in one's head is hard for a tiny model, so a policy that learns to use
the tool gets more reward: the warm start mixes both kinds of demonstration and
RL has to discover which one pays.

Reward (PASS iff the answer equals the true value)::

    format      1 if the final turn is <ans>INTEGER<eos>, else 0 (a gate)
    task_success 1 if the answer is right
    tool_cost   -0.05 per tool call
    reward      = 0                                   if format == 0
                  max(0, task_success + tool_cost)    otherwise

so a format failure scores 0 whatever else happened, and a right answer via
one tool call (0.95) beats a wrong one (0) but not a right answer without it (1).

Chat rendering (for a policy with a chat template; pipeline/rollout/codec.py
``ChatCodec``): a system message describes the ``calculator`` tool and its JSON
call format, one worked exchange on another expression (``12+34``: the call, the
tool result, the bare number) shows the protocol, and the user asks ``What is
37*45?``. The model calls ``{"name": "calculator", "arguments": {"expression":
"37*45"}}``; the result comes back as a ``tool`` message; the answer is the last
integer of its final message (none: a format failure). A call to another tool,
or without a string ``expression``, gets the observation ``err`` like a
malformed ``<call>``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from pipeline.rollout.envs.base import Task, Verification, register_env, split_of

_EXPR = re.compile(r"^\d{1,6}([+\-*]\d{1,6}){0,4}$")
_LAST_INT = re.compile(r"-?\d+")
CHAT_SYSTEM = ('You are a helpful assistant with a calculator tool. To use it, reply with a JSON object: '
               '{"name": "calculator", "arguments": {"expression": "..."}}. '
               'After the tool result, reply with the final answer as a number.')
INT_ANSWER = re.compile(r"^-?\d{1,9}$")
TOOL_COST = 0.05


def calculate(expr: str) -> int:
    """Evaluate digits with + - * (usual precedence); no eval()."""
    terms: list[int] = []
    sign = 1
    for part in re.split(r"([+\-])", expr):
        if part == "+":
            sign = 1
        elif part == "-":
            sign = -1
        else:
            value = 1
            for f in part.split("*"):
                value *= int(f)
            terms.append(sign * value)
    return sum(terms)


@register_env
class ArithmeticTool:
    name = "arithmetic-tool"
    version = "1"
    env_version = "arithmetic-tool/1"
    verifier_version = "arithmetic-verifier/1"
    prompt_template_rev = "expr=/1"
    tool_schema_version = "calc/1"
    component_tags = {"task_success": "fact", "format": "heuristic", "tool_cost": "heuristic"}
    multi_turn = True
    idempotent = True          # the calculator is a pure function of its input

    def __init__(self, low: int = 10, high: int = 99, ops: str = "+-*", tool_log: str | None = None) -> None:
        self.low, self.high, self.ops = low, high, ops
        self.tool_log = tool_log   # append one line per real execution (audit; tests count them)

    def reset(self, seed: int, split: str = "train") -> Task:
        rng = random.Random(seed)
        while True:
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            op = rng.choice(self.ops)
            expr = f"{a}{op}{b}"
            if split_of(expr) == split:
                return Task(task_id=f"arith-{expr}", prompt=f"{expr}=", answer=calculate(expr),
                            difficulty="hard" if op == "*" else "easy", meta={"expr": expr})

    def step(self, task: Task, action: str, *, key: str) -> str:
        if self.tool_log:
            with open(Path(self.tool_log), "a") as f:
                f.write(f"{key}\n")
        if not _EXPR.match(action):
            return "err"           # the policy's malformed call: an observation, not an infra failure
        return str(calculate(action))

    def verify(self, task: Task, answer: str | None, num_tool_calls: int) -> Verification:
        cost = -TOOL_COST * num_tool_calls
        if answer is None or not INT_ANSWER.match(answer):
            return Verification("FAIL", 0.0, {"task_success": 0.0, "format": 0.0, "tool_cost": cost},
                                format_ok=False)
        ok = int(answer) == task.answer
        comps = {"task_success": float(ok), "format": 1.0, "tool_cost": cost}
        return Verification("PASS" if ok else "FAIL", max(0.0, float(ok) + cost), comps)

    # the warm start's demonstrations: (text, sampled-by-policy) segments
    # -- chat rendering (envs.base.ChatRendering) --
    chat_template_rev = "calc-chat/1"
    chat_example = ("12+34", "46")     # the worked exchange: another expression than any task's

    def chat_messages(self, task: Task) -> list[dict[str, str]]:
        ex, result = self.chat_example
        call = json.dumps({"name": "calculator", "arguments": {"expression": ex}})
        return [{"role": "system", "content": CHAT_SYSTEM},
                {"role": "user", "content": f"What is {ex}?"},
                {"role": "assistant", "content": call},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": result},
                {"role": "user", "content": f"What is {task.meta['expr']}?"}]

    def chat_action(self, name: str, arguments: dict) -> str | None:
        expr = arguments.get("expression")
        return expr.replace(" ", "") if name == "calculator" and isinstance(expr, str) else None

    def chat_answer(self, text: str) -> str | None:
        found = _LAST_INT.findall(text.replace(",", ""))
        return found[-1] if found else None

    def demonstration(self, task: Task, rng: random.Random, tool_fraction: float = 0.5) -> list[tuple[str, bool]]:
        ans = f"<ans>{task.answer}<eos>"
        if rng.random() < tool_fraction:
            expr = task.meta["expr"]
            return [(f"<call>{expr}</call>", True), (f"<obs>{calculate(expr)}</obs>", False), (ans, True)]
        return [(ans, True)]


def _affine_task(env, seed: int, split: str, prefix: str) -> Task:
    """An ``a*b+c`` task of ``split`` (two-digit ``a, b`` in ``env.low..env.high``, ``c`` in
    ``env.c_low..env.c_high``), the same for the same seed: arithmetic-plus and arithmetic-chain."""
    rng = random.Random(seed)
    while True:
        a, b = rng.randint(env.low, env.high), rng.randint(env.low, env.high)
        c = rng.randint(env.c_low, env.c_high)
        expr = f"{a}*{b}+{c}"
        if split_of(expr) == split:
            return Task(task_id=f"{prefix}-{expr}", prompt=f"{expr}=", answer=calculate(expr),
                        difficulty="hard", meta={"expr": expr, "a": a, "b": b, "c": c})


@register_env
class ArithmeticPlus(ArithmeticTool):
    """``arithmetic-plus``: ``arithmetic-tool`` on ``a*b+c`` tasks (two-digit ``a, b``,
    ``c`` in ``c_low..c_high``), with the same calculator (a whole expression per call):
    one call and a copied result answer it. The real-model benchmark's task
    (benchmarks/bench_real_model.py): too hard to compute in one's head, one clean
    tool call away. Held-out split by expression."""

    name = "arithmetic-plus"
    version = "1"
    env_version = "arithmetic-plus/1"
    prompt_template_rev = "a*b+c=/1"

    def __init__(self, low: int = 10, high: int = 99, c_low: int = 10, c_high: int = 99,
                 tool_log: str | None = None) -> None:
        super().__init__(low, high, "*", tool_log)
        self.c_low, self.c_high = c_low, c_high

    def reset(self, seed: int, split: str = "train") -> Task:
        return _affine_task(self, seed, split, "plus")


@register_env
class ArithmeticWords(ArithmeticPlus):
    """``arithmetic-words``: ``arithmetic-plus`` told as a word problem (issue 39). In the chat
    rendering the user asks "A shop has 37 boxes with 45 pens in each box, and 12 loose pens.
    How many pens does the shop have?"; the worked example is the same story with 12, 34, 56
    and the call ``{"name": "calculator", "arguments": {"expression": "12*34+56"}}``. Reading
    the numbers into the expression is the task's skill: SmolLM2-135M-Instruct (version 0)
    keeps the JSON format and calls the tool on nearly every task but often writes a number
    of the example or repeats one of the task (``12*43+23`` for 90 boxes of 43), so its
    held-out correctness is well below its format rate and can rise without the format
    changing (benchmarks/bench_real_model.py). Tasks, calculator and reward as in
    ``arithmetic-plus`` (held-out split by expression; the text rendering is ``a*b+c=``)."""

    name = "arithmetic-words"
    version = "1"
    env_version = "arithmetic-words/1"
    chat_template_rev = "calc-words-chat/1"
    chat_example = ("12*34+56", "464")

    def reset(self, seed: int, split: str = "train") -> Task:
        return _affine_task(self, seed, split, "words")

    @staticmethod
    def question(a: int, b: int, c: int) -> str:
        return (f"A shop has {a} boxes with {b} pens in each box, and {c} loose pens. "
                "How many pens does the shop have?")

    def chat_messages(self, task: Task) -> list[dict[str, str]]:
        ex, result = self.chat_example
        call = json.dumps({"name": "calculator", "arguments": {"expression": ex}})
        m = task.meta
        return [{"role": "system", "content": CHAT_SYSTEM},
                {"role": "user", "content": self.question(12, 34, 56)},
                {"role": "assistant", "content": call},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": result},
                {"role": "user", "content": self.question(m["a"], m["b"], m["c"])}]


_ONE_OP = re.compile(r"^\d{1,6}[+\-*]\d{1,6}$")


@register_env
class ArithmeticChain(ArithmeticTool):
    """``arithmetic-chain``: the harder variant, for measuring what the gates change.

    The prompt is ``a*b+c=`` with two-digit ``a, b`` and a three-digit ``c``
    (``37*45+123=``); the calculator takes ONE binary operation per call, so
    the only reliable way to the answer is two calls, the second one reusing
    the first call's observation::

        <call>37*45</call><obs>1665</obs><call>1665+123</call><obs>1788</obs><ans>1788<eos>

    A tiny model cannot multiply two-digit numbers in its head, so answering
    directly almost never pays; one call and then an answer is wrong too. The
    warm start mixes full chains with direct answers, so version 0 starts low
    (it must pick the chain and copy the intermediate result without a slip)
    and RL improves it over several updates instead of one (measured in
    benchmarks/bench_gates.py: greedy held-out 0% -> ~0.3 -> 0.84 over two
    updates for two of three warm-start seeds; the third never samples a right
    chain, so GRPO has no signal). Reward as in
    ``arithmetic-tool`` (two calls: 0.9 for a right answer). Held-out split by
    expression, as in ``arithmetic-tool``.
    """

    name = "arithmetic-chain"
    version = "1"
    env_version = "arithmetic-chain/1"
    verifier_version = "arithmetic-verifier/1"
    prompt_template_rev = "a*b+c=/1"

    def __init__(self, low: int = 10, high: int = 99, c_low: int = 100, c_high: int = 999,
                 tool_log: str | None = None) -> None:
        super().__init__(low, high, "*", tool_log)
        self.c_low, self.c_high = c_low, c_high

    def reset(self, seed: int, split: str = "train") -> Task:
        return _affine_task(self, seed, split, "chain")

    chat_template_rev = "calc-chain-chat/1"

    def chat_messages(self, task: Task) -> list[dict[str, str]]:
        """As ``arithmetic-tool``'s, with a two-call worked example (one operation per call)."""
        def call(e: str) -> str:
            return json.dumps({"name": "calculator", "arguments": {"expression": e}})

        system = CHAT_SYSTEM.replace('reply with a JSON object', 'reply with a JSON object (one operation per call)')
        return [{"role": "system", "content": system},
                {"role": "user", "content": "What is 12*34+56?"},
                {"role": "assistant", "content": call("12*34")}, {"role": "tool", "content": "408"},
                {"role": "assistant", "content": call("408+56")}, {"role": "tool", "content": "464"},
                {"role": "assistant", "content": "464"},
                {"role": "user", "content": f"What is {task.meta['expr']}?"}]

    def step(self, task: Task, action: str, *, key: str) -> str:
        if self.tool_log:
            with open(Path(self.tool_log), "a") as f:
                f.write(f"{key}\n")
        if not _ONE_OP.match(action):
            return "err"           # one operation per call; a malformed call is the policy's failure
        return str(calculate(action))

    def demonstration(self, task: Task, rng: random.Random, tool_fraction: float = 0.5) -> list[tuple[str, bool]]:
        ans = f"<ans>{task.answer}<eos>"
        if rng.random() < tool_fraction:
            m = task.meta
            p = m["a"] * m["b"]
            return [(f"<call>{m['a']}*{m['b']}</call>", True), (f"<obs>{p}</obs>", False),
                    (f"<call>{p}+{m['c']}</call>", True), (f"<obs>{p + m['c']}</obs>", False), (ans, True)]
        return [(ans, True)]
