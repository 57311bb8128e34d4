"""Report plots a person can read: titles clear of plotly's toolbar, a constant series drawn at its
value (pipeline.report.plots, the figure JSON itself)."""

from __future__ import annotations

import json

from pipeline.report import plots


def _fig(**series):
    return json.loads(plots.lines({k: v for k, v in series.items()}, title="Learning rate per step", xlabel="step",
                                  ylabel="lr"))


def test_titles_sit_below_the_toolbar_row_and_above_the_plot_area():
    for fig in (_fig(lr=([1, 2], [1e-4, 2e-4])),
                json.loads(plots.bars(["a", "b"], {"n": [1, 2]}, title="A long title " * 6, ylabel="n"))):
        lay = fig["layout"]
        title, height = lay["title"], lay["height"]
        assert title["yref"] == "container" and title["yanchor"] == "top" and title["xanchor"] == "left"
        top_px = (1 - title["y"]) * height
        assert top_px >= plots.TOOLBAR_PX, "the title starts below the toolbar's row"
        assert top_px + title["font"]["size"] + 4 <= lay["margin"]["t"], "and ends above the plot area"


def test_a_constant_learning_rate_is_drawn_at_its_value():
    lay = _fig(lr=([1, 2, 3, 4], [3e-4] * 4))["layout"]
    lo, hi = lay["yaxis"]["range"]
    assert lo < 3e-4 < hi and hi - lo < 1e-3, "not plotly's v +- 1, where 3e-4 reads as 0"
    assert lay["yaxis"]["tickformat"] == ".3~g"
    varying = _fig(lr=([1, 2, 3], [1e-4, 2e-4, 3e-4]))["layout"]
    assert "range" not in varying["yaxis"], "a series that changes keeps plotly's autorange"
    assert "range" not in _fig(x=([1, 2], [0.0, 0.0]))["layout"]["yaxis"]
    # None (a gap) does not make a constant series look varying
    assert _fig(lr=([1, 2, 3], [3e-4, None, 3e-4]))["layout"]["yaxis"]["range"][0] > 0
