"""Streaming rollout vs the wave harness, and in-place weight switches vs new engines.

Rollout: ``pipeline rollout`` on arithmetic-tool, 32 groups x 8, the warm-started
policy ``pipeline policy init`` makes, transformers engine, one worker, one
thread, with the seeded tool-latency model of the rollout config
(``tool_latency_ms=300 tool_latency_sigma=1 slow_tool_p=0.05``: a lognormal
with mean 300 ms, 5% of the calls 10x). Figures, each from runs in this
process with the order alternated (A B C, then C B A; the better of two):

- streaming / waves trajectories/s at that latency (``schedule=stream`` vs
  ``schedule=waves``, the lockstep baseline);
- streaming with that latency / streaming with zero tool latency;
- the engine's busy share of the streaming run's wall time (after start-up:
  ``engine_busy_s / rollout_seconds``);
- streaming with over-provisioning (``group_redundancy=0.25``, every group in
  flight from the start) / streaming: trajectories of the N complete groups
  per second (the cancelled stragglers and the spare groups are not counted);
- continuous (``follow``, two rounds of N/2 groups, N/2 groups in flight: the
  same group indices and seeds as one round of N) / the same two rounds as
  two ``pipeline rollout`` runs back to back (what the async demo did: each
  round waits for its tail) trajectories/s.

Trajectories/s = trajectories / rollout_seconds (engine start-up excluded).
Tool calls get 64 slots in both orders (they are waits on remote services),
``flush_seconds=2``. The same figures again with a 4x wider, 2x deeper
policy (hidden 256, 4 layers; 100 warm-start steps), where generation rather than the
tools' latency is the work, as it is with a real model.
Sampling is seeded per sample, so every run produces the same trajectories:
only timing differs (checked: every arm but over-provisioning whole; the
over-provisioned arm's complete groups among the first N against the
streaming run's).

Weight switch: switching a running engine to another policy in place
(``Engine.load_weights``: transformers ``load_state_dict``, vLLM
``collective_rpc("reload_weights")``) / building a new engine on it
(close + ``make_engine``, what a version switch cost before), on the demo
policy and on a 100M+ parameter Llama (random weights), hf and vLLM.

    .venv/bin/python benchmarks/run.py --only rollout
    BENCH_ROLLOUT_GROUPS=8 .venv/bin/python benchmarks/run.py --only rollout   # smaller
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path

from run import Result

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
LATENCY = {"tool_latency_ms": 300.0, "tool_latency_sigma": 1.0, "slow_tool_p": 0.05}
# tool calls are waits on remote services: both orders get the same 64 slots; shipping every 2 s
COMMON = {"tool_concurrency": 64, "flush_seconds": 2.0}


def _rollout(hf_dir: Path, tmp: Path, name: str, groups: int, **over) -> dict:
    import pyarrow.dataset as ds

    from pipeline.lake.delta import Lake
    from pipeline.rollout.run import RolloutConfig, run_rollout

    lake = Lake(tmp / name / "lake")
    rounds = over.pop("sequential", 0)
    if over.get("follow") or rounds:  # rounds of groups/rounds: the same group indices as one round of `groups`
        groups //= over.get("rounds") or rounds
    cfg = RolloutConfig(env="arithmetic-tool", policy=str(hf_dir), groups=groups, group_size=8, seed=0,
                        run_id=name.split(".")[0], **COMMON, **over)
    s = run_rollout(lake, cfg)
    for k in range(1, rounds):        # the baseline of continuous mode: rounds back to back, each waits for its tail
        more = run_rollout(lake, cfg, group_offset=k * groups)
        s.trajectories += more.trajectories
        s.rollout_seconds += more.rollout_seconds
        s.engine_busy_s += more.engine_busy_s
        s.engine_steps += more.engine_steps
        s.tool_executions += more.tool_executions
    s.engine_busy_share = s.engine_busy_s / s.rollout_seconds
    rows = lake.read("trajectories", columns=["trajectory_id", "response_ids", "reward", "group_id", "stop_reason"],
                     filter=ds.field("run_id") == name.split(".")[0]).to_pylist()
    n = groups * (over.get("rounds") or rounds or 1)
    if over.get("group_redundancy"):  # the N complete groups' trajectories: spares and stragglers aside
        spoiled = {r["group_id"] for r in rows if r["stop_reason"] == "cancelled"}
        rows = [r for r in rows if r["group_id"] not in spoiled and int(r["group_id"].rsplit("-g", 1)[1]) < n]
    useful = s.groups_complete * 8 if s.groups_complete is not None else s.trajectories
    return {"trajectories": useful, "rollout_s": s.rollout_seconds, "cancelled": s.cancelled,
            "traj_per_s": useful / s.rollout_seconds, "engine_busy_s": s.engine_busy_s, "bound_by": s.bound_by,
            "busy_share": s.engine_busy_share, "engine_steps": s.engine_steps, "tool_calls": s.tool_executions,
            "waits_ms": s.waits_ms, "statuses": s.statuses,
            "outcome": sorted((r["trajectory_id"].rsplit("-g", 1)[1], tuple(r["response_ids"]), r["reward"])
                              for r in rows),
            "outcome_by_key": [(r["trajectory_id"].rsplit("-g", 1)[1], (tuple(r["response_ids"]), r["reward"]))
                               for r in rows]}


def _rollouts(hf_dir: Path, tmp: Path, groups: int, label: str) -> list[Result]:
    configs = {"stream_latency": dict(schedule="stream", **LATENCY),
               "waves_latency": dict(schedule="waves", **LATENCY),
               "stream_zero": dict(schedule="stream"),
               "stream_spare": dict(schedule="stream", group_redundancy=0.25,
                                    groups_per_wave=max(32, math.ceil(groups * 1.25)), **LATENCY),
               "continuous": dict(schedule="stream", follow=True, rounds=2, groups_per_wave=max(1, groups // 2),
                                  **LATENCY),
               "rounds": dict(schedule="stream", sequential=2, groups_per_wave=max(1, groups // 2), **LATENCY)}
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    order = list(configs) + list(reversed(configs))          # alternated: A B C C B A
    for i, name in enumerate(order):
        runs[name].append(_rollout(hf_dir, tmp / label.replace(" ", "-").replace(",", ""), f"{name}.{i}", groups,
                                   **configs[name]))
        print(f"  {name}: {runs[name][-1]['traj_per_s']:.2f} traj/s, busy {runs[name][-1]['busy_share']:.2f}",
              flush=True)
    outcomes = {r["outcome"].__repr__() for k, rs in runs.items() for r in rs if k != "stream_spare"}
    base = dict(runs["stream_latency"][0]["outcome_by_key"])
    same = len(outcomes) == 1 and all(base.get(k) == v for r in runs["stream_spare"] for k, v in r["outcome_by_key"])
    best = {k: max(v, key=lambda r: r["traj_per_s"]) for k, v in runs.items()}
    for r in runs.values():
        for x in r:
            x.pop("outcome")
            x.pop("outcome_by_key")
    s, w, z = best["stream_latency"], best["waves_latency"], best["stream_zero"]
    o, c, q = best["stream_spare"], best["continuous"], best["rounds"]
    n = s["trajectories"]
    scale = f"{label}; {groups} groups x 8, hf, 1 worker, 1 thread, tool_concurrency 64"
    lat = "tool latency lognormal mean 300 ms sigma 1, slow_tool_p 0.05"
    note = f"{scale}; {lat}; best of 2, order alternated; same trajectories in every run: {same}"
    raw = {"runs": runs, "same_trajectories": same, "latency": LATENCY}
    return [
        Result(name=f"rollout {groups}x8 arithmetic-tool ({label}), {lat}: streaming / waves trajectories/s",
               ratio=s["traj_per_s"] / w["traj_per_s"], target=2.0, higher_is_better=True,
               measured=f"streaming {s['traj_per_s']:.2f} traj/s ({n} in {s['rollout_s']:.1f}s)",
               baseline=f"waves {w['traj_per_s']:.2f} traj/s ({n} in {w['rollout_s']:.1f}s)", note=note, raw=raw),
        Result(name=f"rollout {groups}x8 streaming ({label}): with tool latency / zero latency trajectories/s",
               ratio=s["traj_per_s"] / z["traj_per_s"], target=0.8, higher_is_better=True,
               measured=f"with latency {s['traj_per_s']:.2f} traj/s ({s['rollout_s']:.1f}s)",
               baseline=f"zero latency {z['traj_per_s']:.2f} traj/s ({z['rollout_s']:.1f}s)", note=note,
               possible=(0.0, 1.0)),   # added latency cannot make the same run faster (issue 39)
        Result(name=f"rollout {groups}x8 streaming ({label}) with tool latency: engine busy share of the wall",
               ratio=s["busy_share"], target=0.8, higher_is_better=True,
               measured=f"engine busy {s['engine_busy_s']:.1f}s of {s['rollout_s']:.1f}s "
                        f"({s['engine_steps']} engine calls)",
               baseline=f"waves: {w['busy_share']:.2f} ({w['engine_busy_s']:.1f}s of {w['rollout_s']:.1f}s); "
                        f"zero latency: {z['busy_share']:.2f}", note=note),
        Result(name=f"rollout {groups}x8 streaming + over-provisioning r=0.25 ({label}), {lat}: / streaming "
                    "trajectories/s of the N complete groups",
               ratio=o["traj_per_s"] / s["traj_per_s"], target=1.0, higher_is_better=True,
               measured=f"over-provisioned {o['traj_per_s']:.2f} traj/s ({o['trajectories']} in "
                        f"{o['rollout_s']:.1f}s, {o['cancelled']} stragglers cancelled)",
               baseline=f"streaming {s['traj_per_s']:.2f} traj/s ({s['rollout_s']:.1f}s)", note=note),
        Result(name=f"rollout {groups}x8 continuous, 2 rounds of {groups // 2} ({label}), {lat}: / the 2 rounds "
                    "back to back trajectories/s",
               ratio=c["traj_per_s"] / q["traj_per_s"], target=1.0, higher_is_better=True,
               measured=f"continuous {c['traj_per_s']:.2f} traj/s ({c['trajectories']} in {c['rollout_s']:.1f}s, "
                        f"engine busy {c['busy_share']:.2f})",
               baseline=f"back to back {q['traj_per_s']:.2f} traj/s ({q['rollout_s']:.1f}s, engine busy "
                        f"{q['busy_share']:.2f})", note=note),
    ]


def _perturbed_copy(src: Path, dst: Path, seed: int) -> Path:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _switch(engine_name: str, label: str, a: Path, b: Path, repeat: int, rebuilds: int) -> Result:
    """In-place switches a -> b -> a ... vs building a new engine on the other policy: the
    first build (start-up on ``a``) plus ``rebuilds`` close + make_engine (alternated with
    the in-place switches); vLLM start-up takes minutes on a loaded box, so it rebuilds less."""
    from pipeline.rollout.backends import make_engine, switch_weights

    t0 = time.perf_counter()
    eng = make_engine(engine_name, a, threads=1)
    rebuild = [time.perf_counter() - t0]
    inplace = []
    dirs = [b, a]
    for i in range(repeat):
        eng, rec = switch_weights(eng, dirs[i % 2], mode="in_place", threads=1)
        assert rec["mode"] == "in_place", rec
        inplace.append(rec["seconds"])
        if i < rebuilds:
            eng, rec = switch_weights(eng, dirs[(i + 1) % 2], mode="rebuild", threads=1)
            rebuild.append(rec["seconds"])
    eng.close()
    ip, rb = min(inplace), min(rebuild)
    return Result(name=f"weight switch {engine_name}, {label}: in place / new engine",
                  ratio=ip / rb, target=0.10, measured=f"in place {ip:.3f}s (load_weights)",
                  baseline=f"new engine {rb:.2f}s (make_engine; best of {len(rebuild)})",
                  note=f"in place best of {repeat}, 1 thread",
                  raw={"in_place_s": inplace, "new_engine_s": rebuild})


def _params(hf_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def run(quick: bool = False) -> list[Result]:
    from pipeline.lake.delta import Lake
    from pipeline.rollout import hf as hfmod
    from pipeline.rollout.policy import init_policy

    groups = 4 if quick else int(os.environ.get("BENCH_ROLLOUT_GROUPS", 32))
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as t:
        tmp = Path(t)
        ref = init_policy(Lake(tmp / "policy"), warm_start_steps=30 if quick else 300)
        results = _rollouts(Path(ref.hf_dir), tmp, groups, "demo policy")
        if not quick and os.environ.get("BENCH_ROLLOUT_BIG", "1") != "0":
            # the same task where generation, not the tools, is the work (as with a real model on
            # any hardware): a 4x wider, 2x deeper policy, warm-started the same way
            big_ref = init_policy(Lake(tmp / "policy-big"), warm_start_steps=100, batch_size=32, tool_fraction=0.5,
                                  hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8)
            results += _rollouts(Path(big_ref.hf_dir), tmp, groups, "policy hidden 256, 4 layers")
        demo_b = _perturbed_copy(Path(ref.hf_dir), tmp / "demo-b", 1)
        results.append(_switch("hf", "demo policy (hidden 64, 2 layers)", Path(ref.hf_dir), demo_b, 3, 3))
        engines = ["hf"] + ([] if quick or os.environ.get("BENCH_ROLLOUT_VLLM", "1") == "0" else ["vllm"])
        if "vllm" in engines:
            results.append(_switch("vllm", "demo policy (hidden 64, 2 layers)", Path(ref.hf_dir), demo_b, 2, 0))
        if not quick:
            big_a = tmp / "big-a"
            hfmod.save_policy(hfmod.build_model(hfmod.Arch(hidden_size=768, intermediate_size=3072,
                                                           num_hidden_layers=12, num_attention_heads=12,
                                                           max_position_embeddings=128), seed=0), big_a)
            n = _params(big_a)
            big_b = _perturbed_copy(big_a, tmp / "big-b", 2)
            for e in engines:
                results.append(_switch(e, f"random Llama {n / 1e6:.0f}M params (hidden 768, 12 layers)",
                                       big_a, big_b, 2, 1 if e == "hf" else 0))
    return results
