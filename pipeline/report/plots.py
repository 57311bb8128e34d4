"""The one adapter over plotly: series in, an interactive figure's JSON out.

Nothing here touches the lake. Every function takes plain Python sequences
and returns the figure as a plotly JSON document (``{"data": [...],
"layout": {...}}``), which the HTML page draws with plotly.js inlined once
(``library_js``): the report opens offline, with hover values, zoom and a
legend that shows and hides series.

Many runs: a series labelled ``"<run>: <name>"`` belongs to run ``<run>``.
Every series of a run shares the run's colour and legend group (clicking a
run in the legend shows or hides all its series), the metrics are told apart
by line style, and beyond ``VISIBLE_RUNS`` runs only the newest are drawn at
first (the others are listed in the legend, one click away): the legend is
the run selector. ``boundaries`` marks where a run or checkpoint begins
(dotted vertical lines, labelled).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

HEIGHT, WIDTH = 350, 640
# plotly's toolbar (modebar) is drawn over the top right of the figure, about 26 px high: the title
# sits below that row, left-aligned, and the plot area starts below the title
TOOLBAR_PX, TITLE_TOP_PX, PLOT_TOP_PX = 26, 30, 62
VISIBLE_RUNS = 6
# 24 distinguishable colours (plotly's Dark24): colours repeat only past 24 runs
PALETTE = ("#2E91E5", "#E15F99", "#1CA71C", "#FB0D0D", "#DA16FF", "#222A2A", "#B68100", "#750D86", "#EB663B",
           "#511CFB", "#00A08B", "#FB00D1", "#FC0080", "#B2828D", "#6C7C32", "#778AAE", "#862A16", "#A777F1",
           "#620042", "#1616A7", "#DA60CA", "#6C4516", "#0D2A63", "#AF0038")
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")


@functools.cache
def library_js() -> str:
    """plotly.js as shipped with the plotly package (inlined once per page)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _layout(title: str, xlabel: str, ylabel: str, legend: bool) -> dict[str, Any]:
    return dict(title=dict(text=title, font=dict(size=14), x=0.01, xref="container", xanchor="left",
                           y=1 - TITLE_TOP_PX / HEIGHT, yref="container", yanchor="top"),
                height=HEIGHT, width=WIDTH,
                margin=dict(l=60, r=20, t=PLOT_TOP_PX, b=50), template="plotly_white", showlegend=legend,
                legend=dict(font=dict(size=10), groupclick="togglegroup"),
                xaxis=dict(title=dict(text=xlabel)), yaxis=dict(title=dict(text=ylabel)), hovermode="closest")


def _split(label: str) -> tuple[str | None, str]:
    run, sep, name = label.partition(": ")
    return (run, name) if sep else (None, label)


def _num(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return None if f != f else f         # NaN leaves a gap, like None


def _constant_range(ys: list[float | None]) -> dict[str, Any]:
    """Axis settings for a series that never changes (a constant learning rate): plotly's own
    range for one value v is v +- 1, where 3e-4 sits on the tick labelled 0; give it v +- 50%
    with ticks in v's own magnitude instead."""
    vals = {v for v in ys if v is not None}
    if len(vals) != 1:
        return {}
    (v,) = vals
    if v == 0:
        return {}
    half = abs(v) / 2
    return {"range": [v - half, v + half], "tickformat": ".3~g"}


def lines(series: Mapping[str, tuple[Sequence, Sequence]], *, title: str, xlabel: str, ylabel: str,
          integer_x: bool = False, ylim: tuple[float, float] | None = None, dashed: Sequence[str] = (),
          boundaries: Sequence[tuple[Any, str]] = ()) -> str:
    """One line per ``label -> (x, y)``; None/NaN y values leave gaps; labels ending
    in one of ``dashed`` are drawn dashed (reference curves)."""
    runs = list(dict.fromkeys(r for r in (_split(k)[0] for k in series) if r is not None))
    shown = set(runs[-VISIBLE_RUNS:])
    names = list(dict.fromkeys(_split(k)[1] for k in series))
    fig = go.Figure()
    titled: set[str] = set()
    for i, (label, (x, y)) in enumerate(series.items()):
        run, name = _split(label)
        first = run is not None and run not in titled
        if run is not None:
            titled.add(run)
        colour = PALETTE[(runs.index(run) if run is not None else i) % len(PALETTE)]
        dash = "dash" if any(label.endswith(d) for d in dashed) else (
            DASHES[names.index(name) % len(DASHES)] if run is not None else "solid")
        fig.add_trace(go.Scatter(
            x=list(x), y=[_num(v) for v in y], name=label, mode="lines+markers", marker=dict(size=4),
            line=dict(color=colour, dash=dash, width=1.6), connectgaps=False,
            legendgroup=run or label, legendgrouptitle=dict(text=run) if first else None,
            visible=True if run is None or run in shown else "legendonly"))
    layout = _layout(title, xlabel, ylabel, len(series) > 1)
    if integer_x:
        layout["xaxis"]["tickformat"] = "d"
    if ylim:
        layout["yaxis"]["range"] = list(ylim)
    else:
        layout["yaxis"].update(_constant_range([_num(v) for _, y in series.values() for v in y]))
    layout["shapes"] = [dict(type="line", xref="x", yref="paper", x0=bx, x1=bx, y0=0, y1=1,
                             line=dict(color="#999", width=1, dash="dot")) for bx, _ in boundaries]
    layout["annotations"] = [dict(x=bx, y=1, xref="x", yref="paper", text=text, showarrow=False, xanchor="left",
                                  yanchor="top", font=dict(size=9, color="#666")) for bx, text in boundaries]
    fig.update_layout(**layout)
    return fig.to_json()


def bars(categories: Sequence[str], series: Mapping[str, Sequence], *, title: str, ylabel: str,
         xlabel: str = "", stacked: bool = False, horizontal: bool = False) -> str:
    """Grouped (or stacked) bars: one bar per series in each category."""
    cats = [str(c) for c in categories]
    fig = go.Figure()
    for i, (label, vals) in enumerate(series.items()):
        v = [0.0 if x is None else float(x) for x in vals]
        colour = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Bar(x=v, y=cats, orientation="h", name=label, marker_color=colour) if horizontal
                      else go.Bar(x=cats, y=v, name=label, marker_color=colour))
    layout = _layout(title, ylabel if horizontal else xlabel, xlabel if horizontal else ylabel, len(series) > 1)
    layout["barmode"] = "stack" if stacked else "group"
    axis = layout["yaxis" if horizontal else "xaxis"]
    axis["type"] = "category"
    if horizontal:
        axis["autorange"] = "reversed"
    else:
        # long or many labels: slanted, and plotly drops the ones that would overlap
        axis["tickangle"] = -30 if max((len(c) for c in cats), default=0) > 6 or len(cats) > 12 else 0
        axis["nticks"] = 12
    fig.update_layout(**layout)
    return fig.to_json()
