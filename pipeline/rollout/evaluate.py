"""Greedy evaluation on a fixed held-out set.

    pipeline rollout eval --policy latest --env arithmetic-tool --n 200

The evaluation tasks are ``env.reset(derive_seed("eval", seed, i), "eval")``
for i < n: the environment's held-out split, which training (``split="train"``)
and the warm start's demonstrations never draw from. Same policy, same n and
seed -> the same tasks and (greedy) the same answers, so versions are
comparable. ``samples`` > 1 draws that many answers per task (at
``temperature``, default 1.0 then) and reports unbiased pass@k.

:func:`record_evaluation` appends the result to the ``evaluations`` table
(schemas/evaluations.yaml) exactly once per (policy, evaluation settings), as
an OpenLineage run (job ``pipeline.eval``: checkpoint in, table out).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


def evaluate(policy, env_name: str = "arithmetic-tool", *, n: int = 200, seed: int = 0, engine: str = "hf",
             lake: Lake | None = None, threads: int | None = 1, max_turns: int = 4, max_tokens_per_turn: int = 16,
             max_total_tokens: int = 64, samples: int = 1, temperature: float | None = None,
             render: str = "auto", episodes: bool = False) -> dict[str, Any]:
    """``policy``: a PolicyRef, an HF directory, or (with ``lake``) a version / id / 'latest'.
    ``render``: auto / text / chat, as the rollout's ``render`` key. ``episodes``: also return
    ``episodes``, one row per episode (task id, verdict, format, tool calls, final text), for
    paired per-task comparisons between versions."""
    from pipeline.policy_store import PolicyRef, resolve_policy
    from pipeline.rollout import codec
    from pipeline.rollout.backends import make_engine
    from pipeline.rollout.engine import Sampling, derive_seed
    from pipeline.rollout.envs import get_env
    from pipeline.rollout.harness import Harness
    from pipeline.rollout.settings import Limits
    from pipeline.rollout.spool import Spool

    from pipeline.errors import ConfigError

    if samples < 1:
        raise ConfigError(f"samples must be >= 1, got {samples}")
    temperature = (0.0 if samples == 1 else 1.0) if temperature is None else float(temperature)
    checkpoint_id = None
    if isinstance(policy, PolicyRef):
        hf_dir, version, checkpoint_id = policy.hf_dir, policy.policy_version, policy.checkpoint_id
    elif lake is not None and not Path(str(policy)).is_dir():
        ref = resolve_policy(lake, None if policy in (None, "latest") else policy)
        hf_dir, version, checkpoint_id = ref.hf_dir, ref.policy_version, ref.checkpoint_id
    else:
        p = Path(str(policy))
        hf_dir, version = (p if (p / "config.json").exists() else p / "hf"), -1
    env = get_env(env_name)
    eng = make_engine(engine, hf_dir, threads=threads)
    try:
        with tempfile.TemporaryDirectory(prefix="pipeline-eval-") as tmp:
            spool = Spool(tmp, "eval", fsync=False)
            h = Harness(env, lambda: (eng, max(version, 0)), spool, run_id="eval", worker_id="eval",
                        sampling=Sampling(temperature, 1.0, max_tokens_per_turn),
                        limits=Limits(max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn,
                                      max_total_tokens=max_total_tokens, wall_clock_s=1e9),
                        codec=codec.load(hf_dir, env=env, render=render))
            eps = []
            for i in range(n):
                task = env.reset(derive_seed("eval", seed, i), "eval")
                for j in range(samples):   # sample 0 keeps the greedy evaluation's seed
                    eps.append(h.new_episode(
                        episode_id=f"eval-{i}" + (f"-{j}" if j else ""), group_id=f"eval-{i}", group_size=samples,
                        task=task, seed=derive_seed("eval", seed, i, "sample", *((j,) if j else ())),
                        policy_version=max(version, 0)))
            h.run(eps)
            spool.close()
    finally:
        eng.close()
    judged = [e for e in eps if e.verdict in ("PASS", "FAIL")]
    rewards = [e.reward for e in eps if e.reward is not None]
    by_diff: dict[str, list[int]] = {}
    for e in judged:
        by_diff.setdefault(e.task.difficulty or "", []).append(int(e.verdict == "PASS"))
    by_task: dict[str, list[int]] = {}
    for e in judged:
        by_task.setdefault(e.group_id, []).append(int(e.verdict == "PASS"))
    out: dict[str, Any] = {
        "env": env_name, "policy_version": version, "engine": engine, "n": n, "seed": seed,
        "checkpoint_id": checkpoint_id, "policy_dir": str(hf_dir), "split": "eval", "samples": samples,
        "temperature": temperature, "judged": len(judged),
        "limits": [max_turns, max_tokens_per_turn, max_total_tokens], "prompt_template_rev": h.codec.template_rev(env),
        "render": getattr(h.codec, "render", "text"),
        "success_rate": sum(e.verdict == "PASS" for e in judged) / len(judged) if judged else 0.0,
        "pass_at_k": _pass_at_k(by_task, samples),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "format_rate": sum(1 for e in eps if (e.components or {}).get("format", 0.0) == 1.0) / len(eps) if eps else 0.0,
        "tool_use_rate": sum(1 for e in eps if e.tool_calls > 0) / len(eps) if eps else 0.0,
        "success_by_difficulty": {k: sum(v) / len(v) for k, v in sorted(by_diff.items())},
        "statuses": dict(Counter(e.status for e in eps)),
    }
    if episodes:
        out["episodes"] = [{"task_id": e.task.task_id, "status": e.status, "verdict": e.verdict,
                            "format": (e.components or {}).get("format", 0.0) == 1.0, "tool_calls": e.tool_calls,
                            "turns": e.turns, "text": h.codec.decode(e.response_ids)} for e in eps]
    return out


def _pass_at_k(by_task: dict[str, list[int]], samples: int) -> dict[int, float]:
    """k -> mean unbiased pass@k over tasks with at least k judged samples (k = 1, 2, 4, ..., samples)."""
    from pipeline.query.metrics import pass_at_k

    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    ks.append(samples)
    out: dict[int, float] = {}
    for k in ks:
        rows = [(len(v), sum(v)) for v in by_task.values() if len(v) >= k]
        if rows:
            out[k] = float(sum(pass_at_k(n, c, k) for n, c in rows) / len(rows))
    return out


def eval_id(result: dict[str, Any]) -> str:
    import hashlib
    import json

    ident = {k: result.get(k) for k in ("checkpoint_id", "env", "split", "n", "seed", "engine", "samples",
                                         "temperature", "limits")}
    if not result.get("checkpoint_id"):
        ident["policy_dir"] = result.get("policy_dir")
    if result.get("render") == "chat":      # the same policy evaluated through its chat template: another result
        ident["prompt_template_rev"] = result.get("prompt_template_rev")
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def record_evaluation(lake: Lake, result: dict[str, Any], *, command: str) -> dict[str, Any]:
    """Append ``result`` (of :func:`evaluate`) to the ``evaluations`` table, once
    per evaluation id. Returns the row written (or already there)."""
    from datetime import datetime, timezone

    import pyarrow as pa

    from pipeline import lineage
    from pipeline.schema import table_spec

    eid = eval_id(result)
    inputs = ([lineage.checkpoint(lake, result["checkpoint_id"], result["policy_version"])]
              if result.get("checkpoint_id") else [lineage.file(result["policy_dir"])])
    config = {k: result.get(k) for k in ("env", "split", "n", "seed", "engine", "samples", "temperature", "limits")}
    with lineage.job_run(lake, "pipeline.eval", job_type="EVALUATE", engine=result.get("engine"), config=config,
                         inputs=inputs) as run:
        row = {
            "eval_id": eid, "policy_version": int(result["policy_version"]),
            "checkpoint_id": result.get("checkpoint_id"), "env": result["env"], "split": result.get("split", "eval"),
            "engine": result["engine"], "seed": int(result["seed"]), "n": int(result["n"]),
            "samples": int(result.get("samples", 1)), "temperature": float(result.get("temperature", 0.0)),
            "judged": int(result.get("judged", 0)), "success": float(result["success_rate"]),
            "pass_at_k": sorted((int(k), float(v)) for k, v in (result.get("pass_at_k") or {}).items()),
            "reward_mean": result.get("reward_mean"), "format_rate": float(result["format_rate"]),
            "tool_use_rate": float(result["tool_use_rate"]),
            "success_by_difficulty": sorted((result.get("success_by_difficulty") or {}).items()),
            "statuses": sorted((result.get("statuses") or {}).items()),
            "command": command, "run_id": run.run_id, "evaluated_at": datetime.now(timezone.utc),
        }
        schema = table_spec("evaluations").arrow_schema()
        data = pa.Table.from_pylist([row], schema=pa.schema([f for f in schema if f.name != "row_key"]))
        res = lake.append("evaluations", data, command=command, app_id=f"eval:{eid}", txn_version=0)
        run.output(lineage.table(lake, "evaluations", res.version if res.landed else lake.version("evaluations")))
    return row
