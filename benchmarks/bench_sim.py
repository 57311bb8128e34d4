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

from pipeline.sim.config import load_sim_config
from pipeline.sim.engine import Simulation
from pipeline.sim.sweep import parse_sweep, run_sweep


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


def run(quick: bool) -> list[Result]:
    hours = 2.0 if quick else 24.0
    cfg = load_sim_config("slow_tasks", {"duration_h": hours})
    sims: list[Simulation] = []

    def one() -> None:
        sims.append(Simulation(cfg).run())

    t_sim = best_of(one, 1 if quick else 3)
    events = sims[-1].events
    t_noop = best_of(lambda: noop_loop(events, cfg.workers), 3)
    out = [Result(
        name=f"sim {hours:g} h async, {cfg.workers} workers: event loop / no-op heap loop",
        ratio=t_sim / t_noop, target=None,
        measured=f"{t_sim:.2f} s, {events:,} events ({events / t_sim:,.0f} events/s; "
                 f"{t_sim * 24 / hours:.2f} s per simulated day)",
        baseline=f"{t_noop:.3f} s ({events / t_noop:,.0f} events/s)",
        note="absolute: a simulated day must take seconds",
        raw={"hours": hours, "workers": cfg.workers, "events": events, "sim_s": t_sim, "noop_s": t_noop})]

    sweeps = parse_sweep(["mode=sync,async", "max_policy_lag=0,1,2,4,8"])
    t0 = time.perf_counter()
    res = run_sweep("slow_tasks", {"duration_h": hours}, sweeps)
    t_sweep = time.perf_counter() - t0
    total_events = sum(r["events"] for r in res["rows"])
    t_noop_sweep = best_of(lambda: noop_loop(total_events, cfg.workers), 1)
    out.append(Result(
        name=f"sim lag sweep ({len(res['rows'])} runs x {hours:g} h): sweep / no-op heap loop",
        ratio=t_sweep / t_noop_sweep, target=None,
        measured=f"{t_sweep:.2f} s for {total_events:,} events ({t_sweep / len(res['rows']):.2f} s per run)",
        baseline=f"{t_noop_sweep:.3f} s",
        raw={"runs": len(res["rows"]), "events": total_events, "sweep_s": t_sweep, "noop_s": t_noop_sweep}))
    return out
