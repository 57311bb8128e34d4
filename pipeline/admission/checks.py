"""Declared admission checks: (name, blocking, severity, decision), separate from
how they run (the SQL in sql/admission_*.sql, the Dask and reference engines
compute the per-group columns these read). The outcome of every check is data:
the receipt's ``checks`` map holds ``pass``, ``fail:<detail>`` or ``skip`` for
each, and the decision is the first failing *blocking* check, in declared order
(Dagster asset checks are the model).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pipeline.admission.config import AdmissionConfig

OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}


@dataclass(frozen=True)
class CheckSpec:
    name: str
    blocking: Callable[[AdmissionConfig], bool]
    severity: str            # info | warning | error
    decision: str | None     # the decision when it blocks
    description: str


def _always(cfg: AdmissionConfig) -> bool:
    return True


def _never(cfg: AdmissionConfig) -> bool:
    return False


CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("quality", _never, "error", None,
              "rows failing the great-expectations suite from schemas/ are excluded (reason quality:<expectation>)"),
    CheckSpec("member_exclusions", _never, "info", None,
              "infra_failed / expired / no_reward members leave the group baseline"),
    CheckSpec("comparability", _never, "warning", None,
              "members differing from the reference configuration are excluded (*_mismatch)"),
    CheckSpec("freshness", _never, "warning", None,
              "members with policy lag > max_policy_lag or queue wait > max_queue_wait_ms are excluded"),
    CheckSpec("complete", lambda cfg: not cfg.admit_incomplete, "warning", "incomplete",
              "all group_size members arrived (else the group timed out and is decided with what arrived)"),
    CheckSpec("min_valid_members", _always, "error", "insufficient_valid",
              "at least min_valid_members valid members"),
    CheckSpec("reward_spread", _always, "error", "zero_variance",
              "max(reward) > min(reward) and population std >= min_reward_std (group estimators only)"),
    CheckSpec("update_if", _always, "error", "gated",
              "every reward-decomposition gate holds over the valid members"),
    CheckSpec("bucket_cap", _always, "warning", "capped",
              "the group's bucket labels are under their per-run caps"),
)
CHECK_NAMES = tuple(c.name for c in CHECKS)


def _counts(reasons: list[str], prefix_filter: Callable[[str], bool]) -> str:
    out: dict[str, int] = {}
    for r in reasons:
        if prefix_filter(r):
            out[r] = out.get(r, 0) + 1
    return ",".join(f"{k}={v}" for k, v in sorted(out.items()))


MEMBER_REASONS = {
    "quality": lambda r: r.startswith("quality:"),
    "member_exclusions": lambda r: r in ("infra_failed", "expired", "no_reward"),
    "comparability": lambda r: r.endswith("_mismatch"),
    "freshness": lambda r: r in ("stale_policy", "stale_wait"),
}


def gate_outcome(cfg: AdmissionConfig, values: list[float | None]) -> str:
    gates = cfg.gates
    if not gates:
        return "skip"
    bad = []
    for g, v in zip(gates, values):
        if v is None or (isinstance(v, float) and np.isnan(v)) or not OPS[g.op](float(v), g.value):
            bad.append(f"{g.agg}({g.component})={'null' if v is None else format(float(v), 'g')}"
                       f" not {g.op} {g.value:g}")
    return "fail:" + "; ".join(bad) if bad else "pass"


def group_outcomes(cfg: AdmissionConfig, *, group_baseline: bool, reasons: list[str], arrived: int,
                   group_size: int, n_valid: int, min_valid_ok: bool, spread_ok: bool,
                   gate_values: list[float | None]) -> dict[str, str]:
    """Outcome of every check but bucket_cap (decided later, across groups)."""
    out: dict[str, str] = {}
    for name, pred in MEMBER_REASONS.items():
        detail = _counts(reasons, pred)
        out[name] = f"fail:{detail}" if detail else "pass"
    out["complete"] = "pass" if arrived >= group_size else f"fail:{arrived}/{group_size} arrived"
    out["min_valid_members"] = "pass" if min_valid_ok else f"fail:{n_valid} < {cfg.min_valid_members}"
    if not group_baseline:
        out["reward_spread"] = "skip"
    else:
        out["reward_spread"] = "pass" if spread_ok else "fail:no reward spread among valid members"
    out["update_if"] = gate_outcome(cfg, gate_values)
    out["bucket_cap"] = "skip"
    return out


def decide(cfg: AdmissionConfig, outcomes: dict[str, str]) -> str:
    """The first failing blocking check's decision, else ``admit``."""
    for spec in CHECKS:
        if spec.decision and outcomes.get(spec.name, "skip").startswith("fail") and spec.blocking(cfg):
            return spec.decision
    return "admit"
