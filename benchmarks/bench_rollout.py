"""Rollout through heavy-tailed tool latency: does the engine stay busy? (issue 40 item 4)

The load: ``tool-relay`` (pipeline/rollout/envs/relay.py), multi-turn episodes
that make exactly 3 tool calls each whatever the policy writes (each turn's
text is the tool's argument; the turn after the third observation is
verified), groups of 8, ``pipeline rollout`` with the transformers engine, one
worker, one torch thread, tool pools sized for I/O (the default: one thread
per episode in flight). Tool latency: the seeded model of the rollout config,
a lognormal with mean 300 ms and sigma 1, 5% of the calls 10x slower
(``tool_latency_ms=300 tool_latency_sigma=1 slow_tool_p=0.05``), deadline
100 s per call (so no call times out: a timeout would change the trajectory).

Two policies:

- **engine-bound**: the 113M-parameter random Llama shape (hidden 768, 12
  layers, 12 heads, MLP 3072: the shape of the weight-switch benchmark),
  random weights. Generation is the work, as with a real model.
- **demo**: the policy ``pipeline policy init`` makes (hidden 64, 2 layers),
  lightly warm-started; generation is nearly free, the tools are the work.

Four arms, each at zero latency and with the latency, on the same N groups
(same group indices, same seeds, so the same tasks and sampling seeds):
``waves`` (``schedule=waves``: the lockstep baseline, ``groups_per_wave``
groups per wave, each turn waits for the wave's slowest tool call),
``streaming`` (``schedule=stream``: a new group starts when there is room),
``spare`` (streaming + over-provisioning, ``group_redundancy=0.25``: the
run ends once N groups are complete, the stragglers cancelled; its in-flight
bound has room for the spares, ceil(0.25 x) more groups, so they run beside
the others instead of after them) and
``continuous`` (``follow``: two rounds of N/2 groups with no barrier between
them, the same group indices as one round of N). For each arm the zero- and
the with-latency run are adjacent in time; the whole sequence runs twice,
the second time in reverse order (A0 A1 B0 B1 ... then ... B1 B0 A1 A0), and
each figure is the mean of the two repetitions' ratios (both are in the raw
results).

Trajectories/s = trajectories of the N groups / ``rollout_seconds`` (the
engine's start-up excluded); for ``spare`` only the N complete groups count.
Engine busy share = the engine's generating time / ``rollout_seconds``.

Every run's trajectories are compared, token for token and reward for
reward, with the first zero-latency streaming run's: sampling is seeded per
sample and the tool is deterministic, so every arm must produce the same
ones (the over-provisioned arm: its complete groups among the first N). The
counts are in the raw results and a mismatch fails the run.

Figures (``derive``):

- engine-bound, zero latency, streaming: the engine's busy share of the wall
  (how much of the wall is generation; no target, it says how engine-bound
  the policy is);
- engine-bound, per arm: trajectories/s with latency / at zero latency
  (target >= 0.8, moonshot 0.9; added latency cannot make the same run
  faster: a ratio over 1 + ``NOISE`` fails the run) and the engine busy
  share with latency (target >= 0.9, moonshot 0.95); waves is the baseline
  (no target);
- demo, per arm: wall with latency / (wall at zero latency, i.e. the
  generation, + the p95 of one episode's total tool time) (target <= 1);
- weight switch (hf): in place / a new engine, demo policy and the 113M
  Llama (vLLM too with ``BENCH_ROLLOUT_VLLM=1``: its start-up takes minutes).

Sizes (full run, sized for <= 20 minutes on the shared 2-core box at load
~13, where one engine-bound run of 6 groups took 70-80 s): engine-bound
``BENCH_ROLLOUT_GROUPS`` = 4 groups x 8, 2 groups in flight
(``BENCH_ROLLOUT_INFLIGHT``), 6 tokens per model turn (4 turns, 3 tool
calls); demo ``BENCH_ROLLOUT_DEMO_GROUPS`` = 8 groups x 8, every launched
group in flight at once; 2 repetitions (``BENCH_ROLLOUT_REPEATS``). The
over-provisioned arm's busy time includes the generation its cancelled
stragglers got.

    .venv/bin/python benchmarks/run.py --only rollout
    .venv/bin/python benchmarks/run.py --only rollout --quick     # smoke: 2 groups x 4, one repetition
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from pathlib import Path

from run import Result

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
LATENCY = {"tool_latency_ms": 300.0, "tool_latency_sigma": 1.0, "slow_tool_p": 0.05}
LAT_TEXT = "tools lognormal mean 300 ms, sigma 1, 5% 10x"
ARMS = ("waves", "streaming", "spare", "continuous")
REDUNDANCY = 0.25
# the spread of identical work between two runs adjacent in time on this shared box (engine time of the
# same trajectories): a with-latency run faster than its zero-latency twin by more than this is an artifact
NOISE = 0.10
BIG = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
       "max_position_embeddings": 128}


def _sizes(quick: bool) -> dict:
    env = os.environ.get
    if quick:
        return {"groups": 2, "group_size": 4, "inflight": 1, "demo_groups": 2, "demo_inflight": 3, "repeats": 1,
                "tokens_per_turn": 6, "tool_turns": 3, "rounds": 2, "warm_start_steps": 20}
    demo = int(env("BENCH_ROLLOUT_DEMO_GROUPS", "8"))
    return {"groups": int(env("BENCH_ROLLOUT_GROUPS", "4")), "group_size": 8,
            "inflight": int(env("BENCH_ROLLOUT_INFLIGHT", "2")),
            # the demo policy: every launched group in flight at once (the spares too)
            "demo_groups": demo, "demo_inflight": demo + math.ceil(demo * REDUNDANCY),
            "repeats": int(env("BENCH_ROLLOUT_REPEATS", "2")), "tokens_per_turn": 6, "tool_turns": 3,
            "rounds": 2, "warm_start_steps": 100}


def _config(arm: str, latency: bool, run_id: str, policy: Path, groups: int, inflight: int, sz: dict):
    from pipeline.rollout.run import RolloutConfig

    over: dict = dict(LATENCY) if latency else {}
    if arm == "waves":
        over |= {"schedule": "waves"}
    elif arm == "spare":      # the spare groups run beside the others: room for them in flight
        over |= {"group_redundancy": REDUNDANCY}
        inflight += math.ceil(inflight * REDUNDANCY)
    elif arm == "continuous":
        over |= {"follow": True, "rounds": sz["rounds"]}
        groups //= sz["rounds"]          # rounds of N/R groups: the same group indices as one round of N
    turns = sz["tool_turns"]
    return RolloutConfig(env="tool-relay", policy=str(policy), groups=groups, group_size=sz["group_size"], seed=0,
                         run_id=run_id, groups_per_wave=inflight, max_turns=turns + 1,
                         max_tokens_per_turn=sz["tokens_per_turn"], max_total_tokens=64, tool_timeout_s=100.0,
                         wall_clock_s=600.0, flush_seconds=2.0, threads=1, **over)


def _one(policy: Path, tmp: Path, arm: str, latency: bool, rep: int, groups: int, inflight: int, sz: dict) -> dict:
    """One ``run_rollout`` in a fresh lake: its timing, its trajectories' digests, its episodes' tool time."""
    import pyarrow.dataset as ds

    from pipeline.lake.delta import Lake
    from pipeline.rollout.run import run_rollout

    run_id = f"{arm}-{'lat' if latency else 'zero'}-{rep}"
    lake = Lake(tmp / run_id)
    cfg = _config(arm, latency, run_id, policy, groups, inflight, sz)
    load = os.getloadavg()[0]
    s = run_rollout(lake, cfg)
    rows = lake.read("trajectories", columns=["trajectory_id", "group_id", "response_ids", "reward", "stop_reason",
                                              "num_tool_calls"]).to_pylist()
    members: dict[str, int] = {}
    for r in rows:
        members[r["group_id"]] = members.get(r["group_id"], 0) + 1
    spoiled = {r["group_id"] for r in rows if r["stop_reason"] == "cancelled"}
    # the complete groups (over-provisioned: any N of the launched ones; their stragglers cancelled)
    useful = [r for r in rows if r["group_id"] not in spoiled and members[r["group_id"]] == sz["group_size"]]
    if len(useful) != groups * sz["group_size"] and not (arm == "spare" and len(useful) > groups * sz["group_size"]):
        raise RuntimeError(f"{run_id}: {len(useful)} trajectories in complete groups, expected "
                           f"{groups} x {sz['group_size']}")
    digests = {r["trajectory_id"].split("-g", 1)[1]: hashlib.sha256(
        json.dumps([r["response_ids"], r["reward"]]).encode()).hexdigest()[:16] for r in useful}
    tool_ms: dict[str, float] = {}
    ev = lake.read("events", columns=["episode_id", "payload"],
                   filter=ds.field("event_type") == "ACTION_EXECUTED").to_pylist()
    for e in ev:
        tool_ms[e["episode_id"]] = tool_ms.get(e["episode_id"], 0.0) + json.loads(e["payload"]).get("injected_ms", 0)
    return {"arm": arm, "latency": latency, "rep": rep, "load_1m_at_start": round(load, 2),
            "rollout_s": s.rollout_seconds, "engine_busy_s": s.engine_busy_s, "engine_steps": s.engine_steps,
            "trajectories": groups * sz["group_size"], "complete": len(useful), "launched": s.trajectories, "cancelled": s.cancelled,
            "tool_calls": s.tool_executions, "min_tool_calls": min((r["num_tool_calls"] for r in useful), default=0),
            "statuses": s.statuses, "bound_by": s.bound_by, "pool_bounds": s.pool_bounds,
            "rounds": s.rounds, "episode_tool_s": sorted(round(v / 1000, 4) for v in tool_ms.values()),
            "digests": digests}


def _policy_runs(policy: Path, tmp: Path, groups: int, inflight: int, repeats: int, sz: dict, label: str) -> dict:
    order = [(a, lat) for a in ARMS for lat in (False, True)]
    runs = []
    for rep in range(repeats):
        for arm, lat in (order if rep % 2 == 0 else list(reversed(order))):
            r = _one(policy, tmp / label, arm, lat, rep, groups, inflight, sz)
            print(f"  {label} {arm:10s} {'latency' if lat else 'zero   '} rep {rep}: {r['trajectories']} traj in "
                  f"{r['rollout_s']:.1f}s, engine busy {r['engine_busy_s'] / r['rollout_s']:.2f}, load "
                  f"{r['load_1m_at_start']}", flush=True)
            runs.append(r)
    ref = next(r for r in runs if r["arm"] == "streaming" and not r["latency"])["digests"]
    checks = []
    for r in runs:
        d = r.pop("digests")
        keys = set(d) & set(ref) if r["arm"] == "spare" else set(ref) | set(d)   # spares: groups both ran
        bad = sorted(k for k in keys if d.get(k) != ref.get(k))
        checks.append({"run": f"{r['arm']}-{'lat' if r['latency'] else 'zero'}-{r['rep']}", "compared": len(keys),
                       "mismatched": len(bad), "examples": bad[:5]})
    return {"groups": groups, "inflight_groups": inflight, "runs": runs, "trajectory_checks": checks}


def _check(raw: dict) -> None:
    """The runs produced the trajectories they should: every arm the reference's, every episode its tool calls."""
    for name, p in raw["policies"].items():
        bad = [c for c in p["trajectory_checks"] if c["mismatched"] or not c["compared"]]
        if bad:
            raise RuntimeError(f"{name}: trajectories differ from the reference run (same seeds): {bad[:3]}")
        few = [r for r in p["runs"] if r["min_tool_calls"] < raw["sizes"]["tool_turns"]]
        if few:
            raise RuntimeError(f"{name}: episodes with fewer than {raw['sizes']['tool_turns']} tool calls: "
                               f"{[(r['arm'], r['rep']) for r in few]}")


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)] if xs else 0.0


def _pairs(p: dict, arm: str) -> list[tuple[dict, dict]]:
    """(zero, latency) runs of one arm, by repetition."""
    runs = [r for r in p["runs"] if r["arm"] == arm]
    return [(next(r for r in runs if r["rep"] == k and not r["latency"]),
             next(r for r in runs if r["rep"] == k and r["latency"])) for k in sorted({r["rep"] for r in runs})]


def _tps(r: dict) -> float:
    return r["trajectories"] / r["rollout_s"]


def _busy(r: dict) -> float:
    return r["engine_busy_s"] / r["rollout_s"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _spread(xs: list[float], fmt: str = ".3f") -> str:
    return "" if len(xs) < 2 else f" (repetitions {', '.join(format(x, fmt) for x in xs)})"


def _rollout_results(raw: dict) -> list[Result]:
    sz = raw["sizes"]
    out: list[Result] = []
    e = raw["policies"]["engine_bound"]
    n, g = e["groups"], sz["group_size"]
    where = (f"{n} groups x {g} tool-relay ({sz['tool_turns']} tool calls each), {e['inflight_groups']} groups in "
             f"flight, hf, 1 thread; {raw['engine_bound_params'] / 1e6:.0f}M random Llama")
    load = raw["load_1m_per_run"]
    note = (f"{where}; {LAT_TEXT}; zero/latency runs adjacent, the sequence twice (reversed); mean of "
            f"{sz['repeats']} repetition(s); load (1 min) {min(load):.1f}-{max(load):.1f} at the runs' starts; "
            f"same trajectories in every run (checked)")
    # waves runs the same engine batches with and without latency: their engine time differs by the box alone
    same = [b["engine_busy_s"] / a["engine_busy_s"] for a, b in _pairs(e, "waves")
            if a["engine_steps"] == b["engine_steps"]]
    if same:
        note += (f"; engine time of identical batches (waves) with / without latency: "
                 f"{', '.join(f'{x:.2f}' for x in same)} (the shared box's scheduling and load)")
    zero_s = [a for a, _ in _pairs(e, "streaming")]
    out.append(Result(
        name=f"rollout engine-bound {n}x{g} streaming, zero tool latency: engine busy share of the wall "
             "(generation's share)",
        ratio=_mean([_busy(r) for r in zero_s]), target=None, higher_is_better=True,
        measured=f"engine busy {_mean([r['engine_busy_s'] for r in zero_s]):.1f}s of "
                 f"{_mean([r['rollout_s'] for r in zero_s]):.1f}s{_spread([_busy(r) for r in zero_s], '.2f')}",
        baseline="the wall after start-up", note=note, possible=(0.0, 1.0)))
    for arm in ARMS:
        pairs = _pairs(e, arm)
        ratios = [_tps(b) / _tps(a) for a, b in pairs]
        a0, b0 = pairs[0]
        base = arm == "waves"
        useful = "trajectories of the N complete groups" if arm == "spare" else "trajectories"
        out.append(Result(
            name=f"rollout engine-bound {n}x{g} {arm}: {useful}/s with tool latency / zero latency",
            ratio=_mean(ratios), target=None if base else 0.8, higher_is_better=True,
            measured=f"with latency {_mean([_tps(b) for _, b in pairs]):.2f} traj/s "
                     f"({_mean([b['rollout_s'] for _, b in pairs]):.1f}s, "
                     f"{_mean([b['engine_steps'] for _, b in pairs]):.0f} engine calls){_spread(ratios)}",
            baseline=f"zero latency {_mean([_tps(a) for a, _ in pairs]):.2f} traj/s "
                     f"({_mean([a['rollout_s'] for a, _ in pairs]):.1f}s, "
                     f"{_mean([a['engine_steps'] for a, _ in pairs]):.0f} engine calls)",
            note=("baseline (lockstep waves); " if base else "moonshot 0.9; ") + note,
            possible=(0.0, 1.0 + NOISE)))
        busy = [_busy(b) for _, b in pairs]
        out.append(Result(
            name=f"rollout engine-bound {n}x{g} {arm} with tool latency: engine busy share of the wall",
            ratio=_mean(busy), target=None if base else 0.9, higher_is_better=True,
            measured=f"engine busy {_mean([b['engine_busy_s'] for _, b in pairs]):.1f}s of "
                     f"{_mean([b['rollout_s'] for _, b in pairs]):.1f}s{_spread(busy, '.2f')}"
                     + (f", {_mean([b['cancelled'] for _, b in pairs]):.0f} stragglers cancelled" if arm == "spare"
                        else ""),
            baseline=f"zero latency: {_mean([_busy(a) for a, _ in pairs]):.2f}",
            note=("baseline (lockstep waves); " if base else "moonshot 0.95; ")
            + ("busy time includes the cancelled stragglers' generation; " if arm == "spare" else "") + note,
            possible=(0.0, 1.0)))
    d = raw["policies"]["demo"]
    dn = d["groups"]
    dnote = (f"demo policy (hidden 64, 2 layers); {dn} groups x {g} tool-relay, {d['inflight_groups']} groups in "
             f"flight; {LAT_TEXT}; p95 over the N groups' episodes of their summed injected tool time (the "
             f"streaming run's: every arm makes the same calls); mean of "
             f"{sz['repeats']} repetition(s)")
    for arm in ARMS:
        pairs = _pairs(d, arm)
        p95 = [_p95(b["episode_tool_s"]) for _, b in _pairs(d, "streaming")]   # every arm makes the same calls
        bounds = [a["rollout_s"] + p for (a, _), p in zip(pairs, p95)]
        ratios = [b["rollout_s"] / x for (_, b), x in zip(pairs, bounds)]
        out.append(Result(
            name=f"rollout demo policy {dn}x{g} {arm}: wall with tool latency / (generation at zero latency + p95 "
                 "of one episode's tool time)",
            ratio=_mean(ratios), target=None if arm == "waves" else 1.0,
            measured=f"with latency {_mean([b['rollout_s'] for _, b in pairs]):.2f}s{_spread(ratios)}",
            baseline=f"{_mean([a['rollout_s'] for a, _ in pairs]):.2f}s + p95 "
                     f"{_mean(p95):.2f}s",
            note=("baseline (lockstep waves); " if arm == "waves" else "") + dnote, possible=(0.0, None)))
    return out


def _switch_results(raw: dict) -> list[Result]:
    out = []
    for s in raw["weight_switch"]:
        ip, rb = min(s["in_place_s"]), min(s["new_engine_s"])
        out.append(Result(name=f"weight switch {s['engine']}, {s['label']}: in place / new engine",
                          ratio=ip / rb, target=0.10, measured=f"in place {ip:.3f}s (load_weights)",
                          baseline=f"new engine {rb:.2f}s (make_engine; best of {len(s['new_engine_s'])})",
                          note=f"in place best of {len(s['in_place_s'])}, 1 thread"))
    return out


def derive(raw: dict) -> list[Result]:
    _check(raw)
    return _rollout_results(raw) + _switch_results(raw)


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


def _switch(engine_name: str, label: str, a: Path, b: Path, repeat: int, rebuilds: int) -> dict:
    """In-place switches a -> b -> a ... vs building a new engine on the other policy: the
    first build (start-up on ``a``) plus ``rebuilds`` close + make_engine (alternated with
    the in-place switches)."""
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
    return {"engine": engine_name, "label": label, "in_place_s": inplace, "new_engine_s": rebuild}


def _params(hf_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def run(quick: bool = False) -> dict:
    from pipeline.lake.delta import Lake
    from pipeline.rollout import hf as hfmod
    from pipeline.rollout.policy import init_policy

    sz = _sizes(quick)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as t:
        tmp = Path(t)
        demo = Path(init_policy(Lake(tmp / "policy"), warm_start_steps=sz["warm_start_steps"]).hf_dir)
        big = tmp / "big-a"
        hfmod.save_policy(hfmod.build_model(hfmod.Arch(**BIG), seed=0), big)
        raw: dict = {"sizes": sz, "latency": LATENCY, "noise": NOISE, "redundancy": REDUNDANCY,
                     "engine_bound_arch": BIG, "engine_bound_params": _params(big), "policies": {}}
        raw["policies"]["engine_bound"] = _policy_runs(big, tmp, sz["groups"], sz["inflight"], sz["repeats"], sz,
                                                       "engine_bound")
        raw["policies"]["demo"] = _policy_runs(demo, tmp, sz["demo_groups"], sz["demo_inflight"], sz["repeats"],
                                               sz, "demo")
        raw["load_1m_per_run"] = [r["load_1m_at_start"] for p in raw["policies"].values() for r in p["runs"]]
        _check(raw)        # a mismatch fails the run before anything is written
        engines = ["hf"] + (["vllm"] if not quick and os.environ.get("BENCH_ROLLOUT_VLLM", "0") == "1" else [])
        switches = []
        demo_b = _perturbed_copy(demo, tmp / "demo-b", 1)
        for e in engines:
            switches.append(_switch(e, "demo policy (hidden 64, 2 layers)", demo, demo_b, 3, 3 if e == "hf" else 0))
        big_b = _perturbed_copy(big, tmp / "big-b", 2)
        label = f"random Llama {raw['engine_bound_params'] / 1e6:.0f}M params (hidden 768, 12 layers)"
        for e in engines:
            switches.append(_switch(e, label, big, big_b, 2, 1 if e == "hf" else 0))
        raw["weight_switch"] = switches
    return raw
