"""CLI: `pipeline simulate`.

    pipeline simulate                                   # packaged defaults: the slow-task experiment, 24 h
    pipeline simulate --config slow_tasks --seed 1      # a packaged config by name, or a YAML path
    pipeline simulate --sweep max_policy_lag=0,1,2,4,8 --sweep mode=sync,async --out sim_out
    pipeline simulate --config lake_small --land --lake ./lake   # rows land in the lake; real admission decides

With --sweep the last swept key is the plot's x axis; the others make the lines.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import add_config_options, common

    p = common(sub.add_parser(
        "simulate", help="discrete-event rollout scheduling simulator (sync vs async, staleness, dropped tasks)",
        description="Simulate rollout workers, a trainer and the admission gate (no GPUs, no model):\n"
                    "completions, admitted trajectories, rejection rate of slow tasks vs the rest, trainer idle\n"
                    "fraction, queue age p50/p95, policy lag. A simulated day takes seconds.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter))
    add_config_options(p)
    p.add_argument("--seed", type=int, default=None, help="random seed (overrides the config's seed)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="run once per value (repeatable: the cartesian product); prints one row per run and "
                        "writes sweep.{md,csv,json,png} under --out")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write summary.json (single run) or the sweep files here (sweeps default: ./sim_out)")
    p.add_argument("--land", action="store_true",
                   help="land the simulated trajectories in the lake (--lake) in the ingest contract and let the "
                        "real admission job decide them (receipts, snapshots): slow, keep runs small")
    p.set_defaults(handler=_simulate)


def _epilog() -> str:
    from pipeline.config import describe
    from pipeline.sim.config import CONFIG_DIR, SimConfig

    examples = __doc__.split("\n\n", 1)[1].split("\n\nWith", 1)[0]
    keys = "\n".join(f"  {name} (default {default!r}): {help_}" for name, default, help_ in describe(SimConfig)
                     if name != "task_mix")
    packaged = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.yaml")))
    return (f"examples:\n{examples}\n\npackaged configs (--config NAME): {packaged}\n\n"
            f"config keys (--set/--sweep; task_mix.CLASS.KEY reaches into the task mix, e.g. "
            f"task_mix.slow.median_s):\n{keys}\n  task_mix: {_task_mix_help()}")


def _task_mix_help() -> str:
    from pipeline.sim.config import SimConfig
    import dataclasses

    return next(f.metadata.get("help", "") for f in dataclasses.fields(SimConfig) if f.name == "task_mix")


def _runner(args: argparse.Namespace):
    if not args.land:
        return None
    from pipeline.clikit import open_lake
    from pipeline.sim.lake_mode import simulate_in_lake

    lake = open_lake(args, create=True)
    return lambda cfg: simulate_in_lake(lake, cfg)


def _simulate(args: argparse.Namespace) -> dict[str, Any] | None:
    import json

    from pipeline.clikit import emit, out
    from pipeline.config import parse_set
    from pipeline.sim.config import load_sim_config
    from pipeline.sim.metrics import render_text
    from pipeline.sim.sweep import parse_sweep, render_table, run_sweep, write_outputs

    overrides = parse_set(args.set)
    if args.seed is not None:
        overrides["seed"] = args.seed
    sweeps = parse_sweep(args.sweep)
    run = _runner(args)
    if not sweeps:
        cfg = load_sim_config(args.config, overrides)
        if run is None:
            from pipeline.sim.engine import simulate

            summary = simulate(cfg)
        else:
            summary = run(cfg)
        if args.out:
            out_dir = Path(args.out)
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str, sort_keys=True))
            summary["out"] = str(out_dir / "summary.json")
        emit(summary, args, render_text)
        return None
    result = run_sweep(args.config, overrides, sweeps, run=run)
    paths = write_outputs(result, Path(args.out or "sim_out"))
    if args.json:
        emit({"keys": result["keys"], "wall_s": result["wall_s"], "files": paths,
              "rows": [{**r["point"], **{k: v for k, v in r.items() if k not in ("point", "config", "per_class")}}
                       for r in result["rows"]]}, args)
        return None
    out(render_table(result))
    out(f"{len(result['rows'])} runs in {result['wall_s']:.1f} s; table {paths['markdown']}, plot {paths['plot']}")
    return None
