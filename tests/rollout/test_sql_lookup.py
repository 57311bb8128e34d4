"""Issue 41 (6): the SQL task of the observation-budget ablation (benchmarks/bench_sql_obs.py).
``sql-lookup-hot`` has verbose keys whose one query overflows the ablation's observation
budget; the shipped harness scores that episode as an environment outcome, the ablation's
``old_scoring`` arm as the policy's failure (reward 0), and a cold key's query fits."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from pipeline.rollout.engine import Sampling
from pipeline.rollout.envs import get_env
from pipeline.rollout.harness import Harness
from pipeline.rollout.settings import Limits
from pipeline.rollout.spool import Spool
from pipeline.testing.scripted import Scripted

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_sql_obs", ROOT / "benchmarks" / "bench_sql_obs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _run(env, task, turns, spool_dir, limits):
    h = Harness(env, lambda: (Scripted(turns), 0), Spool(spool_dir, "w", fsync=False), run_id="t", worker_id="w",
                sampling=Sampling(1.0, 1.0, 32), limits=limits)
    ep = h.new_episode(episode_id=f"t-g0-{spool_dir.name}", group_id="g0", group_size=1, task=task, seed=1,
                       policy_version=0)
    h.run([ep])
    return ep


def _task(env, hot: bool):
    return next(t for t in (env.reset(s) for s in range(100)) if (t.difficulty == "hot") == hot)


def test_hot_keys_overflow_the_budget_and_the_two_arms_score_them_differently(tmp_path):
    bench = _bench()
    limits = Limits(**bench.Config().limits)
    env = get_env("sql-lookup-hot", store=tmp_path / "store")
    hot, cold = _task(env, True), _task(env, False)
    assert 0.3 < sum(env.reset(s).difficulty == "hot" for s in range(200)) / 200 < 0.7
    query = lambda t: [f"<call>{t.meta['sql']}</call>", f"<ans>{t.answer}<eos>"]   # noqa: E731
    # a cold key: one row, it fits; the exact value after one query pays 0.95
    ep = _run(env, cold, query(cold), tmp_path / "cold", limits)
    assert (ep.status, ep.verdict, ep.reward, ep.tool_calls) == ("ACCEPTED", "PASS", 0.95, 1)
    assert ep.env_state_hash == cold.meta["snapshot"] == hot.meta["snapshot"]
    # a hot key: 8 rows, over the budget through the tool's output alone: the shipped default
    # excludes it (an environment outcome), the old scoring gives it reward 0 as the policy's failure
    env.open("probe", hot)
    assert env.step(hot, hot.meta["sql"], key="probe/a0") == " : ".join([hot.answer] * 8)
    env.close("probe")
    ep = _run(env, hot, query(hot), tmp_path / "hot-a", limits)
    assert (ep.status, ep.verdict, ep.stop_reason, ep.reward) == ("INFRA_FAILED", "ENV_ERROR", "obs_budget", None)
    with bench.old_scoring() as relabelled:
        ep = _run(env, hot, query(hot), tmp_path / "hot-b", limits)
    assert (ep.status, ep.verdict, ep.stop_reason, ep.reward) == ("REJECTED", "FAIL", "max_length", 0.0)
    assert relabelled["n"] == 1
    ep = _run(env, hot, query(hot), tmp_path / "hot-c", limits)          # the patch is gone again
    assert ep.stop_reason == "obs_budget"
    # a direct answer needs no query, whatever the key
    ep = _run(env, hot, [f"<ans>{hot.answer}<eos>"], tmp_path / "hot-d", limits)
    assert (ep.status, ep.reward) == ("ACCEPTED", 1.0)


def test_lookup_rewards_and_demonstrations(tmp_path):
    env = get_env("sql-lookup", store=tmp_path / "store")
    task = env.reset(3)
    v = int(task.answer)
    assert task.prompt == f"v of {task.meta['k']}=" and v // 10 == task.meta["k"] and task.difficulty == "cold"
    assert env.verify(task, str(v), 1).reward == 0.95
    assert round(env.verify(task, str(v + 5), 0).reward, 6) == 0.4          # 0.8 x (1 - 5/10): a close guess
    assert env.verify(task, str(v + 5), 1).reward == 0.0                    # a copying slip after a query
    assert env.verify(task, None, 0).format_ok is False
    assert env.verify(task, "12a", 0).reward == 0.0
    # the held-out split is by key and disjoint from training; the values are sql-lookup-hot's
    train = {env.reset(s).task_id for s in range(200)}
    held = {env.reset(s, "eval").task_id for s in range(50)}
    assert train and held and not train & held
    hot_env = get_env("sql-lookup-hot", store=tmp_path / "store")
    assert hot_env.reset(3).answer == task.answer and hot_env.reset(3).meta["snapshot"] != task.meta["snapshot"]
    segs = env.demonstration(task, random.Random(0), tool_fraction=1.0)
    assert segs == [(f"<call>select v from t where k={task.meta['k']}</call>", True),
                    (f"<obs>{task.answer}</obs>", False), (f"<ans>{task.answer}<eos>", True)]
    assert env.demonstration(task, random.Random(0), tool_fraction=0.0) == [(f"<ans>{task.answer}<eos>", True)]
