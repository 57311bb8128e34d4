"""Table specs loaded from schemas/*.yaml: the single source of truth.

Everything about a table's shape (Arrow schema, ingest validation, the
great-expectations suites, the docs site's tables page) is derived from the
specs here. Run ``python -m pipeline.schema --markdown`` to print the docs.
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.resources import resource_dir

TABLES = (
    "trajectories",
    "events",
    "quarantine",
    "receipts",
    "snapshots",
    "snapshot_members",
    "checkpoints",
)
# Tables outside the core data flow (the trainer's per-step metrics, held-out
# evaluations): same lake, same write path, not in the docs site's tables page.
EXTRA_TABLES = ("metrics", "evaluations")
ALL_TABLES = TABLES + EXTRA_TABLES

ROW_KEY = "row_key"  # int64 digest of a table's key columns: the compact dedupe index

_SCALARS: dict[str, pa.DataType] = {
    "string": pa.string(),
    "bool": pa.bool_(),
    "int8": pa.int8(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "date32": pa.date32(),
    "timestamp[us, UTC]": pa.timestamp("us", tz="UTC"),
}


def parse_type(text: str) -> pa.DataType:
    """``"list<int32>"`` -> ``pa.list_(pa.int32())``; ``"map<string,float64>"`` -> map."""
    text = text.strip()
    if text in _SCALARS:
        return _SCALARS[text]
    m = re.fullmatch(r"list<(.+)>", text)
    if m:
        return pa.list_(parse_type(m.group(1)))
    m = re.fullmatch(r"map<\s*([^,]+)\s*,\s*(.+)>", text)
    if m:
        return pa.map_(parse_type(m.group(1)), parse_type(m.group(2)))
    raise ValueError(f"unknown schema type {text!r}")


@dataclass(frozen=True, kw_only=True)
class ColumnSpec:
    name: str
    type_text: str
    required: bool
    description: str
    enum: tuple[str, ...] | None = None
    enum_values: tuple[int, ...] | None = None  # allowed list element values (e.g. loss_mask 0/1)
    min: float | None = None
    max: float | None = None
    finite: bool = False
    non_empty: bool = False
    unique: bool = False
    ingest: str = "required"  # "required" (per `required`), "optional" (computed if absent), "derived"
    hashed: bool = True  # false: an ingest column outside content_hash (recorded metadata; hash version unchanged)
    # ``hashed: when_present``: outside the header, hashed in the trailer when not null (schemas/README.md)
    hashed_when_present: bool = False

    @property
    def arrow_type(self) -> pa.DataType:
        return parse_type(self.type_text)

    @property
    def is_list(self) -> bool:
        return pa.types.is_list(self.arrow_type)

    def arrow_field(self) -> pa.Field:
        return pa.field(self.name, self.arrow_type, nullable=not self.required)


@dataclass(frozen=True)
class Invariant:
    kind: str
    description: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    name: str
    description: str
    columns: tuple[ColumnSpec, ...]
    key: tuple[str, ...] = ()
    partition_by: tuple[str, ...] = ()
    invariants: tuple[Invariant, ...] = ()
    conflict_column: str | None = None  # same key + different value here = a conflict, not a duplicate

    @property
    def enforces_key(self) -> bool:
        """Tables with a derived ``row_key`` column never hold two rows with one key:
        every append dedupes against the table (docs/write-protocol.md)."""
        return any(c.name == ROW_KEY for c in self.columns)

    def column(self, name: str) -> ColumnSpec:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"{self.name} has no column {name!r}")

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def ingest_columns(self) -> list[ColumnSpec]:
        """Columns a writer may provide (everything but derived columns)."""
        return [c for c in self.columns if c.ingest != "derived"]

    @property
    def derived_columns(self) -> list[ColumnSpec]:
        return [c for c in self.columns if c.ingest == "derived"]

    def arrow_schema(self) -> pa.Schema:
        return pa.schema([c.arrow_field() for c in self.columns])

    def ingest_schema(self) -> pa.Schema:
        """What a writer provides: derived columns left out, optional ones
        (computed when absent, e.g. content_hash) nullable."""
        return pa.schema([c.arrow_field().with_nullable(not c.required or c.ingest == "optional")
                          for c in self.ingest_columns])


def _column(raw: dict[str, Any], table: str) -> ColumnSpec:
    known = {"name", "type", "required", "description", "enum", "enum_values", "min", "max",
             "finite", "non_empty", "unique", "ingest", "hashed"}
    extra = set(raw) - known
    if extra:
        raise ValueError(f"schemas/{table}.yaml column {raw.get('name')}: unknown keys {sorted(extra)}")
    if raw.get("hashed", True) not in (True, False, "when_present") or (
            raw.get("hashed") == "when_present" and (raw.get("type") != "string" or raw.get("required"))):
        raise ValueError(f"schemas/{table}.yaml column {raw.get('name')}: hashed is true, false or when_present "
                         "(an optional string column only)")
    parse_type(raw["type"])  # fail early on a typo
    return ColumnSpec(
        name=raw["name"],
        type_text=raw["type"],
        required=bool(raw.get("required", False)),
        description=raw.get("description", ""),
        enum=tuple(raw["enum"]) if raw.get("enum") else None,
        enum_values=tuple(raw["enum_values"]) if raw.get("enum_values") else None,
        min=raw.get("min"),
        max=raw.get("max"),
        finite=bool(raw.get("finite", False)),
        non_empty=bool(raw.get("non_empty", False)),
        unique=bool(raw.get("unique", False)),
        ingest=raw.get("ingest", "required"),
        hashed=raw.get("hashed", True) is True,
        hashed_when_present=raw.get("hashed") == "when_present",
    )


@functools.cache
def table_spec(name: str) -> TableSpec:
    """The spec of table ``name`` from ``schemas/<name>.yaml``."""
    import yaml

    path = resource_dir("schemas") / f"{name}.yaml"
    if not path.is_file():
        raise KeyError(f"no schema for table {name!r} (expected {path})")
    raw = yaml.safe_load(path.read_text())
    cols = tuple(_column(c, name) for c in raw["columns"])
    names = [c.name for c in cols]
    if len(set(names)) != len(names):
        raise ValueError(f"schemas/{name}.yaml: duplicate column names")
    invs = []
    for inv in raw.get("invariants") or []:
        inv = dict(inv)
        kind = inv.pop("kind")
        desc = inv.pop("description", "")
        invs.append(Invariant(kind=kind, description=desc, params=inv))
    return TableSpec(
        name=raw["table"],
        description=raw.get("description", ""),
        columns=cols,
        key=tuple(raw.get("key") or ()),
        partition_by=tuple(raw.get("partition_by") or ()),
        invariants=tuple(invs),
        conflict_column=raw.get("conflict_column"),
    )


def arrow_schema(name: str) -> pa.Schema:
    return table_spec(name).arrow_schema()


def _cell(text: str) -> str:
    """Text for one markdown table cell: one line, ``|`` escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown(names: tuple[str, ...] = TABLES) -> str:
    """The tables reference (docs/reference/tables.md), generated from the specs."""
    out = []
    for name in names:
        spec = table_spec(name)
        out.append(f"### {spec.name}\n\n{spec.description}")
        if spec.key:
            out.append(f"Key: `{', '.join(spec.key)}`." + (
                f" Partitioned by `{', '.join(spec.partition_by)}`." if spec.partition_by else ""))
        rows = ["| column | type | required | rules | description |", "|---|---|---|---|---|"]
        for c in spec.columns:
            rules = []
            if c.enum:
                rules.append("one of " + ", ".join(c.enum))
            if c.enum_values:
                rules.append("elements in {" + ", ".join(map(str, c.enum_values)) + "}")
            each = "elements " if c.is_list else ""
            if c.min is not None:
                rules.append(f"{each}>= {c.min}")
            if c.max is not None:
                rules.append(f"{each}<= {c.max}")
            if c.finite:
                rules.append("finite")
            if c.non_empty:
                rules.append("non-empty")
            if c.unique:
                rules.append("unique")
            if c.ingest == "optional":
                rules.append("optional on ingest")
            if c.ingest == "derived":
                rules.append("derived by the lake")
            if c.hashed_when_present:
                rules.append("in content_hash when not null")
            elif not c.hashed and c.ingest != "derived":
                rules.append("not in content_hash")
            req = "yes" if c.required else "no"
            rows.append(f"| {c.name} | `{c.type_text}` | {req} | {_cell('; '.join(rules))} | {_cell(c.description)} |")
        out.append("\n".join(rows))   # one block: a blank line between rows would end the table
        if spec.invariants:
            out.append("\nInvariants:\n" + "\n".join(f"- {i.description}" for i in spec.invariants))
        out.append("")
    return "\n\n".join(out)


README_BEGIN = "<!-- schema:begin (generated by `python -m pipeline.schema --update-docs`; do not edit) -->"
README_END = "<!-- schema:end -->"
DOCS_PAGE = "docs/reference/tables.md"   # the page that holds the generated section (it was README.md's)


def update_readme(path) -> bool:
    """Rewrite the generated schema section of ``path`` (the docs site's tables page, DOCS_PAGE); True if it
    changed. (The name is from when the section was README.md's.)"""
    from pathlib import Path

    p = Path(path)
    text = p.read_text()
    a, b = text.index(README_BEGIN), text.index(README_END)
    new = text[: a + len(README_BEGIN)] + "\n\n" + markdown() + "\n" + text[b:]
    if new != text:
        p.write_text(new)
    return new != text


if __name__ == "__main__":  # pragma: no cover
    if "--markdown" in sys.argv:
        print(markdown())
    elif "--update-docs" in sys.argv or "--update-readme" in sys.argv:   # --update-readme: its earlier name
        from pathlib import Path

        changed = update_readme(Path(__file__).resolve().parent.parent / DOCS_PAGE)
        print(f"{DOCS_PAGE} updated" if changed else f"{DOCS_PAGE} already up to date")
    else:
        for t in TABLES:
            print(t, arrow_schema(t))
