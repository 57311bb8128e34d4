"""The discrete-event rollout scheduling simulator (`pipeline simulate`).

What synchronous vs asynchronous collection does to throughput, staleness and
*which* tasks get dropped, before anyone buys GPUs: rollout workers, a trainer
that publishes a policy version per step, weight sync, infrastructure failures
and the admission gate (docs/admission-rules.md), on a heap of timed events.
No GPUs, no model; pure Python + numpy. ``--land`` lands the simulated
trajectories in a lake and lets the real admission job decide them.

    config.py   SimConfig (frozen dataclass) + task classes
    engine.py   the event loop: workers, trainer, weight sync, failures
    gate.py     the in-simulator admission gate (docs/admission-rules.md, pure)
    metrics.py  per-run summary (completions, admitted, rejection by class, ...)
    sweep.py    --sweep key=v1,v2 grids, the printed table
    plot.py     the sweep plot (the only module importing matplotlib)
    lake_mode.py  trajectory rows in the ingest contract + the real admission gate
    (the `pipeline simulate` verb is pipeline/commands/simulate.py)
"""
