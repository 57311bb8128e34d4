"""The DuckDB engine: sql/admission_members.sql then sql/admission_groups.sql
over the candidate Arrow table (docs/dependency-notes.md: DuckDB over Arrow read by pyarrow
was the fastest, lowest-memory engine measured here). duckdb itself is only
imported by pipeline/query/duck.py; we use its connection."""

from __future__ import annotations

import re
from datetime import datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pipeline.admission.config import AdmissionConfig

if TYPE_CHECKING:
    from pipeline.admission.decide import Decisions

_SQL_AGG = {"min": "min", "max": "max", "mean": "avg"}


def _sql(name: str) -> str:
    from pipeline.resources import sql_path

    return sql_path(name).read_text()


def members_sql(cfg: AdmissionConfig) -> str:
    comps = "".join(f", m.comp_{c} AS comp_{c}" for c in cfg.components)
    return _sql("admission_members").replace("/*COMPONENTS*/", comps)


def groups_sql(cfg: AdmissionConfig) -> str:
    gates = "".join(f", CAST({_SQL_AGG[g.agg]}(comp_{g.component}) FILTER (WHERE reason IS NULL) AS DOUBLE)"
                    f" AS gate_{i}" for i, g in enumerate(cfg.gates))
    return _sql("admission_groups").replace("/*GATES*/", gates)


def params(cfg: AdmissionConfig, current_policy_version: int, now: datetime) -> dict[str, Any]:
    return {
        "current_policy_version": int(current_policy_version),
        "max_policy_lag": int(cfg.max_policy_lag),
        "max_queue_wait_ms": cfg.max_queue_wait_ms,
        "group_timeout_s": float(cfg.group_timeout_s),
        "now": now,
        "min_valid_members": int(cfg.min_valid_members),
        "min_reward_std": float(cfg.min_reward_std),
        "vocab_size": cfg.vocab_size,
    }


def _run(con, sql: str, p: dict[str, Any]) -> pa.Table:
    stripped = re.sub(r"--[^\n]*", "", sql)
    used = set(re.findall(r"\$([A-Za-z_][A-Za-z0-9_]*)", stripped))
    return con.sql(sql, params={k: v for k, v in p.items() if k in used}).to_arrow_table()


def run(candidates: pa.Table, quality_rejects: pa.Table, cfg: AdmissionConfig, *,
        current_policy_version: int, now: datetime) -> tuple[pa.Table, pa.Table]:
    """-> (members, groups) per pipeline/admission/decide.py's contract. The
    checks read only the tables registered here, never the lake."""
    from pipeline.query.duck import scratch

    con = scratch()
    try:
        con.register("candidates", candidates)
        con.register("quality_rejects", quality_rejects)
        p = params(cfg, current_policy_version, now)
        members = _run(con, members_sql(cfg), p)
        con.register("members", members)
        groups = _run(con, groups_sql(cfg), p)
    finally:
        con.close()
    from pipeline.admission.decide import sort_groups, sort_members

    return sort_members(members), sort_groups(groups)


def decide_candidates(candidates: pa.Table, cfg: AdmissionConfig, *, current_policy_version: int, now: datetime,
                      config_hash: str, quality_rejects: pa.Table | None = None) -> Decisions:
    """The admission core without a lake: this engine over candidate rows
    (candidates.extract's output), then decide.finalize. What ``pipeline admit``
    decides between its scan and its commit, less the snapshot's tokenizer scope
    and the incremental state; the synthetic report lake and the tests use it."""
    from pipeline.admission.decide import finalize

    if quality_rejects is None:
        quality_rejects = pa.table({"trajectory_id": pa.array([], pa.string()), "reason": pa.array([], pa.string())})
    members, groups = run(candidates, quality_rejects, cfg, current_policy_version=current_policy_version,
                          now=now)
    return finalize(members, groups, cfg, config_hash=config_hash, current_policy_version=current_policy_version)
