"""What every report section reads: the report's options and the named queries
it runs (each once, failures remembered). Below both the sections
(``build.py``) and the alerts (``alerts.py``), which take a ``Queries``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    import pyarrow as pa

    from pipeline.lake.delta import Lake


@dataclass(frozen=True, kw_only=True)
class ReportOptions:
    """How ``pipeline report`` is drawn (``pipeline report --help`` sets each)."""

    run_id: str | None = None     # only this experiment (None: every run)
    bucket: str = "auto"          # time bucket of the over-time plots (auto: from the data's time span)
    pass_k: int = 4               # the k of the second pass@k curve (pass@1 is always drawn)
    receipts: int = 25            # rows in the latest-receipts table
    train_x: str = "step"         # x axis of the training plots: step, time (s since the run's first step), samples
    alert_bounds: tuple[tuple[str, float], ...] = ()   # (name, value) overrides of pipeline.report.alerts.ALERTS


class Queries:
    """Runs named queries once each; remembers results and failures."""

    def __init__(self, lake: Lake, opts: ReportOptions) -> None:
        self.lake = lake
        self.opts = opts
        self.cache: dict[tuple, pd.DataFrame | Exception] = {}

    def views(self) -> dict[str, pa.Table]:
        """The non-lake views the diagnostics read (the environments' component tags)."""
        from pipeline.rollout.envs.base import component_tags_table

        return {"component_tags": component_tags_table()}

    def get(self, name: str, **params) -> pd.DataFrame | Exception:
        from pipeline.query.duck import query
        from pipeline.resources import sql_path

        key = (name, tuple(sorted(params.items())))
        if key not in self.cache:
            try:
                sql = sql_path(name).read_text()
                self.cache[key] = query(self.lake, sql, params=params, views=self.views()).to_pandas()
            except Exception as exc:  # one broken query must not take the report down
                self.cache[key] = exc
        return self.cache[key]

    def sql(self, text: str, **params) -> pd.DataFrame | Exception:
        from pipeline.query.duck import query

        try:
            return query(self.lake, text, params=params or None, views=self.views()).to_pandas()
        except Exception as exc:
            return exc
