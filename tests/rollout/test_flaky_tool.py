"""``flaky-tool`` (pipeline/rollout/envs/flaky.py): its reward rules (an exact
answer, a direct estimate's partial credit, the tool's cost, the format gate),
its held-out split, and a failing tool call taking the INFRA_FAILED path by
default and the naive reward-0 path with ``infra_failure_reward``."""

from __future__ import annotations

import random

import pytest

from pipeline import vocab
from pipeline.errors import ConfigError
from pipeline.rollout.envs import get_env, list_envs, split_of
from pipeline.rollout.envs.flaky import TRAIN_TOOL_TIMEOUT_P, FlakyTool


def test_registered_with_versions_and_a_held_out_split():
    assert "flaky-tool" in list_envs()
    env = get_env("flaky-tool")
    assert (env.env_version, env.verifier_version) == ("flaky-tool/1", "flaky-verifier/1")
    assert env.train_tool_timeout_p == TRAIN_TOOL_TIMEOUT_P and 0 < TRAIN_TOOL_TIMEOUT_P < 1
    task = env.reset(5)
    a, b = task.meta["a"], task.meta["b"]
    assert task.prompt == f"{a}*{b}=" and task.answer == a * b and 10 <= a <= 99 and 10 <= b <= 99
    assert env.reset(5) == task
    train = {env.reset(s, "train").prompt for s in range(2000)}
    held = {env.reset(s, "eval").prompt for s in range(200)}
    assert held and train and not train & held
    assert all(split_of(env.reset(s, "eval").meta["expr"]) == "eval" for s in range(20))


def test_exact_answer_passes_and_the_tool_costs_a_little():
    env = get_env("flaky-tool")
    task = env.reset(3)
    assert env.step(task, task.meta["expr"], key="k") == str(task.answer)     # the working tool
    direct = env.verify(task, str(task.answer), num_tool_calls=0)
    tool = env.verify(task, str(task.answer), num_tool_calls=1)
    assert (direct.verdict, direct.reward) == ("PASS", 1.0)
    assert tool.verdict == "PASS" and tool.reward == pytest.approx(0.95)
    assert tool.components == {"task_success": 1.0, "estimate": 0.0, "format": 1.0, "tool_cost": -0.05}


def test_a_direct_estimate_earns_partial_credit_below_a_working_tool():
    env = FlakyTool(tolerance=0.5, estimate_credit=0.6)
    task = env.reset(8)
    t = task.answer
    close = env.verify(task, str(round(t * 1.1)), 0)          # 10% off: 0.6 * (1 - 0.1/0.5)
    far = env.verify(task, str(round(t * 1.4)), 0)            # 40% off: 0.6 * 0.2
    way_off = env.verify(task, str(t * 3), 0)                 # past the tolerance: nothing
    assert close.verdict == far.verdict == way_off.verdict == "FAIL"
    assert close.reward == pytest.approx(0.6 * (1 - abs(round(t * 1.1) - t) / (0.5 * t)))
    assert 0.95 > close.reward > far.reward > 0 and way_off.reward == 0.0
    assert close.components["estimate"] == close.reward and close.components["task_success"] == 0.0
    # after a tool call only the exact answer counts: a close miss is a copying slip, worth 0
    slip = env.verify(task, str(t + 1), 1)
    assert (slip.verdict, slip.reward, slip.components["estimate"]) == ("FAIL", 0.0, 0.0)
    assert env.verify(task, str(t + 1), 0).reward > 0.5
    # the defaults: an answer within 100% earns up to 0.8, linearly
    d = get_env("flaky-tool")
    assert d.verify(task, str(t * 2), 0).reward == 0.0
    assert d.verify(task, str(round(t * 1.25)), 0).reward == pytest.approx(0.8 * (1 - abs(round(t * 1.25) - t) / t))


def test_format_gate_and_bad_settings():
    env = get_env("flaky-tool")
    task = env.reset(1)
    for bad in (None, "", "12a", "1.5"):
        v = env.verify(task, bad, 0)
        assert (v.verdict, v.reward, v.format_ok) == ("FAIL", 0.0, False)
    assert env.step(task, "12/3", key="k") == "err"            # a malformed call is the policy's failure
    with pytest.raises(ConfigError, match="estimate_credit"):
        FlakyTool(estimate_credit=0.95)                        # an estimate must earn less than the tool
    with pytest.raises(ConfigError, match="tolerance"):
        FlakyTool(tolerance=0)


def test_demonstrations_mix_tool_calls_and_direct_answers():
    env = get_env("flaky-tool")
    task = env.reset(2)
    segs = env.demonstration(task, random.Random(0), tool_fraction=1.0)
    assert [p for _, p in segs] == [True, False, True]
    text = "".join(t for t, _ in segs)
    assert text == f"<call>{task.meta['expr']}</call><obs>{task.answer}</obs><ans>{task.answer}<eos>"
    assert vocab.UNK_ID not in vocab.encode(text)
    assert env.demonstration(task, random.Random(0), tool_fraction=0.0) == [(f"<ans>{task.answer}<eos>", True)]


class _AlwaysCalls:
    """A scripted engine: the first turn calls the calculator, the next one answers."""

    def __init__(self, task):
        self.task = task

    def generate(self, requests, sampling):
        from pipeline.rollout.engine import Completion

        out = []
        for r in requests:
            text = vocab.decode(list(r.context))
            body = f"<ans>{self.task.answer}<eos>" if "<obs>" in text else f"<call>{self.task.meta['expr']}</call>"
            ids = vocab.encode(body)
            out.append([Completion(ids, [0.0] * len(ids), "stop")])
        return out

    def close(self):
        pass


@pytest.mark.parametrize("timeout_p", [0.0, 1.0])
def test_a_failing_tool_is_infra_failed_by_default_and_zero_when_naive(tmp_path, timeout_p):
    """A timed-out call: INFRA_FAILED / env_timeout with a null reward (admission keeps
    it out of the group baseline); with ``infra_failure_reward = 0.0`` (the benchmark's
    ``flaky-tool-infra0``) it is REJECTED with reward 0, below a direct estimate. A
    working tool: the exact answer, PASS, 0.95."""
    from pipeline.rollout.engine import Sampling
    from pipeline.rollout.harness import Faults, Harness
    from pipeline.rollout.spool import Spool

    class Naive(FlakyTool):
        infra_failure_reward = 0.0

    out = {}
    for name, env in (("default", FlakyTool()), ("naive", Naive())):
        task = env.reset(4)
        spool = Spool(tmp_path / name, "w", fsync=False)
        h = Harness(env, lambda t=task: (_AlwaysCalls(t), 0), spool, run_id=name, worker_id="w",
                    sampling=Sampling(1.0, 1.0, 16), faults=Faults(tool_timeout=timeout_p))
        ep = h.new_episode(episode_id="e", group_id="g", group_size=1, task=task, seed=1, policy_version=0)
        h.run([ep])
        out[name] = (ep.status, ep.stop_reason, ep.reward)
    if timeout_p:
        assert out["default"] == ("INFRA_FAILED", "env_timeout", None)
        assert out["naive"] == ("REJECTED", "env_timeout", 0.0)
    else:
        assert out["default"][0] == out["naive"][0] == "ACCEPTED"
        assert out["default"][2] == out["naive"][2] == pytest.approx(0.95)


# The sign test's seed and scale, chosen from benchmarks/results/gates-flaky-tool.json
# (8 seeds, 16 x 8 rollouts, lr 1e-3, 5 updates, warm-start tool fraction 0.5, 50% timeouts):
# gates_on minus infra_as_zero, mean held-out success over the 5 updated versions, was
# +0.66 .. +0.99 on 7 seeds (the naive run stopped calling the tool within one update)
# and +0.02 on seed 6 (its naive run kept the tool).
# A run's bits follow the CPU's instruction set: the warm start's matmuls (MKL) and ATen's
# vector kernels round differently on AVX2 and AVX-512 hosts, so the same seed gives a
# different version 0 on another host, and which side of the threshold a seed's naive run
# lands on is then a fresh draw. Seed 0 (1.00 vs 0.00 on the benchmark's host) keeps the
# tool on an AVX-512/AMX host: version 0 held-out 0.83 vs the benchmark's 0.78 (100 tasks,
# same code and packages), and after 2 updates 1.00 vs 1.00 natively, and also with the kernels forced to AVX2
# or to baseline SSE (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS / MKL_CBWR,
# ONEDNN_MAX_CPU_ISA). Seed 3 holds the margin wherever it was measured: after 2 updates
# 0.81 vs 0.01 on the benchmark's host (its 100 held-out tasks), and on the AVX-512 host
# 0.82 vs 0.00 (native), 0.82 vs 0.00 (all AVX2), 0.80 vs 0.00 (MKL AVX2), 0.66 vs 0.00
# (baseline SSE).
SIGN_SEED = 3
SIGN_ITERATIONS = 2
SIGN_MARGIN = 0.3

def _closed_loop(lake, env: str, *, seed: int, iterations: int, groups: int, group_size: int, lr: float,
                 timeout_p: float, eval_n: int) -> tuple[list[float], list[float]]:
    """rollout -> admit (defaults) -> train -> held-out greedy success, ``iterations`` times;
    (success per updated version, tool-use rate per updated version)."""
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.policy_store import resolve_policy
    from pipeline.rollout.evaluate import evaluate
    from pipeline.rollout.run import run_rollout
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    curve, tool_use = [], []
    for k in range(1, iterations + 1):
        run_rollout(lake, env=env, groups=groups, group_size=group_size, seed=seed * 1000 + k,
                    tool_timeout_p=timeout_p, group_offset=k * 1000, run_id=f"{env}-{seed}", policy="latest")
        a = admit(lake, AdmissionConfig(), command="test")
        if a.snapshot_id:
            train_snapshot(lake, a.snapshot_id, TrainConfig(lr=lr, seed=seed * 100 + k), progress=False)
        ev = evaluate(resolve_policy(lake), "flaky-tool", n=eval_n, seed=0)
        curve.append(float(ev["success_rate"]))
        tool_use.append(float(ev["tool_use_rate"]))
    return curve, tool_use


@pytest.mark.slow
def test_sign_gated_run_ends_ahead_of_the_naive_one(tmp_path):
    """The CI sign test (issue 29, item 6): the same warm-started version 0, the same
    rollouts per iteration (16 x 8, half the tool calls timing out), one difference:
    a timeout is left out of the group baseline (the default) or scored 0 (the naive
    ``infra_failure_reward = 0.0``). The naive run learns to skip the tool and answer
    with an estimate; held-out evaluation uses a working tool, so it ends behind.

    Seed and scale are the benchmark's (benchmarks/bench_gates.py --env flaky-tool,
    benchmarks/results/gates-flaky-tool.json) shortened to SIGN_ITERATIONS updates;
    see SIGN_SEED's comment for the margins measured there and why seed 3. Measured:
    19 s wall (20 s CPU) on the shared 2-core box at load ~2.5, 1.0 GB peak RSS."""
    import shutil

    from pipeline.demo import warm_start_overrides
    from pipeline.lake.delta import Lake
    from pipeline.rollout.envs.base import list_envs, register_env
    from pipeline.rollout.policy import init_policy

    naive = "flaky-tool-infra0-test"
    if naive not in list_envs():
        register_env(type("FlakyToolInfraAsZeroTest", (FlakyTool,), {"name": naive, "infra_failure_reward": 0.0}))
    init_policy(Lake(tmp_path / "v0"), seed=SIGN_SEED, tool_fraction=0.5, **warm_start_overrides("flaky-tool"))
    curves, tool_use = {}, {}
    for name, env in (("gated", "flaky-tool"), ("naive", naive)):
        shutil.copytree(tmp_path / "v0", tmp_path / name)
        curves[name], tool_use[name] = _closed_loop(Lake(tmp_path / name), env, seed=SIGN_SEED,
                                                    iterations=SIGN_ITERATIONS, groups=16, group_size=8, lr=1e-3,
                                                    timeout_p=TRAIN_TOOL_TIMEOUT_P, eval_n=50)
    assert curves["gated"][-1] - curves["naive"][-1] >= SIGN_MARGIN, {"success": curves, "tool_use": tool_use}
