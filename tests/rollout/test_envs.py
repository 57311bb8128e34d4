"""Environments: determinism, held-out split, verifier verdicts and the format gate, the registry."""

from __future__ import annotations

import random

import pytest

from pipeline.errors import ConfigError
from pipeline import vocab
from pipeline.rollout.envs import Task, ToolError, Verification, get_env, list_envs, register_env, split_of
from pipeline.rollout.envs.arithmetic import calculate


def test_calculator_precedence():
    assert calculate("2+3*4") == 14
    assert calculate("10-2*3-1") == 3
    assert calculate("37*45") == 1665


def test_builtins_registered_and_deterministic():
    assert {"arithmetic-tool", "reverse-digits"} <= set(list_envs())
    for name in ("arithmetic-tool", "reverse-digits"):
        env = get_env(name)
        assert env.reset(123) == env.reset(123)
        assert {env.reset(s).task_id for s in range(50)} != {env.reset(123).task_id}


def test_train_and_eval_prompts_are_disjoint():
    env = get_env("arithmetic-tool")
    train = {env.reset(s, "train").prompt for s in range(3000)}
    held = {env.reset(s, "eval").prompt for s in range(300)}
    assert held and train
    assert not train & held
    assert all(split_of(env.reset(s, "eval").meta["expr"]) == "eval" for s in range(20))


def test_arithmetic_verifier_pass_fail_and_format_gate():
    env = get_env("arithmetic-tool")
    task = env.reset(7)
    right = env.verify(task, str(task.answer), num_tool_calls=1)
    assert right.verdict == "PASS" and right.reward == pytest.approx(0.95)
    assert right.components == {"task_success": 1.0, "format": 1.0, "tool_cost": -0.05}
    assert env.verify(task, str(task.answer), 0).reward == 1.0
    wrong = env.verify(task, str(task.answer + 1), 0)
    assert wrong.verdict == "FAIL" and wrong.reward == 0.0
    broken = env.verify(task, None, 0)        # no <ans>N<eos>: the gate, whatever else happened
    assert broken.verdict == "FAIL" and broken.reward == 0.0 and not broken.format_ok
    assert broken.components["format"] == 0.0
    assert env.verify(task, "1x", 0).format_ok is False


def test_calculator_tool_output_and_audit_log(tmp_path):
    log = tmp_path / "calls.log"
    env = get_env("arithmetic-tool", tool_log=str(log))
    task = env.reset(1)
    assert env.step(task, "12*3", key="k1") == "36"
    assert env.step(task, "12*", key="k2") == "err"       # malformed call: an observation, not a crash
    assert log.read_text().split() == ["k1", "k2"]


def test_demonstration_segments_tokenize():
    env = get_env("arithmetic-tool")
    task = env.reset(5)
    segs = env.demonstration(task, random.Random(0), tool_fraction=1.0)
    assert [p for _, p in segs] == [True, False, True]
    ids = vocab.encode("".join(t for t, _ in segs))
    assert ids[0] == vocab.CALL_ID and ids[-1] == vocab.EOS_ID and vocab.UNK_ID not in ids


def test_user_environment_in_a_few_lines():
    @register_env
    class EchoDigits:
        name = "echo-digits-test"
        version = env_version = "1"
        verifier_version = "1"
        prompt_template_rev = "e:{digits}=/1"
        multi_turn = False
        idempotent = True

        def reset(self, seed, split="train"):
            rng = random.Random(seed)
            while True:
                d = "".join(rng.choice("0123456789") for _ in range(4))
                if split_of(d) == split:
                    return Task(f"echo-{d}", f"e:{d}=", answer=d, difficulty="easy")

        def step(self, task, action, *, key):
            raise ToolError("no tools")

        def verify(self, task, answer, num_tool_calls):
            if answer is None:
                return Verification("FAIL", 0.0, {"format": 0.0}, format_ok=False)
            return Verification("PASS" if answer == task.answer else "FAIL", float(answer == task.answer))

    env = get_env("echo-digits-test")
    assert env.verify(env.reset(1), env.reset(1).answer, 0).verdict == "PASS"
    with pytest.raises(ConfigError):
        register_env(type("Other", (), {"name": "echo-digits-test"}))
    with pytest.raises(ConfigError):
        get_env("no-such-env")


def test_arithmetic_chain_needs_two_single_operation_calls():
    env = get_env("arithmetic-chain")
    task = env.reset(11)
    a, b, c = task.meta["a"], task.meta["b"], task.meta["c"]
    assert task.prompt == f"{a}*{b}+{c}=" and task.answer == a * b + c and 100 <= c <= 999
    assert env.step(task, f"{a}*{b}", key="k1") == str(a * b)
    assert env.step(task, f"{a}*{b}+{c}", key="k2") == "err"      # one operation per call: no shortcut
    assert env.verify(task, str(task.answer), num_tool_calls=2).reward == pytest.approx(0.9)
    segs = env.demonstration(task, random.Random(0), tool_fraction=1.0)
    assert [p for _, p in segs] == [True, False, True, False, True]
    text = "".join(t for t, _ in segs)
    assert text.count("<call>") == 2 and text.endswith(f"<ans>{task.answer}<eos>")
    assert vocab.UNK_ID not in vocab.encode(text)
    train = {env.reset(s, "train").prompt for s in range(2000)}
    held = {env.reset(s, "eval").prompt for s in range(200)}
    assert held and not train & held


def test_infra_failure_reward_attribute_switches_to_naive_scoring(tmp_path):
    """The ablation hook: an environment declaring infra_failure_reward gets its tool
    timeouts scored as that reward (REJECTED), not excluded (INFRA_FAILED, null)."""
    from pipeline.rollout.engine import Completion, Sampling
    from pipeline.rollout.envs.arithmetic import ArithmeticChain
    from pipeline.rollout.harness import Harness
    from pipeline.rollout.settings import Faults
    from pipeline.rollout.spool import Spool

    class Scripted:   # always calls the tool
        def generate(self, requests, sampling):
            ids = vocab.encode("<call>12*3</call>")
            return [[Completion(ids, [0.0] * len(ids), "stop")] for _ in requests]

        def close(self):
            pass

    class Naive(ArithmeticChain):
        infra_failure_reward = 0.0

    out = {}
    for name, env in (("default", ArithmeticChain()), ("naive", Naive())):
        spool = Spool(tmp_path / name, "w", fsync=False)
        h = Harness(env, lambda: (Scripted(), 0), spool, run_id=name, worker_id="w",
                    sampling=Sampling(1.0, 1.0, 16), faults=Faults(tool_timeout=1.0))
        ep = h.new_episode(episode_id="e", group_id="g", group_size=1, task=env.reset(1), seed=1, policy_version=0)
        h.run([ep])
        out[name] = (ep.status, ep.stop_reason, ep.reward)
    assert out["default"] == ("INFRA_FAILED", "env_timeout", None)
    assert out["naive"] == ("REJECTED", "env_timeout", 0.0)
