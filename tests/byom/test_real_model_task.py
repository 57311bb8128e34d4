"""The real-model benchmark's task and the per-task evaluation it is scored from (issue 39):
``arithmetic-words`` renders ``a*b+c`` as a word problem with one worked JSON call, and
``evaluate(episodes=True)`` returns one outcome per held-out task that the rates are made of."""

from __future__ import annotations

import json


def test_arithmetic_words_asks_a_word_problem_with_one_worked_call():
    from pipeline.rollout.envs import get_env
    from pipeline.rollout.envs.arithmetic import calculate

    env = get_env("arithmetic-words")
    task = env.reset(7, "eval")
    m = task.meta
    assert task.answer == calculate(m["expr"]) == m["a"] * m["b"] + m["c"] and task.task_id == f"words-{m['expr']}"
    assert env.reset(7, "eval") == task and env.reset(7, "train").meta["expr"] != m["expr"]
    msgs = env.chat_messages(task)
    assert [x["role"] for x in msgs] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert json.loads(msgs[2]["content"]) == {"name": "calculator", "arguments": {"expression": "12*34+56"}}
    assert msgs[3]["content"] == msgs[4]["content"] == str(calculate("12*34+56"))
    q = msgs[-1]["content"]
    assert f"{m['a']} boxes" in q and f"{m['b']} pens in each" in q and f"{m['c']} loose" in q
    assert m["expr"] not in q                                  # the expression is the model's to write
    # the calculator and the verdict are arithmetic-plus's: the wrong expression gets a wrong answer
    assert env.step(task, env.chat_action("calculator", {"expression": m["expr"]}), key="k") == str(task.answer)
    assert env.verify(task, str(task.answer), 1).verdict == "PASS"
    wrong = env.verify(task, str(calculate(f"12*{m['b']}+{m['c']}")), 1)
    assert wrong.verdict == "FAIL" and wrong.components["format"] == 1.0     # well-formed, not correct
    assert env.chat_template_rev != get_env("arithmetic-plus").chat_template_rev


def test_evaluate_returns_the_episodes_its_rates_are_made_of(qwen2_dir):
    from pipeline.rollout.envs import get_env
    from pipeline.rollout.engine import derive_seed
    from pipeline.rollout.evaluate import evaluate

    r = evaluate(str(qwen2_dir), "arithmetic-words", n=3, episodes=True)
    eps = r["episodes"]
    env = get_env("arithmetic-words")
    assert [e["task_id"] for e in eps] == [env.reset(derive_seed("eval", 0, i), "eval").task_id for i in range(3)]
    assert r["success_rate"] == sum(e["verdict"] == "PASS" for e in eps) / max(1, r["judged"])
    assert r["format_rate"] == sum(e["format"] for e in eps) / 3
    assert r["tool_use_rate"] == sum(e["tool_calls"] > 0 for e in eps) / 3
    assert {k for e in eps for k in e} == {"task_id", "status", "verdict", "format", "tool_calls", "turns", "text"}
    assert "episodes" not in evaluate(str(qwen2_dir), "arithmetic-words", n=1)
