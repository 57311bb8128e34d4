"""Declared admission checks: (name, blocking, decision), separate from
how they run (the SQL in sql/admission_*.sql, the Dask and reference engines
compute the per-group columns these read). The outcome of every check is data:
the receipt's ``checks`` map holds ``pass``, ``fail:<detail>`` or ``skip`` for
each, and the decision is the first failing *blocking* check, in declared order
(Dagster asset checks are the model).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Collection, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.admission import rules
from pipeline.admission.config import AdmissionConfig

OPS: dict[str, Callable[[Any, Any], Any]] = {  # elementwise over numpy arrays too
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}


# A check's outcome for one group (receipts.checks): PASS, SKIP (the check does not apply), or FAIL followed by
# what failed (``fail:<detail>``).
PASS = "pass"
SKIP = "skip"
FAIL = "fail:"

# A group's decision (receipts.decision): admitted, or the decision of the first blocking check that failed
# (CHECKS), or reverification's verdict_disagreement (reverify.py).
Decision = Literal["admit", "incomplete", "insufficient_valid", "zero_variance", "gated", "batch_config_mismatch",
                   "capped", "verdict_disagreement"]
ADMIT: Decision = "admit"


@dataclass(frozen=True)
class CheckSpec:
    name: str
    blocking: Callable[[AdmissionConfig], bool]
    decision: Decision | None     # the decision when it blocks
    description: str


def _always(cfg: AdmissionConfig) -> bool:
    return True


def _never(cfg: AdmissionConfig) -> bool:
    return False


CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("quality", _never, None,
              "rows failing the great-expectations suite from schemas/ are excluded (reason quality:<expectation>)"),
    CheckSpec("member_exclusions", _never, None,
              "infra_failed / expired / no_reward (and, under truncation=filter, truncated) members leave the "
              "group baseline"),
    CheckSpec("comparability", _never, None,
              "members differing from the reference configuration are excluded (*_mismatch)"),
    CheckSpec("freshness", _never, None,
              "members with policy lag > max_policy_lag or queue wait > max_queue_wait_ms are excluded"),
    CheckSpec("complete", lambda cfg: not cfg.admit_incomplete, "incomplete",
              "all group_size members arrived (else the group timed out and is decided with what arrived)"),
    CheckSpec("min_valid_members", _always, "insufficient_valid",
              "at least min_valid_members valid members"),
    CheckSpec("reward_spread", lambda cfg: cfg.drop_zero_variance, "zero_variance",
              "max(reward) > min(reward) and population std >= min_reward_std (group estimators only; "
              "drop_zero_variance=false admits such groups with advantage 0)"),
    CheckSpec("update_if", _always, "gated",
              "every reward-decomposition gate holds over the valid members"),
    CheckSpec("batch_config", _always, "batch_config_mismatch",
              "the group's tokenizer/template/env/verifier versions are the snapshot's configuration (the most "
              "common among the groups admitted otherwise), unless mix_batch_fields opts in to mixing"),
    CheckSpec("bucket_cap", _always, "capped",
              "the group's bucket labels are under their per-run caps"),
)
CHECK_NAMES = tuple(c.name for c in CHECKS)


def reason_details(group_index: np.ndarray, reasons: np.ndarray, n_groups: int) -> dict[str, np.ndarray]:
    """Outcome of each member-level check per group: ``fail:<reason>=<n>,...``
    (reasons sorted) for groups with such exclusions, else ``pass``.
    ``group_index``/``reasons`` cover the excluded members only.

    Vectorised in Arrow (one hash aggregation, one sort, one list join): at
    100k candidates the per-member Python loop it replaces was a third of
    finalize."""
    out = {name: np.full(n_groups, PASS, dtype=object) for name in MEMBER_REASONS}
    if len(reasons) == 0:
        return out
    t = pa.table({"g": pa.array(np.asarray(group_index, np.int64)), "r": pa.array(reasons, pa.string())})
    t = t.group_by(["g", "r"], use_threads=False).aggregate([([], "count_all")])
    names = t.column("r").unique()
    which = {}
    for r in names.to_pylist():      # the few distinct reasons: the first check whose predicate holds
        which[r] = next((name for name, pred in MEMBER_REASONS.items() if pred(r)), None)
    check = pa.array([which[r] for r in t.column("r").to_pylist()], pa.string()) if len(names) > 1 else \
        pa.array([which[names[0].as_py()]] * t.num_rows, pa.string())
    t = t.append_column("check", check).filter(pc.is_valid(check))
    # (g, r) in Python's tuple order: int, then the reason by code point (= UTF-8 byte order)
    t = t.sort_by([("g", "ascending"), ("r", "ascending")])
    t = t.append_column("item", pc.binary_join_element_wise(t.column("r"), pc.cast(t.column("count_all"), pa.string()),
                                                            "="))
    joined = t.group_by(["check", "g"], use_threads=False).aggregate([("item", "list")])
    texts = pc.binary_join_element_wise(FAIL, pc.binary_join(joined.column("item_list"), ","), "")
    checks = joined.column("check").to_numpy(zero_copy_only=False)
    gs = joined.column("g").to_numpy()
    texts_np = np.asarray(texts.to_numpy(zero_copy_only=False), dtype=object)
    for name in out:
        sel = checks == name
        if sel.any():
            out[name][gs[sel]] = texts_np[sel]
    return out


MEMBER_REASONS = {
    "quality": lambda r: r.startswith(rules.QUALITY_PREFIX),
    "member_exclusions": lambda r: r in rules.EXCLUSION_REASONS,
    "comparability": lambda r: r in rules.MISMATCH_REASONS,
    "freshness": lambda r: r in rules.FRESHNESS_REASONS,
}


def gate_outcomes(cfg: AdmissionConfig, values: list[np.ndarray], n_groups: int) -> np.ndarray:
    """``update_if`` outcome per group from each gate's aggregate (NaN = no value)."""
    gates = cfg.gates
    if not gates:
        return np.full(n_groups, SKIP, dtype=object)
    ok = np.ones(n_groups, bool)
    oks = []
    for g, v in zip(gates, values):
        v = np.asarray(v, np.float64)
        with np.errstate(invalid="ignore"):
            passed = ~np.isnan(v) & OPS[g.op](v, g.value)
        oks.append(passed)
        ok &= passed
    out = np.full(n_groups, PASS, dtype=object)
    for i in np.flatnonzero(~ok):
        bad = [f"{g.agg}({g.component})={'null' if np.isnan(v[i]) else format(float(v[i]), 'g')} not {g.op} {g.value:g}"
               for g, v, passed in zip(gates, values, oks) if not passed[i]]
        out[i] = FAIL + "; ".join(bad)
    return out


def group_outcomes(cfg: AdmissionConfig, *, group_baseline: bool, excluded_group: np.ndarray,
                   excluded_reason: np.ndarray, arrived: np.ndarray, group_size: np.ndarray, n_valid: np.ndarray,
                   min_valid_ok: np.ndarray, spread_ok: np.ndarray, gate_values: list[np.ndarray]
                   ) -> dict[str, np.ndarray]:
    """Outcome of every check per group (bucket_cap: ``skip``; decided across groups later)."""
    n = len(arrived)
    out = reason_details(excluded_group, excluded_reason, n)
    complete = np.full(n, PASS, dtype=object)
    for i in np.flatnonzero(arrived < group_size):
        complete[i] = f"{FAIL}{arrived[i]}/{group_size[i]} arrived"
    out["complete"] = complete
    mv = np.full(n, PASS, dtype=object)
    for i in np.flatnonzero(~min_valid_ok):
        mv[i] = f"{FAIL}{n_valid[i]} < {cfg.min_valid_members}"
    out["min_valid_members"] = mv
    if group_baseline:
        out["reward_spread"] = np.where(spread_ok, PASS, FAIL + "no reward spread among valid members").astype(object)
    else:
        out["reward_spread"] = np.full(n, SKIP, dtype=object)
    out["update_if"] = gate_outcomes(cfg, gate_values, n)
    out["batch_config"] = np.full(n, SKIP, dtype=object)
    out["bucket_cap"] = np.full(n, SKIP, dtype=object)
    return out


def decide(cfg: AdmissionConfig, outcomes: dict[str, np.ndarray]) -> np.ndarray:
    """Per group: the first failing blocking check's decision, else ``admit``."""
    n = len(next(iter(outcomes.values())))
    decision = np.full(n, ADMIT, dtype=object)
    for spec in reversed(CHECKS):  # earlier checks overwrite later ones
        if spec.decision and spec.blocking(cfg) and spec.name in outcomes:
            failed = failed_mask(outcomes[spec.name])
            decision[failed] = spec.decision
    return decision


def failed_mask(outcome: np.ndarray) -> np.ndarray:
    """Which outcomes are ``fail:...`` (one Arrow pass, not a Python loop per group)."""
    if len(outcome) == 0:
        return np.zeros(0, bool)
    return np.asarray(pc.starts_with(pa.array(outcome, pa.string()), "fail").to_numpy(zero_copy_only=False), bool)


def first_blocking(failed: Collection[str], cfg: AdmissionConfig | None = None) -> Decision:
    """One group's ``decide``: the decision of the first failing blocking check
    among the check names in ``failed``, in declared order, else ``admit``.
    ``cfg`` None: every check that has a decision blocks (the simulator's gate)."""
    for spec in CHECKS:
        if spec.decision and spec.name in failed and (cfg is None or spec.blocking(cfg)):
            return spec.decision
    return ADMIT


def batch_config_outcomes(cfg: AdmissionConfig, configs: dict[str, Any], admit: np.ndarray) -> np.ndarray:
    """``batch_config`` outcome per group. ``configs[field]`` holds each group's
    reference value of every BATCH_FIELDS field; ``admit`` marks the groups every
    other check admits. Among those, the snapshot's configuration is the most
    common tuple of the fields not opted in to mixing (ties: the lexicographically
    smaller tuple); an admitted group with another is ``fail:<field> <value> !=
    <snapshot value>``, others ``pass``; groups not admitted otherwise ``skip``.
    Every field opted in: ``skip`` for all."""
    n = len(admit)
    out = np.full(n, SKIP, dtype=object)
    fields = [f for f in rules.BATCH_FIELDS if f not in cfg.mix_batch_fields]
    idx = np.flatnonzero(admit)
    if not fields or len(idx) == 0:
        return out
    # counted in Arrow: one hash aggregation over the admitted groups, not a tuple per group in Python
    t = pa.table({f: configs[f] if isinstance(configs[f], (pa.Array, pa.ChunkedArray)) else pa.array(configs[f])
                  for f in fields}).take(pa.array(idx))
    counts = t.group_by(fields, use_threads=False).aggregate([([], "count_all")]).to_pylist()
    # rules.snapshot_config over the counts: the most common tuple, ties -> the smaller tuple
    ranked = sorted(((-r["count_all"], tuple(r[f] for f in fields)) for r in counts))
    ref = ranked[0][1] if ranked else None
    if ref is None:          # no admitted group: nothing to compare
        return out
    same = np.ones(len(idx), bool)
    for f, v in zip(fields, ref):
        col = t.column(f)
        eq = pc.is_null(col) if v is None else pc.fill_null(pc.equal(col, pa.scalar(v, col.type)), False)
        same &= np.asarray(eq.to_numpy(zero_copy_only=False), bool)
    out[idx[same]] = PASS
    bad = np.flatnonzero(~same)
    if len(bad):
        rows = t.take(pa.array(bad)).to_pylist()
        for k, row in zip(bad, rows):
            key = tuple(row[f] for f in fields)
            j = next(m for m in range(len(fields)) if key[m] != ref[m])
            out[idx[k]] = f"{FAIL}{fields[j]} {key[j]} != {ref[j]}"
    return out
    return out
