"""The one adapter over matplotlib: figures in, PNG bytes out.

Headless (Agg backend); nothing here touches the lake. Every function takes
plain Python sequences and returns the PNG as bytes, which the HTML embeds
inline (no network needed to open the report).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

SIZE = (6.4, 3.3)
DPI = 100


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    return buf.getvalue()


def _axes(title: str, xlabel: str, ylabel: str):
    fig, ax = plt.subplots(figsize=SIZE)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def lines(series: Mapping[str, tuple[Sequence, Sequence]], *, title: str, xlabel: str, ylabel: str,
          integer_x: bool = False, ylim: tuple[float, float] | None = None, dashed: Sequence[str] = ()) -> bytes:
    """One line per ``label -> (x, y)``; None/NaN y values leave gaps; labels ending
    in one of ``dashed`` are drawn dashed (reference curves)."""
    fig, ax = _axes(title, xlabel, ylabel)
    for label, (x, y) in series.items():
        ys = [float("nan") if v is None else float(v) for v in y]
        ax.plot(list(x), ys, marker="o", markersize=3, linewidth=1.5, label=label,
                linestyle="--" if any(label.endswith(d) for d in dashed) else "-")
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        fig.autofmt_xdate()
    if ylim:
        ax.set_ylim(*ylim)
    if len(series) > 1:
        ax.legend(fontsize=8, loc="best")
    return _png(fig)


def bars(categories: Sequence[str], series: Mapping[str, Sequence], *, title: str, ylabel: str,
         xlabel: str = "", stacked: bool = False, horizontal: bool = False) -> bytes:
    """Grouped (or stacked) bars: one bar per series in each category."""
    fig, ax = _axes(title, xlabel if not horizontal else ylabel, ylabel if not horizontal else xlabel)
    cats = [str(c) for c in categories]
    pos = list(range(len(cats)))
    k = max(len(series), 1)
    width = 0.8 if stacked else 0.8 / k
    bottom = [0.0] * len(cats)
    for j, (label, vals) in enumerate(series.items()):
        v = [0.0 if x is None else float(x) for x in vals]
        offs = pos if stacked else [p - 0.4 + width * (j + 0.5) for p in pos]
        if horizontal:
            ax.barh(offs, v, height=width, left=bottom if stacked else None, label=label)
        else:
            ax.bar(offs, v, width=width, bottom=bottom if stacked else None, label=label)
        if stacked:
            bottom = [b + x for b, x in zip(bottom, v)]
    if horizontal:
        ax.set_yticks(pos, cats, fontsize=8)
        ax.invert_yaxis()
    else:
        ax.set_xticks(pos, cats, fontsize=8, rotation=30 if max((len(c) for c in cats), default=0) > 6 else 0,
                      ha="right" if max((len(c) for c in cats), default=0) > 6 else "center")
    if len(series) > 1:
        ax.legend(fontsize=8, loc="best")
    return _png(fig)
