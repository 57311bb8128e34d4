"""``--sweep key=v1,v2,...``: one run per value (the cartesian product when
several keys are swept), same seed for every run (common random numbers, so
differences come from the swept key, not from the draw), one table row each.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable

from pipeline.errors import ConfigError
from pipeline.sim.config import SimConfig, load_sim_config
from pipeline.sim.metrics import SUMMARY_FIELDS, fmt


def parse_sweep(items: list[str] | None) -> list[tuple[str, list[Any]]]:
    """``["max_policy_lag=0,1,2"]`` -> ``[("max_policy_lag", [0, 1, 2])]`` (values parsed as YAML scalars)."""
    from pipeline.config import yaml_load

    out: list[tuple[str, list[Any]]] = []
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--sweep {item!r}: expected key=v1,v2,...", hint="e.g. --sweep max_policy_lag=0,1,2,4,8")
        key, raw = item.split("=", 1)
        values = [yaml_load(v) for v in raw.split(",") if v.strip() != ""]
        if not values:
            raise ConfigError(f"--sweep {item!r}: no values")
        if any(k == key.strip() for k, _ in out):
            raise ConfigError(f"--sweep {key.strip()} given twice")
        out.append((key.strip(), values))
    return out


def grid(sweeps: list[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    keys = [k for k, _ in sweeps]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in sweeps))]


def run_sweep(config_file: str | Path | None, overrides: dict[str, Any], sweeps: list[tuple[str, list[Any]]],
              *, run: Callable[[SimConfig], dict[str, Any]] | None = None,
              progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every combination of the swept values; returns {keys, rows, wall_s}.
    Each row = the swept values + the run's summary."""
    from pipeline.sim.engine import simulate

    run = run or simulate
    # resolve every config before running any: a bad value fails the sweep up front
    points = [(point, load_sim_config(config_file, {**overrides, **point})) for point in grid(sweeps)]
    rows = []
    t0 = time.perf_counter()
    for point, cfg in points:
        summary = run(cfg)
        row = {"point": point, **summary}
        rows.append(row)
        if progress:
            progress(row)
    return {"keys": [k for k, _ in sweeps], "rows": rows, "wall_s": time.perf_counter() - t0}


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    keys = result["keys"]
    header = list(keys) + [label for _, label, _ in SUMMARY_FIELDS]
    body = []
    for row in result["rows"]:
        body.append([str(row["point"][k]) for k in keys] + [fmt(row.get(f), spec) for f, _, spec in SUMMARY_FIELDS])
    return header, body


def render_table(result: dict[str, Any]) -> str:
    header, body = table_rows(result)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def render_markdown(result: dict[str, Any]) -> str:
    header, body = table_rows(result)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out: Path, *, plot: bool = True) -> dict[str, str]:
    """sweep.json (every summary), sweep.csv, sweep.md and sweep.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    (out / "sweep.json").write_text(json.dumps(result, indent=1, default=str, sort_keys=True))
    paths["json"] = str(out / "sweep.json")
    header, body = table_rows(result)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(body)
    (out / "sweep.csv").write_text(buf.getvalue())
    paths["csv"] = str(out / "sweep.csv")
    (out / "sweep.md").write_text(render_markdown(result) + "\n")
    paths["markdown"] = str(out / "sweep.md")
    if plot:
        from pipeline.sim.plot import plot_sweep

        paths["plot"] = str(plot_sweep(result, out / "sweep.png"))
    return paths
