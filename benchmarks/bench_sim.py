"""Simulator speed: events per second, a simulated day, and the lag sweep.

    .venv/bin/python benchmarks/run.py --only sim [--quick]

Baseline: a no-op event loop over the same number of events (heapq push + pop
of timed tuples, no handlers), measured in the same run: the ratio is what the
model costs per event on top of the bare heap. Full size: the slow-task config
(256 workers, 24 h simulated) and the README sweep (mode=sync,async x
max_policy_lag=0,1,2,4,8 = 10 runs of 24 h).
"""

from __future__ import annotations

import heapq
import random
import time

from run import Result, best_of


def noop_loop(n: int, pending: int = 300) -> None:
    """Pop ``n`` timed events, pushing one new event per pop (``pending`` in flight)."""
    rnd = random.Random(0).random
    heap = [(rnd(), i, 0, 0, 0) for i in range(pending)]
    heapq.heapify(heap)
    seq = pending
    for _ in range(n):
        t, _, kind, a, b = heapq.heappop(heap)
        seq += 1
        heapq.heappush(heap, (t + rnd(), seq, kind, a, b))


def run(quick: bool) -> dict:
    """The raw measurements: one simulated run (best of 3) and the sweep, each with its no-op loop."""
    from pipeline.sim.config import load_sim_config
    from pipeline.sim.engine import Simulation
    from pipeline.sim.sweep import parse_sweep, run_sweep

    hours = 2.0 if quick else 24.0
    cfg = load_sim_config("slow_tasks", {"duration_h": hours})
    sims: list[Simulation] = []

    def one() -> None:
        sims.append(Simulation(cfg).run())

    t_sim = best_of(one, 1 if quick else 3)
    events = sims[-1].events
    t_noop = best_of(lambda: noop_loop(events, cfg.workers), 3)

    sweeps = parse_sweep(["mode=sync,async", "max_policy_lag=0,1,2,4,8"])
    t0 = time.perf_counter()
    res = run_sweep("slow_tasks", {"duration_h": hours}, sweeps)
    t_sweep = time.perf_counter() - t0
    total_events = sum(r["events"] for r in res["rows"])
    t_noop_sweep = best_of(lambda: noop_loop(total_events, cfg.workers), 1)
    return {"day": {"hours": hours, "workers": cfg.workers, "events": events, "sim_s": t_sim, "noop_s": t_noop},
            "sweep": {"hours": hours, "runs": len(res["rows"]), "events": total_events, "sweep_s": t_sweep,
                      "noop_s": t_noop_sweep}}


def derive(raw: dict) -> list[Result]:
    """The figures of ``run``'s raw measurements (run.py and the table test both call this)."""
    d, w = raw["day"], raw["sweep"]
    return [
        Result(name=f"sim {d['hours']:g} h async, {d['workers']} workers: event loop / no-op heap loop",
               ratio=d["sim_s"] / d["noop_s"], target=None,
               measured=f"{d['sim_s']:.2f} s, {d['events']:,} events ({d['events'] / d['sim_s']:,.0f} events/s; "
                        f"{d['sim_s'] * 24 / d['hours']:.2f} s per simulated day)",
               baseline=f"{d['noop_s']:.3f} s ({d['events'] / d['noop_s']:,.0f} events/s)",
               note="absolute: a simulated day must take seconds",
               possible=(0.0, None)),
        Result(name=f"sim lag sweep ({w['runs']} runs x {w['hours']:g} h): sweep / no-op heap loop",
               ratio=w["sweep_s"] / w["noop_s"], target=None,
               measured=f"{w['sweep_s']:.2f} s for {w['events']:,} events ({w['sweep_s'] / w['runs']:.2f} s per run)",
               baseline=f"{w['noop_s']:.3f} s", possible=(0.0, None)),
    ]
