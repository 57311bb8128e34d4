"""Render report sections into one self-contained HTML page.

Plots are plotly figures (JSON, one ``<script type="application/json">`` each)
drawn by plotly.js, inlined once in the page (``<script id="plotly-js">``);
styles are inline. The page's own script draws every figure at load, marks
each ``data-rendered="yes"`` (or replaces it with a visible error note, ``no``)
and the body ``data-plots-checked="yes"`` when all are done, so a broken plot
is visible, not silent. The file opens offline in any browser.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal


@dataclass(frozen=True)
class Plot:
    title: str
    figure: str      # a plotly figure as JSON (pipeline.report.plots)


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[list[Any]]
    caption: str = ""


@dataclass(frozen=True)
class Note:
    text: str
    kind: Literal["empty", "error", "info", "alert"] = "info"
    check: str = ""   # for an alert: the check that raised it (a key of pipeline.report.alerts.ALERTS)


@dataclass
class Section:
    key: str
    title: str
    intro: str
    blocks: list[Plot | Table | Note] = field(default_factory=list)


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#666;font-size:13px}.intro{color:#444;font-size:13px;max-width:980px}
.grid{display:flex;flex-wrap:wrap;gap:12px}.fig{background:#fff;border:1px solid #e2e2e2;border-radius:4px;padding:6px}
.fig .plot{width:640px;height:350px}
table{border-collapse:collapse;font-size:12px;margin:8px 0;background:#fff}
th,td{border:1px solid #e2e2e2;padding:3px 6px;text-align:left;vertical-align:top}th{background:#f0f0f0}
td.num{text-align:right;font-variant-numeric:tabular-nums}caption{text-align:left;font-size:12px;color:#555;padding:4px 0}
.note{padding:8px 10px;border-radius:4px;font-size:13px;margin:6px 0;max-width:980px}
.empty{background:#f3f3f3;color:#555}.error{background:#fde8e8;color:#8a1c1c}.info{background:#eef5fb;color:#234}.alert{background:#fff1db;color:#7a3e00;font-weight:600}
nav a{margin-right:12px;font-size:13px}.tw{overflow-x:auto;max-width:100%}
"""

SCRIPT = """
window.addEventListener('load', function () {
  var figs = Array.prototype.slice.call(document.querySelectorAll('div.plot'));
  var fail = function (div, why) {
    div.setAttribute('data-rendered', 'no');
    var p = document.createElement('p'); p.className = 'note error';
    p.textContent = 'plot failed to draw: ' + div.getAttribute('data-title') + ' (' + why + ')';
    div.replaceWith(p);
  };
  var done = figs.map(function (div) {
    try {
      var fig = JSON.parse(div.nextElementSibling.textContent);
      return Plotly.newPlot(div, fig.data, fig.layout, {displaylogo: false, responsive: false})
        .then(function () { div.setAttribute('data-rendered', 'yes'); },
              function (e) { fail(div, e); });
    } catch (e) { fail(div, e); return Promise.resolve(); }
  });
  Promise.all(done).then(function () { document.body.setAttribute('data-plots-checked', 'yes'); });
});
"""


def _cell(v: Any) -> tuple[str, bool]:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "", False
    if isinstance(v, bool):
        return str(v).lower(), False
    if isinstance(v, float):
        return (f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"), True
    if isinstance(v, int):
        return f"{v:,}", True
    if isinstance(v, datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S"), False
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v), False
    s = str(v)
    return (s if len(s) <= 80 else s[:79] + "…"), False


def _table(t: Table) -> str:
    out = ['<div class="tw"><table>']
    if t.caption:
        out.append(f"<caption>{html.escape(t.caption)}</caption>")
    out.append("<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in t.columns) + "</tr>")
    for row in t.rows:
        cells = []
        for v in row:
            text, num = _cell(v)
            cells.append(f'<td class="num">{html.escape(text)}</td>' if num else f"<td>{html.escape(text)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table></div>")
    return "\n".join(out)


def _block(b: Plot | Table | Note) -> str:
    if isinstance(b, Plot):
        title = html.escape(b.title, quote=True)
        spec = b.figure.replace("</", "<\\/")          # JSON inside <script>: never closes the element
        return (f'<div class="fig"><div class="plot" data-title="{title}"></div>'
                f'<script type="application/json">{spec}</script></div>')
    if isinstance(b, Table):
        return _table(b)
    return f'<p class="note {b.kind}">{html.escape(b.text)}</p>'


def render(title: str, meta: list[str], sections: list[Section]) -> str:
    """The whole page as one string."""
    from pipeline.report.plots import library_js   # plotly: only when a page is rendered

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{CSS}</style>",
        f'<script id="plotly-js">{library_js()}</script>' if any(
            isinstance(b, Plot) for s in sections for b in s.blocks) else "",
        f"<script>{SCRIPT}</script>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "".join(f'<div class="meta">{html.escape(m)}</div>' for m in meta),
        "<nav>" + "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in sections) + "</nav>",
    ]
    for s in sections:
        parts.append(f'<section id="{s.key}"><h2>{html.escape(s.title)}</h2>')
        parts.append(f'<p class="intro">{html.escape(s.intro)}</p>')
        plots = [b for b in s.blocks if isinstance(b, Plot)]
        if plots:
            parts.append('<div class="grid">' + "".join(_block(b) for b in plots) + "</div>")
        parts.extend(_block(b) for b in s.blocks if not isinstance(b, Plot))
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)
