"""Gate ablations (issue 17): does admission change what the policy learns?

On ``arithmetic-chain`` (two calculator calls per answer; version 0 starts
near 0% held-out success), every arm gets the same rollout budget per
iteration (``groups x group_size`` trajectories), the same warm-started
version 0 per seed, and differs in ONE thing:

    gates_on            the defaults: infra failures excluded from baselines, max_policy_lag=1,
                        zero-variance groups dropped; 20% injected tool timeouts per call
    infra_as_zero       the same timeouts scored as reward 0 (a policy failure) instead of excluded
    zero_var_kept       groups without reward spread admitted with advantage 0 (drop_zero_variance=false)
    async_no_freshness  simulated async collection: half the groups (the slow class) were sampled by
                        the policy ``slow_lag`` versions behind (``--slow-lag``, default 3); max_policy_lag
                        off (1000); the trainer's truncated importance weights off (tis_cap=0): stale
                        samples trained as if on-policy
    async_lag1          the same collection with max_policy_lag=1 (the default gate), tis_cap=0
    async_tis           the same collection, gate off, but tis_cap=2: each token weighted by
                        min(pi_old / mu, 2) against the behaviour log-probs (decoupled PPO)

For every arm the JSON also has ``rejections``: per arm, the share of sampled
trajectories no snapshot admitted and the share excluded as stale, by
difficulty, by response-length bucket (``--length-edges``) and by class
(fast / slow), from the lake's trajectories, receipts and snapshot_members.

``--env NAME`` moves the main arms to another environment (the naive arm uses
``NAME-infra0``); ``--json`` prints one JSON document on stdout whose ``arms``
hold, per arm, held-out success per updated version for each seed, the mean
over seeds and versions and a seeded bootstrap 95% interval over seeds, and
whose ``differences`` pair arms by seed (``ablation``; docs/gates.md).

Measured per policy version: held-out greedy success (fixed evaluation split,
never trained on) and held-out tool use; per iteration: admitted groups and
members, trained policy tokens, *useful* tokens (policy tokens of members
with a non-zero advantage) and training seconds. Each arm runs for ``seeds``
seeds (the warm start, the rollouts and the training all follow the seed);
the summary is mean +- std over seeds.

    python benchmarks/bench_gates.py                  # full: 3 seeds, writes results/gates-<time>.json + docs plot
    python benchmarks/bench_gates.py --quick          # smoke run (1 seed, 2 iterations; nothing written)
    python benchmarks/bench_gates.py --arms tool_gates_on,tool_infra_as_zero   # (b) on arithmetic-tool
    python benchmarks/bench_gates.py --env flaky-tool --arms gates_on,infra_as_zero \
        --seeds 0,1,2,3,4,5,6,7 --iterations 5 --lr 1e-3 --warm-start-tool-fraction 0.5 \
        --json --out benchmarks/results/gates-flaky-tool.json   # issue 29: where avoiding the tool pays
    python benchmarks/bench_gates.py --arms async_no_freshness,async_lag1,async_tis --slow-lag 4 \
        --seeds 0,1,2,3,4 --iterations 6 --lr 1e-3 --json \
        --out benchmarks/results/gates-async-lag4.json    # issue 29: lags the gate refuses
    python benchmarks/bench_gates.py --plot A.json B.json   # redraw docs/gates.png from results files
    python benchmarks/bench_gates.py --table A.json B.json  # the README table

Everything runs in this process with the library's own functions
(``init_policy``, ``run_rollout``, ``admit`` with ``AdmissionConfig``
variations, ``train_snapshot``, ``evaluate``). The async arms are a
deterministic simulation of async collection (a slow class of episodes that
finishes ``slow_lag`` updates after it started), not the multi-process demo:
the same staleness in every seed, so the gate's effect is not confounded
with scheduling noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

ENV = "arithmetic-chain"
ENV_INFRA0 = "arithmetic-chain-infra0"


@dataclass(frozen=True)
class Arm:
    name: str
    admission: dict[str, Any] = field(default_factory=dict)
    infra_as_zero: bool = False
    slow_lag: int = 0               # > 0: half the groups sampled by the policy this many versions behind
    env: str = ENV
    train: dict[str, Any] = field(default_factory=dict)     # TrainConfig overrides of this arm


ARMS = (
    Arm("gates_on"),
    Arm("infra_as_zero", infra_as_zero=True),
    Arm("zero_var_kept", admission={"drop_zero_variance": False}),
    # issue 29 (2): the async arms train with tis_cap=0 (a stale sample is treated as on-policy), so that
    # async_lag1 differs from async_no_freshness only in the gate and async_tis only in the correction;
    # --slow-lag sets their lag (default 3)
    Arm("async_no_freshness", admission={"max_policy_lag": 1000}, slow_lag=3, train={"tis_cap": 0.0}),
    Arm("async_lag1", slow_lag=3, train={"tis_cap": 0.0}),
    Arm("async_tis", admission={"max_policy_lag": 1000}, slow_lag=3, train={"tis_cap": 2.0}),
    # (b) again on arithmetic-tool, where answering without the tool sometimes pays (+ and -)
    Arm("tool_gates_on", env="arithmetic-tool"),
    Arm("tool_infra_as_zero", infra_as_zero=True, env="arithmetic-tool"),
)
MAIN_ARMS = ("gates_on", "infra_as_zero", "zero_var_kept", "async_no_freshness", "async_lag1")


@dataclass(frozen=True)
class GatesConfig:
    seeds: tuple[int, ...] = (0, 1, 2)
    iterations: int = 4
    groups: int = 16
    group_size: int = 8
    eval_n: int = 100
    tool_timeout_p: float | None = None     # None: the env's train_tool_timeout_p, else 0.2
    lr: float = 3e-4
    epochs: int = 1
    arms: tuple[str, ...] = MAIN_ARMS
    env: str | None = None                  # --env: run the main arms on this env instead of arithmetic-chain
    warm_start_steps: int | None = None     # None: the policy init's default
    warm_start_tool_fraction: float | None = None   # None: the policy init's default (0.4)
    slow_lag: int | None = None             # None: each async arm's own (3); else the slow class's lag in versions
    length_edges: tuple[int, ...] = (10, 30)        # response_len bucket edges of the rejection table


def timeout_p(cfg: GatesConfig, env: str) -> float:
    """The per-call injected tool-timeout probability an arm on ``env`` trains with."""
    if cfg.tool_timeout_p is not None:
        return cfg.tool_timeout_p
    from pipeline.rollout.envs.base import env_class

    return float(getattr(env_class(env), "train_tool_timeout_p", 0.2))   # unknown names fail here


def resolve_arms(cfg: GatesConfig) -> list[Arm]:
    """The arms ``cfg`` names, in ``ARMS`` order, moved to ``cfg.env`` when set
    (the ``tool_*`` arms keep ``arithmetic-tool``)."""
    from dataclasses import replace

    unknown = sorted(set(cfg.arms) - {a.name for a in ARMS})
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {', '.join(a.name for a in ARMS)}")
    arms = [a for a in ARMS if a.name in cfg.arms]
    if cfg.env:
        arms = [replace(a, env=cfg.env) if a.env == ENV else a for a in arms]
    if cfg.slow_lag is not None:
        if cfg.slow_lag < 1:
            raise SystemExit(f"--slow-lag must be >= 1, got {cfg.slow_lag}")
        arms = [replace(a, slow_lag=cfg.slow_lag) if a.slow_lag else a for a in arms]
    return arms


def _register_infra0_env(names: tuple[str, ...] = ()) -> None:
    """``<env>-infra0``: the env with the naive scoring: a tool timeout is a reward-0 policy failure
    (for arithmetic-chain, arithmetic-tool and every env in ``names``)."""
    from pipeline.rollout.envs.base import env_class, list_envs, register_env

    for name in ("arithmetic-chain", "arithmetic-tool", *names):
        base = env_class(name)               # unknown names fail here
        if f"{name}-infra0" not in list_envs():
            register_env(type(f"{base.__name__}InfraAsZero", (base,), {
                "name": f"{name}-infra0", "infra_failure_reward": 0.0}))


def _policy_tokens(lake) -> dict[str, int]:
    """trajectory_id -> number of policy-sampled (loss_mask 1) tokens."""
    import numpy as np
    import pyarrow.compute as pc

    t = lake.read("trajectories", columns=["trajectory_id", "loss_mask"])
    masks = t.column("loss_mask").combine_chunks()
    flat = np.asarray(pc.list_flatten(masks).to_numpy(zero_copy_only=False), np.int64)
    parents = np.asarray(pc.list_parent_indices(masks).to_numpy(zero_copy_only=False), np.int64)
    sums = np.bincount(parents, weights=flat, minlength=t.num_rows).astype(np.int64)
    return dict(zip(t.column("trajectory_id").to_pylist(), sums.tolist()))


def _evaluate(lake, eval_n: int, env: str = ENV) -> tuple[int, float, float]:
    from pipeline.policy_store import resolve_policy
    from pipeline.rollout.evaluate import evaluate

    ref = resolve_policy(lake)
    ev = evaluate(ref, env, n=eval_n, seed=0)
    return ref.policy_version, float(ev["success_rate"]), float(ev["tool_use_rate"])


def run_arm(lake, arm: Arm, seed: int, cfg: GatesConfig, v0: dict[str, Any]) -> dict[str, Any]:
    """K iterations of rollout -> admit -> train -> evaluate on a lake holding version 0."""
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.demo import group_reasons
    from pipeline.policy_store import resolve_policy
    from pipeline.rollout.run import run_rollout
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    env = f"{arm.env}-infra0" if arm.infra_as_zero else arm.env
    adm = AdmissionConfig(**arm.admission)
    curve = [{"iteration": 0, "policy_version": 0, "heldout_success": v0["heldout_success"],
              "heldout_tool_use": v0["heldout_tool_use"]}]
    t_arm = time.perf_counter()
    for k in range(1, cfg.iterations + 1):
        version = resolve_policy(lake).policy_version
        common = dict(env=env, group_size=cfg.group_size, seed=seed * 1000 + k,
                      tool_timeout_p=timeout_p(cfg, arm.env))
        t0 = time.perf_counter()
        if arm.slow_lag:
            fast = cfg.groups // 2
            parts = [run_rollout(lake, groups=fast, group_offset=k * 1000, run_id=f"{arm.name}-{seed}",
                                 policy="latest", **common),
                     run_rollout(lake, groups=cfg.groups - fast, group_offset=k * 1000 + fast,
                                 run_id=f"{arm.name}-{seed}-slow", policy=str(max(0, version - arm.slow_lag)),
                                 **common)]
        else:
            parts = [run_rollout(lake, groups=cfg.groups, group_offset=k * 1000, run_id=f"{arm.name}-{seed}",
                                 policy="latest", **common)]
        rollout_s = time.perf_counter() - t0
        rewards = [(p.reward_mean, p.trajectories) for p in parts if p.reward_mean is not None]
        a = admit(lake, adm, command="bench_gates")
        stale, infra = group_reasons(a.receipts)
        row: dict[str, Any] = {
            "iteration": k, "sampled": sum(p.trajectories for p in parts), "rollout_s": round(rollout_s, 2),
            "sampled_reward": (sum(r * n for r, n in rewards) / sum(n for _, n in rewards)) if rewards else None,
            "sampled_success": statistics.fmean([p.success_rate for p in parts if p.success_rate is not None] or [0]),
            "decisions": dict(a.counts), "admitted_groups": a.admitted_groups, "admitted_members": a.admitted_members,
            "groups_with_stale": stale, "groups_with_infra": infra, "trained_tokens": 0, "useful_tokens": 0,
            "train_s": 0.0,
        }
        if a.snapshot_id:
            toks = _policy_tokens(lake)
            ids = a.members.column("trajectory_id").to_pylist()
            adv = a.members.column("advantage").to_pylist()
            lags = a.members.column("policy_lag").to_pylist()
            row["trained_tokens"] = sum(toks[i] for i in ids)
            row["useful_tokens"] = sum(toks[i] for i, x in zip(ids, adv) if abs(x) > 1e-9)
            row["max_policy_lag_admitted"] = max(lags)
            t1 = time.perf_counter()
            # the arms ablate admission's gates: the trainer's own freshness check (max_train_lag)
            # would refuse async_no_freshness's lag-3 data, so it is off here for every arm
            train_snapshot(lake, a.snapshot_id, TrainConfig(**{"lr": cfg.lr, "epochs": cfg.epochs,
                                                               "seed": seed * 100 + k, "max_train_lag": None,
                                                               **arm.train}), progress=False)
            row["train_s"] = round(time.perf_counter() - t1, 2)
        row["policy_version"], row["heldout_success"], row["heldout_tool_use"] = _evaluate(lake, cfg.eval_n, arm.env)
        curve.append(row)
        print(f"  {arm.name:<19} seed {seed} iter {k}: v{row['policy_version']} held-out "
              f"{row['heldout_success']:.2f} (tool {row['heldout_tool_use']:.2f}) admitted {a.admitted_groups}/"
              f"{cfg.groups} groups, {row['useful_tokens']}/{row['trained_tokens']} useful tokens, "
              f"train {row['train_s']:.1f}s", flush=True)
    return {"arm": arm.name, "seed": seed, "curve": curve, "seconds": round(time.perf_counter() - t_arm, 1),
            "members": _member_fates(lake, arm.name)}


# One row per sampled trajectory of the arm: its difficulty, length, tool calls, class (slow = sampled
# behind), whether a snapshot admitted it, and the receipt's exclusion reason (null: not excluded).
MEMBER_FATES_SQL = """
WITH ex AS (
    SELECT unnest(map_keys(excluded_members)) AS trajectory_id,
           unnest(map_values(excluded_members)) AS reason
    FROM receipts
), rec AS (
    SELECT unnest(valid_members) AS trajectory_id, decision FROM receipts
), adm AS (SELECT DISTINCT trajectory_id FROM snapshot_members)
SELECT t.trajectory_id, t.difficulty, t.response_len, t.num_tool_calls,
       ends_with(t.run_id, '-slow') AS slow, adm.trajectory_id IS NOT NULL AS admitted,
       ex.reason AS excluded_reason, rec.decision AS group_decision
FROM trajectories t
LEFT JOIN adm USING (trajectory_id)
LEFT JOIN ex USING (trajectory_id)
LEFT JOIN rec USING (trajectory_id)
WHERE starts_with(t.run_id, $prefix)
ORDER BY t.trajectory_id
"""


def _member_fates(lake, arm_name: str) -> list[list[Any]]:
    """Per sampled trajectory of the arm (from the lake's trajectories, receipts and
    snapshot_members): [difficulty, response_len, num_tool_calls, slow, admitted,
    excluded_reason, group_decision]; compact rows, the JSON keeps them all."""
    from pipeline.query.duck import query

    t = query(lake, MEMBER_FATES_SQL, params={"prefix": f"{arm_name}-"})
    cols = ["difficulty", "response_len", "num_tool_calls", "slow", "admitted", "excluded_reason", "group_decision"]
    return [list(r) for r in zip(*(t.column(c).to_pylist() for c in cols))]


def _length_bucket(n: int, edges: tuple[int, ...]) -> str:
    lo = 0
    for e in edges:
        if n < e:
            return f"{lo}-{e - 1}"
        lo = e
    return f">={lo}"


def rejections(runs: list[dict[str, Any]], arms: tuple[str, ...], edges: tuple[int, ...]) -> dict[str, Any]:
    """Per arm, over its seeds: the share of sampled trajectories no snapshot admitted
    (``rejection_rate``) and the share excluded as stale (reason ``stale_*``), by
    difficulty, by response-length bucket (``edges``) and by class (fast / slow)."""
    out: dict[str, Any] = {}
    for name in arms:
        rows = [m for r in runs if r["arm"] == name for m in r.get("members", [])]
        if not rows:
            continue
        keys = {"difficulty": lambda m: m[0] or "none", "length_bucket": lambda m: _length_bucket(m[1], edges),
                "class": lambda m: "slow" if m[3] else "fast"}
        arm_out: dict[str, Any] = {}
        for key, fn in keys.items():
            cells: dict[str, dict[str, Any]] = {}
            for m in rows:
                c = cells.setdefault(fn(m), {"sampled": 0, "admitted": 0, "stale_excluded": 0})
                c["sampled"] += 1
                c["admitted"] += bool(m[4])
                c["stale_excluded"] += bool(m[5] and str(m[5]).startswith("stale"))
            for c in cells.values():
                c["rejection_rate"] = round(1 - c["admitted"] / c["sampled"], 4)
                c["stale_exclusion_rate"] = round(c["stale_excluded"] / c["sampled"], 4)
            arm_out[f"by_{key}"] = dict(sorted(cells.items(), key=lambda kv: _bucket_order(kv[0])))
        adm = [m for m in rows if m[4]]
        arm_out["sampled"], arm_out["admitted"] = len(rows), len(adm)
        arm_out["mean_response_len_sampled"] = round(statistics.fmean(m[1] for m in rows), 2)
        arm_out["mean_response_len_admitted"] = round(statistics.fmean(m[1] for m in adm), 2) if adm else None
        out[name] = arm_out
    return out


def _bucket_order(label: str) -> tuple[int, str]:
    digits = "".join(ch for ch in label.split("-")[0] if ch.isdigit())
    return (int(digits) if digits else -1, label)


def _mean_std(xs: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(xs), 4), "std": round(statistics.pstdev(xs), 4) if len(xs) > 1 else 0.0,
            "n": len(xs)}


def summarize(runs: list[dict[str, Any]], cfg: GatesConfig) -> dict[str, Any]:
    """Per arm: held-out success per iteration (mean +- std over seeds), the final
    value, and the token economics (useful tokens per training second)."""
    out: dict[str, Any] = {}
    for name in cfg.arms:
        rs = [r for r in runs if r["arm"] == name]
        if not rs:
            continue
        k_max = min(len(r["curve"]) for r in rs)
        per_iter = [_mean_std([r["curve"][k]["heldout_success"] for r in rs]) for k in range(k_max)]
        tool = [_mean_std([r["curve"][k]["heldout_tool_use"] for r in rs]) for k in range(k_max)]
        its = [c for r in rs for c in r["curve"][1:]]
        trained = sum(c["trained_tokens"] for c in its)
        useful = sum(c["useful_tokens"] for c in its)
        train_s = sum(c["train_s"] for c in its)
        mean_curve = [statistics.fmean(r["curve"][k]["heldout_success"] for k in range(1, k_max)) for r in rs]
        out[name] = {
            "heldout_success_by_iteration": per_iter, "heldout_tool_use_by_iteration": tool,
            "final_heldout_success": per_iter[-1], "mean_heldout_success_after_v0": _mean_std(mean_curve),
            "admitted_groups": sum(c["admitted_groups"] for c in its), "sampled": sum(c["sampled"] for c in its),
            "trained_tokens": trained, "useful_tokens": useful, "useful_share": round(useful / trained, 4)
            if trained else None, "train_s": round(train_s, 1),
            "useful_tokens_per_train_s": round(useful / train_s, 1) if train_s else None,
            "trained_tokens_per_train_s": round(trained / train_s, 1) if train_s else None,
        }
    return out


def bootstrap_ci(xs: list[float], *, resamples: int = 10000, seed: int = 0, level: float = 0.95) -> list[float]:
    """Percentile bootstrap interval of the mean of ``xs`` (resampling the values with
    replacement, a seeded ``random.Random``: the same input gives the same interval)."""
    import random

    if not xs:
        return [float("nan"), float("nan")]
    rng = random.Random(seed)
    n = len(xs)
    means = sorted(statistics.fmean(rng.choices(xs, k=n)) for _ in range(resamples))
    lo = means[int((1 - level) / 2 * resamples)]
    hi = means[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return [round(lo, 4), round(hi, 4)]


PAIRS = (("gates_on", "infra_as_zero"), ("gates_on", "zero_var_kept"), ("async_lag1", "async_no_freshness"),
         ("async_tis", "async_no_freshness"))
GATED_ASYNC = ("async_lag1", "async_tis")     # the arms that guard against staleness, vs async_no_freshness


def ablation(runs: list[dict[str, Any]], arms: tuple[str, ...]) -> dict[str, Any]:
    """The ``--json`` document's core: per arm, held-out success per updated version
    for each seed (``seeds``), the mean over seeds of the per-seed mean over versions
    (``mean_heldout``) with a seeded bootstrap 95% interval over seeds (``ci95``); per
    pair of arms run on the same seeds, the per-seed difference of those means, its
    mean and bootstrap interval (paired by seed: both arms start from the same
    version 0)."""
    out: dict[str, Any] = {"arms": {}, "differences": {}}
    per_seed: dict[str, dict[str, float]] = {}
    for name in arms:
        rs = sorted((r for r in runs if r["arm"] == name), key=lambda r: r["seed"])
        if not rs:
            continue
        seeds = {str(r["seed"]): [c["heldout_success"] for c in r["curve"][1:]] for r in rs}
        tool = {str(r["seed"]): [c["heldout_tool_use"] for c in r["curve"][1:]] for r in rs}
        means = {k: statistics.fmean(v) for k, v in seeds.items() if v}
        per_seed[name] = means
        out["arms"][name] = {
            "mean_heldout": round(statistics.fmean(means.values()), 4) if means else None,
            "ci95": bootstrap_ci(list(means.values())), "seeds": seeds,
            "version0": {str(r["seed"]): r["curve"][0]["heldout_success"] for r in rs},
            "heldout_tool_use": tool,
            "trained_tokens": sum(c["trained_tokens"] for r in rs for c in r["curve"][1:]),
            "sampled": sum(c["sampled"] for r in rs for c in r["curve"][1:]),
        }
    for a, b in PAIRS:
        if a in per_seed and b in per_seed:
            common = sorted(set(per_seed[a]) & set(per_seed[b]), key=int)
            d = [per_seed[a][k] - per_seed[b][k] for k in common]
            out["differences"][f"{a}-{b}"] = {"mean": round(statistics.fmean(d), 4) if d else None,
                                              "ci95": bootstrap_ci(d), "seeds": dict(zip(common, [round(x, 4)
                                                                                                  for x in d]))}
    gated = [g for g in GATED_ASYNC if f"{g}-async_no_freshness" in out["differences"]]
    if gated:       # the best guard by mean held-out success (chosen after the fact: an optimistic pick)
        best = max(gated, key=lambda g: out["arms"][g]["mean_heldout"])
        d = out["differences"][f"{best}-async_no_freshness"]
        out["best_gated_async"] = {"arm": best, "difference": d, "target_interval_above_0": d["ci95"][0] > 0}
    return out


def machine_info() -> dict[str, Any]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                                timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        commit = ""
    return {"platform": platform.platform(), "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "git_commit": commit}


def run_all(cfg: GatesConfig, root: Path) -> dict[str, Any]:
    from pipeline.demo import warm_start_overrides
    from pipeline.lake.delta import Lake
    from pipeline.rollout.policy import init_policy

    arms = resolve_arms(cfg)
    _register_infra0_env(tuple(sorted({a.env for a in arms})))
    info = machine_info()
    t_all = time.perf_counter()
    runs, v0s = [], {}
    envs = sorted({a.env for a in arms})
    for i, seed in enumerate(cfg.seeds):
        for env in envs:
            base = root / f"v0-{env}-seed{seed}"
            t0 = time.perf_counter()
            extra: dict[str, Any] = {} if cfg.warm_start_steps is None else {"warm_start_steps": cfg.warm_start_steps}
            if cfg.warm_start_tool_fraction is not None:
                extra["tool_fraction"] = cfg.warm_start_tool_fraction
            init_policy(Lake(base), seed=seed, **warm_start_overrides(env), **extra)
            _, s0, tool0 = _evaluate(Lake(base), cfg.eval_n, env)
            v0s[f"{env}/{seed}"] = {"heldout_success": s0, "heldout_tool_use": tool0,
                                    "warm_start_s": round(time.perf_counter() - t0, 1)}
            print(f"seed {seed}: {env} version 0 held-out success {s0:.2f} (tool use {tool0:.2f})", flush=True)
        order = arms[i % len(arms):] + arms[:i % len(arms)]     # rotate the arm order per seed
        for arm in order:
            lake_dir = root / f"{arm.name}-seed{seed}"
            shutil.copytree(root / f"v0-{arm.env}-seed{seed}", lake_dir)
            runs.append(run_arm(Lake(lake_dir), arm, seed, cfg, v0s[f"{arm.env}/{seed}"]))
            if os.environ.get("GATES_PARTIAL"):     # keep what finished if a long run dies later
                Path(os.environ["GATES_PARTIAL"]).write_text(json.dumps({"version0": v0s, "runs": runs}))
            shutil.rmtree(lake_dir, ignore_errors=True)
        for env in envs:
            shutil.rmtree(root / f"v0-{env}-seed{seed}", ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()
    return {"benchmark": "gates", "config": asdict(cfg), "machine": info, "arm_specs": [asdict(a) for a in arms],
            "version0": v0s, "runs": runs, "summary": summarize(runs, cfg), **ablation(runs, cfg.arms),
            "rejections": rejections(runs, cfg.arms, cfg.length_edges),
            "seconds": round(time.perf_counter() - t_all, 1)}


COLORS = {"gates_on": "#1f77b4", "infra_as_zero": "#d62728", "zero_var_kept": "#2ca02c",
          "async_no_freshness": "#ff7f0e", "async_lag1": "#9467bd", "async_tis": "#8c564b", "tool_gates_on": "#1f77b4",
          "tool_infra_as_zero": "#d62728"}


def _slow_lag(result: dict[str, Any]) -> int:
    lags = [a.get("slow_lag", 0) for a in result.get("arm_specs", []) if a.get("slow_lag")]
    return max(lags) if lags else 3


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    panels = [("(a) vs (b): 20% tool timeouts", ["gates_on", "infra_as_zero"]),
              (f"(c) async, slow class {_slow_lag(result)} versions behind",
               ["async_lag1", "async_tis", "async_no_freshness"]),
              ("(d) zero-variance groups", ["gates_on", "zero_var_kept"])]
    if "tool_gates_on" in s:
        panels.append(("(b) on arithmetic-tool, 20% tool timeouts", ["tool_gates_on", "tool_infra_as_zero"]))
    panels = [p for p in panels if any(n in s for n in p[1])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.8), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, (title, names) in zip(axes, panels):
        for name in names:
            if name not in s:
                continue
            m = [p["mean"] for p in s[name]["heldout_success_by_iteration"]]
            sd = [p["std"] for p in s[name]["heldout_success_by_iteration"]]
            xs = list(range(len(m)))
            label = name
            if title.startswith("(d)") and s[name].get("useful_share") is not None:
                label += f" ({100 * s[name]['useful_share']:.0f}% of trained tokens useful)"
            ax.plot(xs, m, marker="o", color=COLORS[name], label=label)
            ax.fill_between(xs, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)],
                            color=COLORS[name], alpha=0.15)
            if "timeouts" in title:
                t = [p["mean"] for p in s[name]["heldout_tool_use_by_iteration"]]
                ax.plot(xs, t, linestyle="--", color=COLORS[name], alpha=0.7, label=f"{name}: held-out tool use")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("iteration (policy updates)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("held-out greedy success")
    seeds = result["config"]["seeds"]
    fig.suptitle(f"{result['config']['groups']}x{result['config']['group_size']} rollouts per "
                 f"iteration, mean ± std over seeds {list(seeds)}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(result: dict[str, Any]) -> str:
    """The README table: held-out success per version (mean ± std over seeds) and token economics."""
    s = result["summary"]
    k = len(next(iter(s.values()))["heldout_success_by_iteration"])
    head = ("| arm | " + " | ".join(f"v{i}" if i == 0 else f"after {i}" for i in range(k))
            + " | mean after v0 | held-out tool use (last) | admitted groups | useful / trained tokens "
            "| useful tokens per train-s |")
    lines = [head, "|" + "---|" * (k + 6)]
    for name, v in s.items():
        cells = [f"{p['mean']:.2f} ± {p['std']:.2f}" for p in v["heldout_success_by_iteration"]]
        m = v["mean_heldout_success_after_v0"]
        tool = v["heldout_tool_use_by_iteration"][-1]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | **{m['mean']:.3f} ± {m['std']:.3f}** | "
                     f"{tool['mean']:.2f} ± {tool['std']:.2f} | {v['admitted_groups']}/{v['sampled'] // result['config']['group_size']} | "
                     f"{v['useful_tokens']}/{v['trained_tokens']} ({100 * (v['useful_share'] or 0):.0f}%) | "
                     f"{v['useful_tokens_per_train_s'] or 0:.0f} |")
    return "\n".join(lines)


def pool(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Results files of the same config on disjoint seeds as one: their runs pooled and the
    intervals, differences and rejection rates recomputed over all seeds."""
    if len(results) == 1:
        return results[0]
    keys = ("seeds",)
    cfgs = [{k: v for k, v in r["config"].items() if k not in keys} for r in results]
    if any(c != cfgs[0] for c in cfgs[1:]):
        raise SystemExit("--async-table pools only results of the same config (other seeds); these differ")
    seeds = [s for r in results for s in r["config"]["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--async-table pools disjoint seeds; seeds repeat: {sorted(seeds)}")
    runs = [x for r in results for x in r["runs"]]
    arms = tuple(results[0]["config"]["arms"])
    edges = tuple(results[0]["config"]["length_edges"])
    return {**results[0], "runs": runs, **ablation(runs, arms), "rejections": rejections(runs, arms, edges)}


def async_tables(result: dict[str, Any]) -> str:
    """docs/gates.md's async tables from a results file: held-out success per arm with its
    interval, the paired differences against async_no_freshness, and the rejection rates."""
    arms = [a for a in ("async_no_freshness", "async_lag1", "async_tis") if a in result["arms"]]
    k = max(len(v) for a in arms for v in result["arms"][a]["seeds"].values())
    lines = ["| arm | mean held-out over versions 1.." + str(k) + " | 95% CI over seeds | per version (mean over seeds) "
             "| per seed |", "|---|---|---|---|---|"]
    for a in arms:
        v = result["arms"][a]
        per_v = [statistics.fmean(c[i] for c in v["seeds"].values() if len(c) > i) for i in range(k)]
        per_s = " ".join(f"{statistics.fmean(c):.3f}" for _, c in sorted(v["seeds"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"| `{a}` | **{v['mean_heldout']:.3f}** | [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}] | "
                     + " ".join(f"{x:.2f}" for x in per_v) + f" | {per_s} |")
    for name, d in result["differences"].items():
        if name.endswith("-async_no_freshness"):
            per_s = " ".join(f"{x:+.3f}" for _, x in sorted(d["seeds"].items(), key=lambda kv: int(kv[0])))
            lines.append(f"| difference `{name}` (paired) | **{d['mean']:+.3f}** | [{d['ci95'][0]:+.3f}, "
                         f"{d['ci95'][1]:+.3f}] | | {per_s} |")
    best = result.get("best_gated_async")
    if best:
        d = best["difference"]
        lines += ["", f"best gated arm: `{best['arm']}`, {d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] "
                  f"over `async_no_freshness`; target (interval above 0): "
                  f"{'met' if best['target_interval_above_0'] else 'missed'}"]
    rej = result.get("rejections", {})
    lines += ["", "| arm | by | bucket | sampled | admitted | rejection rate | stale-excluded |", "|---|---|---|---|---|---|---|"]
    for a in arms:
        for by in ("by_difficulty", "by_length_bucket", "by_class"):
            for bucket, c in rej.get(a, {}).get(by, {}).items():
                lines.append(f"| `{a}` | {by[3:]} | {bucket} | {c['sampled']} | {c['admitted']} | "
                             f"{c['rejection_rate']:.3f} | {c['stale_exclusion_rate']:.3f} |")
    lines += ["", "| arm | mean response_len sampled | mean response_len admitted |", "|---|---|---|"]
    for a in arms:
        r = rej.get(a, {})
        lines.append(f"| `{a}` | {r.get('mean_response_len_sampled')} | {r.get('mean_response_len_admitted')} |")
    return "\n".join(lines)


def run(quick: bool = False) -> list:
    """For benchmarks/run.py: ratios of each ablation's mean held-out success to gates_on's."""
    from run import Result

    cfg = GatesConfig(seeds=(0,), iterations=2, groups=8, eval_n=40) if quick else GatesConfig()
    with tempfile.TemporaryDirectory(prefix="bench-gates-") as tmp:
        res = run_all(cfg, Path(tmp))
    if not quick:
        _write(res)
    s = res["summary"]
    base = s["gates_on"]["mean_heldout_success_after_v0"]["mean"]
    out = []
    for name, v in s.items():
        if name == "gates_on":
            continue
        m = v["mean_heldout_success_after_v0"]
        out.append(Result(f"gates: {name} mean held-out success / gates_on", m["mean"] / base if base else 0.0,
                          None, f"{m['mean']:.3f} ± {m['std']:.3f}", f"{base:.3f}", higher_is_better=True))
    return out


def _write(res: dict[str, Any]) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    out = HERE / "results" / f"gates-{stamp}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    plot(res, ROOT / "docs" / "gates.png")
    return out


def _merge(paths: list[str]) -> dict[str, Any]:
    """Results files of separate runs (e.g. the main arms and the arithmetic-tool arms) as one."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    out = dict(results[0])
    out["summary"] = {k: v for r in results for k, v in r["summary"].items()}
    return out


def _ints(text: str, flag: str = "--seeds") -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    import contextlib

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 seed, 2 iterations, nothing written")
    ap.add_argument("--plot", nargs="+", help="redraw docs/gates.png from results files (arms merged) and exit")
    ap.add_argument("--arms", help="comma-separated subset of arms")
    ap.add_argument("--env", help="run the main arms on this environment (e.g. flaky-tool)")
    ap.add_argument("--seeds", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--iterations", type=int, help="policy updates per run (default 4)")
    ap.add_argument("--groups", type=int, help="groups sampled per iteration (default 16)")
    ap.add_argument("--group-size", type=int, help="trajectories per group (default 8)")
    ap.add_argument("--eval-n", type=int, help="held-out tasks evaluated per version (default 100)")
    ap.add_argument("--lr", type=float, help="trainer learning rate (default 3e-4)")
    ap.add_argument("--tool-timeout-p", type=float, help="injected tool timeouts per call (default: the env's "
                    "train_tool_timeout_p, else 0.2)")
    ap.add_argument("--warm-start-steps", type=int, help="supervised warm-start steps of version 0")
    ap.add_argument("--warm-start-tool-fraction", type=float, help="share of version 0's demonstrations that "
                    "call the tool (default 0.4)")
    ap.add_argument("--slow-lag", type=int, help="versions the async arms' slow class is behind (default 3)")
    ap.add_argument("--length-edges", help="comma-separated response_len edges of the rejection table "
                    "(default 10,30)")
    ap.add_argument("--json", action="store_true", help="print ONE JSON document on stdout (progress on stderr)")
    ap.add_argument("--out", help="also write the JSON document to this file")
    ap.add_argument("--no-write", action="store_true", help="do not write results/gates-<time>.json and the plot")
    ap.add_argument("--table", nargs="+", help="print the README table of these results files and exit")
    ap.add_argument("--async-table", nargs="+", help="print docs/gates.md's async tables (success, differences, "
                    "rejection rates) of these results files (runs of one config on other seeds, pooled) and exit")
    args = ap.parse_args(argv)
    if args.plot:
        plot(_merge(args.plot), ROOT / "docs" / "gates.png")
        return 0
    if args.table:
        print(markdown_table(_merge(args.table)))
        return 0
    if args.async_table:
        print(async_tables(pool([json.loads(Path(p).read_text()) for p in args.async_table])))
        return 0
    cfg = GatesConfig(seeds=(0,), iterations=2, groups=8, eval_n=40) if args.quick else GatesConfig()
    over: dict[str, Any] = {}
    if args.arms:
        over["arms"] = tuple(args.arms.split(","))
    if args.seeds:
        over["seeds"] = _ints(args.seeds)
    for key in ("env", "iterations", "groups", "group_size", "eval_n", "lr", "tool_timeout_p", "warm_start_steps",
                "warm_start_tool_fraction", "slow_lag"):
        if getattr(args, key) is not None:
            over[key] = getattr(args, key)
    if args.length_edges:
        over["length_edges"] = _ints(args.length_edges, "--length-edges")
    cfg = GatesConfig(**{**asdict(cfg), **over})
    resolve_arms(cfg)                        # unknown arm names fail before any work
    with tempfile.TemporaryDirectory(prefix="bench-gates-") as tmp:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            res = run_all(cfg, Path(tmp))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(json.dumps(res["summary"], indent=1))
    print(json.dumps({"arms": {k: {x: v[x] for x in ("mean_heldout", "ci95")} for k, v in res["arms"].items()},
                      "differences": res["differences"], "best_gated_async": res.get("best_gated_async"),
                      "rejections": res["rejections"]}, indent=1))
    print(markdown_table(res))
    if not (args.quick or args.no_write):
        print(f"wrote {_write(res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
