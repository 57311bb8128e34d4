"""The sweep plot: the only module of the simulator that imports matplotlib (Agg).

x axis = the last swept key (values at even spacing, labelled); one line per
combination of the other swept keys (e.g. mode=sync / mode=async).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_sweep(result: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = result["keys"]
    xkey, others = keys[-1], keys[:-1]
    series: dict[str, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        label = ", ".join(f"{k}={row['point'][k]}" for k in others) or "run"
        series.setdefault(label, []).append(row)
    xs_all = []
    for row in result["rows"]:
        if row["point"][xkey] not in xs_all:
            xs_all.append(row["point"][xkey])
    pos = {v: i for i, v in enumerate(xs_all)}

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    panels = [
        (axes[0, 0], "trajectories per simulated hour", [("completions", "completed", "-"), ("admitted", "admitted", "--")]),
        (axes[0, 1], "rejection rate", [("rejection_rate_slow", "slow class", "-"), ("rejection_rate_rest", "rest", "--")]),
        (axes[1, 0], "trainer idle fraction", [("trainer_idle_fraction", "idle", "-")]),
        (axes[1, 1], "queue age p95 (s)", [("queue_age_p95_s", "queue age p95", "-")]),
    ]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, title, fields in panels:
        for si, (label, rows) in enumerate(series.items()):
            rows = sorted(rows, key=lambda r: pos[r["point"][xkey]])
            x = [pos[r["point"][xkey]] for r in rows]
            for field, flabel, style in fields:
                y = []
                for r in rows:
                    v = r.get(field)
                    if v is not None and field in ("completions", "admitted"):
                        v = v / r["sim_hours"]
                    y.append(float("nan") if v is None else v)
                name = f"{flabel} ({label})" if len(fields) > 1 or len(series) > 1 else flabel
                if len(fields) == 1 and len(series) > 1:
                    name = label
                ax.plot(x, y, style, marker="o", color=colors[si % len(colors)], label=name)
        ax.set_title(title)
        ax.set_xticks(range(len(xs_all)), [str(v) for v in xs_all])
        ax.set_xlabel(xkey)
        if "rate" in title or "fraction" in title:
            ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cfg = result["rows"][0]["config"]
    fig.suptitle(f"rollout scheduling sweep over {xkey}: {cfg['workers']} workers, G={cfg['group_size']}, "
                 f"{cfg['batch_groups']} groups/step, {cfg['duration_h']:g} h simulated, seed {cfg['seed']}",
                 fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
