"""Greedy evaluation on a fixed held-out set.

    pipeline rollout eval --policy latest --env arithmetic-tool --n 200

The evaluation tasks are ``env.reset(derive_seed("eval", seed, i), "eval")``
for i < n: the environment's held-out split, which training (``split="train"``)
and the warm start's demonstrations never draw from. Same policy, same n and
seed -> the same tasks and (greedy) the same answers, so versions are
comparable. Nothing is written to the lake.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any


def evaluate(policy, env_name: str = "arithmetic-tool", *, n: int = 200, seed: int = 0, engine: str = "hf",
             lake=None, threads: int | None = 1, max_turns: int = 4, max_tokens_per_turn: int = 16,
             max_total_tokens: int = 64) -> dict[str, Any]:
    """``policy``: a PolicyRef, an HF directory, or (with ``lake``) a version / id / 'latest'."""
    from pipeline.policy_store import PolicyRef, resolve_policy
    from pipeline.rollout.engine import Sampling, derive_seed, make_engine
    from pipeline.rollout.envs import get_env
    from pipeline.rollout.harness import Harness, Limits
    from pipeline.rollout.spool import Spool

    if isinstance(policy, PolicyRef):
        hf_dir, version = policy.hf_dir, policy.policy_version
    elif lake is not None and not Path(str(policy)).is_dir():
        ref = resolve_policy(lake, None if policy in (None, "latest") else policy)
        hf_dir, version = ref.hf_dir, ref.policy_version
    else:
        p = Path(str(policy))
        hf_dir, version = (p if (p / "config.json").exists() else p / "hf"), -1
    env = get_env(env_name)
    eng = make_engine(engine, hf_dir, threads=threads)
    try:
        with tempfile.TemporaryDirectory(prefix="pipeline-eval-") as tmp:
            spool = Spool(tmp, "eval", fsync=False)
            h = Harness(env, lambda: (eng, max(version, 0)), spool, run_id="eval", worker_id="eval",
                        sampling=Sampling(0.0, 1.0, max_tokens_per_turn),
                        limits=Limits(max_turns, max_tokens_per_turn, max_total_tokens, 1e9))
            eps = []
            for i in range(n):
                task = env.reset(derive_seed("eval", seed, i), "eval")
                eps.append(h.new_episode(episode_id=f"eval-{i}", group_id=f"eval-{i}", group_size=1, task=task,
                                         seed=derive_seed("eval", seed, i, "sample"), policy_version=max(version, 0)))
            h.run(eps)
            spool.close()
    finally:
        eng.close()
    judged = [e for e in eps if e.verdict in ("PASS", "FAIL")]
    rewards = [e.reward for e in eps if e.reward is not None]
    by_diff: dict[str, list[int]] = {}
    for e in judged:
        by_diff.setdefault(e.task.difficulty or "", []).append(int(e.verdict == "PASS"))
    return {
        "env": env_name, "policy_version": version, "engine": engine, "n": n, "seed": seed,
        "success_rate": sum(e.verdict == "PASS" for e in judged) / len(judged) if judged else 0.0,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "format_rate": sum(1 for e in eps if (e.components or {}).get("format", 0.0) == 1.0) / n,
        "tool_use_rate": sum(1 for e in eps if e.tool_calls > 0) / n,
        "success_by_difficulty": {k: sum(v) / len(v) for k, v in sorted(by_diff.items())},
        "statuses": dict(Counter(e.status for e in eps)),
    }
