"""Expectation specs generated from schemas/<table>.yaml (pure; no GX import).

Each spec is ``(expectation_type, kwargs)``; the reason a failing row gets is
``quality:<expectation_type>(<column>)``. Only scalar columns are covered
(token lists are validated at ingest, row by row, in pipeline/lake/validate.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.schema import table_spec


@dataclass(frozen=True)
class ExpectationSpec:
    type: str            # e.g. expect_column_values_to_be_in_set
    column: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def reason(self) -> str:
        return f"quality:{self.type}({self.column})"


def suite_for(table: str, columns: list[str] | None = None) -> list[ExpectationSpec]:
    """Expectations for ``table``'s scalar columns (restricted to ``columns``)."""
    spec = table_spec(table)
    out: list[ExpectationSpec] = []
    for c in spec.columns:
        if columns is not None and c.name not in columns:
            continue
        if c.is_list or c.type_text.startswith("map<"):
            continue
        if c.required:
            out.append(ExpectationSpec("expect_column_values_to_not_be_null", c.name))
        if c.enum:
            out.append(ExpectationSpec("expect_column_values_to_be_in_set", c.name,
                                       (("value_set", tuple(c.enum)),)))
        if c.min is not None or c.max is not None:
            out.append(ExpectationSpec("expect_column_values_to_be_between", c.name,
                                       (("min_value", c.min), ("max_value", c.max))))
    return out
