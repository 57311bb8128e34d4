"""From engine output to decisions: the shared, pure core after the checks ran.

Every engine (DuckDB SQL, Dask, the plain-Python reference) produces the same
two Arrow tables, sorted by (group_id, trajectory_id) / group_id:

- members: one row per member of a ready group with its ``reason`` (null =
  valid), ``policy_lag``, reward and bucket inputs;
- groups: one row per ready group with the reference configuration and the
  check columns (``min_valid_ok``, ``spread_ok``, ``gate_<i>`` values).

``finalize`` turns them into receipts (one per group), the admitted members
with their advantages, and bucket labels; reward mean/std are computed here,
once, in a fixed order, so every engine yields bit-identical receipts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline.admission.advantages import ESTIMATORS, compute_advantages, running_baseline
from pipeline.admission.checks import ADMIT, CHECK_NAMES, FAIL, PASS, batch_config_outcomes, decide, group_outcomes
from pipeline.admission.config import AdmissionConfig
from pipeline.admission.rules import BATCH_FIELDS, REF_FIELDS

_S, _F = pa.string(), pa.float64()
REF_TYPES = (pa.int64(), _S, _S, _S, _S, _F, _F, _S, _S, _S, _S, _S)


def bucket_labels(values: np.ndarray, edges) -> np.ndarray:
    """Per value: ``<e0``, ``e_i-e_{i+1}`` (half-open) or ``>=e_last``; ``all`` with no edges; NaN -> None."""
    values = np.asarray(values, np.float64)
    if not edges:
        labels = np.array(["all"], dtype=object)
        out = labels[np.zeros(len(values), np.int64)]
    else:
        names = [f"<{edges[0]:g}"] + [f"{lo:g}-{hi:g}" for lo, hi in zip(edges, edges[1:])] + [f">={edges[-1]:g}"]
        out = np.array(names, dtype=object)[np.searchsorted(np.asarray(edges, np.float64), values, side="right")]
    out[np.isnan(values)] = None
    return out


@dataclass
class Decisions:
    receipts: pa.Table              # receipts columns minus admission_run_id / snapshot_id / decided_at
    admitted: pa.Table              # snapshot_members columns minus snapshot_id (sorted group, trajectory)
    counts: dict[str, int] = field(default_factory=dict)
    baseline: float | None = None   # reinforce_batch_norm running baseline to carry forward


def admitted_schema() -> pa.Schema:
    from pipeline.schema import table_spec

    spec = table_spec("snapshot_members")
    return pa.schema([f for f in spec.arrow_schema() if f.name != "snapshot_id"])


def receipt_core_schema() -> pa.Schema:
    from pipeline.schema import table_spec

    skip = {"admission_run_id", "snapshot_id", "decided_at"}
    return pa.schema([f for f in table_spec("receipts").arrow_schema() if f.name not in skip])


def _np(col: pa.ChunkedArray | pa.Array, dtype, fill) -> np.ndarray:
    """Arrow column -> numpy ``dtype`` with nulls as ``fill``."""
    if col.null_count == 0:
        return np.asarray(col.to_numpy(zero_copy_only=False) if isinstance(col, pa.Array)
                          else col.to_numpy(), dtype)
    mask = np.asarray(col.is_null().to_numpy(zero_copy_only=False), bool)
    out = np.array(col.cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False)
                     if dtype is np.float64 else col.fill_null(0 if dtype is not bool else False)
                     .to_numpy(zero_copy_only=False), dtype)
    out[mask] = fill
    return out


def finalize(members: pa.Table, groups: pa.Table, cfg: AdmissionConfig, *, config_hash: str,
             current_policy_version: int, previous_baseline: float | None = None) -> Decisions:
    members, groups = sort_members(members), sort_groups(groups)
    m = _member_arrays(members, groups)
    stats = _reward_stats(m, groups.num_rows)
    labels = _group_labels(groups, cfg, stats)
    outcomes, decision = _decide_groups(cfg, groups, m, labels)
    receipts = _receipts(groups, m, stats, labels, outcomes, decision, config_hash=config_hash,
                         current_policy_version=current_policy_version)
    admitted, baseline = _admitted(cfg, m, labels, decision, previous_baseline)
    values, counts_ = np.unique(decision.astype(str), return_counts=True) if groups.num_rows else (np.array([]), np.array([]))
    counts = {str(v): int(c) for v, c in zip(values, counts_)}
    return Decisions(receipts, admitted, counts, baseline)


def _is_sorted(table: pa.Table, keys: list[str]) -> bool:
    """Whether ``table`` is sorted ascending by ``keys`` (unique, non-null): a few vectorised
    comparisons, much cheaper than sorting again what an engine already sorted."""
    import pyarrow.compute as pc

    n = table.num_rows
    if n < 2:
        return True
    later = pa.array(np.zeros(n - 1, bool))   # row i+1 > row i, decided by the keys so far
    tied = pa.array(np.ones(n - 1, bool))
    for k in keys:
        col = table.column(k)
        a, b = col.slice(1), col.slice(0, n - 1)
        later = pc.or_(later, pc.and_(tied, pc.greater(a, b)))
        tied = pc.and_(tied, pc.equal(a, b))
    return bool(pc.all(later.fill_null(False)).as_py())


def sort_members(members: pa.Table) -> pa.Table:
    """Engine member rows in the contract order (group_id, trajectory_id)."""
    keys = ["group_id", "trajectory_id"]
    return members if _is_sorted(members, keys) else members.sort_by([(k, "ascending") for k in keys])


def sort_groups(groups: pa.Table) -> pa.Table:
    """Engine group rows in the contract order (group_id)."""
    return groups if _is_sorted(groups, ["group_id"]) else groups.sort_by([("group_id", "ascending")])


@dataclass
class _MemberArrays:
    """The engine's member rows, sorted (group_id, trajectory_id), as arrays [M]."""

    table: pa.Table
    gidx: np.ndarray        # each member's row in the (sorted) group table
    valid: np.ndarray       # no exclusion reason
    reward: np.ndarray      # null -> 0
    reasons: np.ndarray     # object: the exclusion reason or None


@dataclass
class _RewardStats:
    """Per group [G]: reward mean / population std over the valid members."""

    mean: np.ndarray
    std: np.ndarray
    has: np.ndarray         # the group has valid members (else mean/std are null)


def _member_arrays(members: pa.Table, groups: pa.Table) -> _MemberArrays:
    """Index members by group; both engines' tables must cover the same groups, in order."""
    import pyarrow.compute as pc

    n_groups = groups.num_rows
    gidx = np.asarray(pc.index_in(members.column("group_id"), value_set=groups.column("group_id").combine_chunks())
                      .to_numpy(zero_copy_only=False))
    if members.num_rows and (np.isnan(gidx.astype(np.float64)).any()):
        raise AssertionError("member rows of groups missing from the group table")
    gidx = gidx.astype(np.int64)
    if n_groups and np.bincount(gidx, minlength=n_groups).min() == 0:
        raise AssertionError("a group has no member rows (engine output out of order)")
    valid = np.asarray(pc.is_null(members.column("reason")).to_numpy(zero_copy_only=False), bool)
    reward = _np(members.column("reward"), np.float64, 0.0)
    reasons = np.asarray(members.column("reason").to_numpy(zero_copy_only=False), dtype=object)
    return _MemberArrays(members, gidx, valid, reward, reasons)


def _reward_stats(m: _MemberArrays, n_groups: int) -> _RewardStats:
    """Reward mean / population std over valid members, one fixed order for every engine."""
    g, r = m.gidx[m.valid], m.reward[m.valid]
    cnt = np.bincount(g, minlength=n_groups).astype(np.float64)                                     # [G]
    mean = np.bincount(g, weights=r, minlength=n_groups) / np.maximum(cnt, 1)
    dev = r - mean[g]
    std = np.sqrt(np.bincount(g, weights=dev * dev, minlength=n_groups) / np.maximum(cnt, 1))
    return _RewardStats(mean, std, cnt > 0)


def _group_labels(groups: pa.Table, cfg: AdmissionConfig, stats: _RewardStats) -> dict[str, np.ndarray]:
    """Each group's bucket labels (BUCKET_FIELDS): difficulty, length, tool calls, reward std."""
    return {
        "difficulty": np.asarray(groups.column("difficulty").to_numpy(zero_copy_only=False), dtype=object),
        "length_bucket": bucket_labels(_np(groups.column("max_response_len"), np.float64, np.nan), cfg.length_edges),
        "tool_call_bucket": bucket_labels(_np(groups.column("max_tool_calls"), np.float64, np.nan),
                                          cfg.tool_call_edges),
        "reward_std_bucket": bucket_labels(np.where(stats.has, stats.std, np.nan), cfg.reward_std_edges),
    }


def _decide_groups(cfg: AdmissionConfig, groups: pa.Table, m: _MemberArrays, labels: dict[str, np.ndarray]
                   ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(outcome of every check per group, decision per group): the per-group checks,
    then the snapshot's one configuration, then the bucket caps."""
    gate_values = [_np(groups.column(f"gate_{i}"), np.float64, np.nan) for i in range(len(cfg.gates))]
    outcomes = group_outcomes(
        cfg, group_baseline=ESTIMATORS[cfg.advantage].group_baseline, excluded_group=m.gidx[~m.valid],
        excluded_reason=m.reasons[~m.valid], arrived=_np(groups.column("arrived_members"), np.int64, 0),
        group_size=_np(groups.column("group_size"), np.int64, 0), n_valid=_np(groups.column("n_valid"), np.int64, 0),
        min_valid_ok=_np(groups.column("min_valid_ok"), bool, False),
        spread_ok=_np(groups.column("spread_ok"), bool, False), gate_values=gate_values)
    decision = decide(cfg, outcomes)
    # one configuration per snapshot, among the groups every per-group check admits
    outcomes["batch_config"] = batch_config_outcomes(
        cfg, {f: groups.column(f"ref_{f}") for f in BATCH_FIELDS}, decision == ADMIT)
    decision = decide(cfg, outcomes)
    if cfg.bucket_caps:
        outcomes["bucket_cap"] = _bucket_cap_outcomes(cfg, decision, labels)
        decision = decide(cfg, outcomes)
    return outcomes, decision


def _bucket_cap_outcomes(cfg: AdmissionConfig, decision: np.ndarray, labels: dict[str, np.ndarray]) -> np.ndarray:
    """``bucket_cap`` per group: admitted groups count against their labels' caps in group_id order, per run."""
    out = np.full(len(decision), PASS, dtype=object)
    used: dict[str, int] = {}
    caps = [(k, k.split(":", 1)[0], k.split(":", 1)[1], v) for k, v in sorted(cfg.bucket_caps.items())]
    for i in np.flatnonzero(decision == ADMIT):
        hit = [(k, cap) for k, fld, lab, cap in caps if labels[fld][i] == lab]
        over = [(k, cap) for k, cap in hit if used.get(k, 0) >= cap]
        if over:
            out[i] = FAIL + ",".join(f"{k} cap {cap}" for k, cap in over)
        else:
            for k, _ in hit:
                used[k] = used.get(k, 0) + 1
    return out


def _receipts(groups: pa.Table, m: _MemberArrays, stats: _RewardStats, labels: dict[str, np.ndarray],
              outcomes: dict[str, np.ndarray], decision: np.ndarray, *, config_hash: str,
              current_policy_version: int) -> pa.Table:
    """One receipt per group (receipt_core_schema)."""
    n_groups = groups.num_rows
    tids = m.table.column("trajectory_id").combine_chunks()
    valid, excl = m.valid, ~m.valid
    valid_off = np.concatenate([[0], np.cumsum(np.bincount(m.gidx[valid], minlength=n_groups))]).astype(np.int32)
    excl_off = np.concatenate([[0], np.cumsum(np.bincount(m.gidx[excl], minlength=n_groups))]).astype(np.int32)
    k = len(CHECK_NAMES)
    check_items = np.stack([outcomes[c] for c in CHECK_NAMES], axis=1).ravel()                      # [G*k]
    has = stats.has
    schema = receipt_core_schema()
    cols = {
        "group_id": groups.column("group_id"),
        "config_hash": pa.array([config_hash] * n_groups, pa.string()),
        "current_policy_version": pa.array(np.full(n_groups, int(current_policy_version), np.int64)),
        "run_id": groups.column("run_id"), "task_id": groups.column("task_id"),
        **{f"ref_{f}": groups.column(f"ref_{f}") for f in REF_FIELDS},
        "group_size": groups.column("group_size"), "arrived_members": groups.column("arrived_members"),
        "valid_members": pa.ListArray.from_arrays(pa.array(valid_off), tids.filter(pa.array(valid))),
        "excluded_members": pa.MapArray.from_arrays(
            pa.array(excl_off), tids.filter(pa.array(excl)),
            pa.array(m.reasons[excl], pa.string())),
        "reward_mean": pa.array(np.where(has, stats.mean, 0.0), pa.float64(), mask=~has),
        "reward_std": pa.array(np.where(has, stats.std, 0.0), pa.float64(), mask=~has),
        "policy_lag": groups.column("policy_lag"), "max_queue_wait_ms": groups.column("max_queue_wait_ms"),
        **{name: pa.array(v, pa.string()) for name, v in labels.items()},
        "checks": pa.MapArray.from_arrays(pa.array(np.arange(0, n_groups * k + 1, k, dtype=np.int32)),
                                          pa.array(list(CHECK_NAMES) * n_groups, pa.string()),
                                          pa.array(check_items, pa.string())),
        "decision": pa.array(decision, pa.string()),
    }
    return pa.table({f.name: cols[f.name] for f in schema}).cast(schema)


def _admitted(cfg: AdmissionConfig, m: _MemberArrays, labels: dict[str, np.ndarray], decision: np.ndarray,
              previous_baseline: float | None) -> tuple[pa.Table, float | None]:
    """(admitted members with their advantages, the running baseline to carry):
    the valid members of admitted groups."""
    members, gidx = m.table, m.gidx
    adm = m.valid & (decision[gidx] == ADMIT) if members.num_rows else np.zeros(0, bool)         # [M]
    rewards = m.reward[adm]
    codes = np.unique(gidx[adm], return_inverse=True)[1].astype(np.int64) if adm.any() else np.zeros(0, np.int64)
    baseline = running_baseline(previous_baseline, rewards, cfg.baseline_momentum) \
        if cfg.advantage == "reinforce_batch_norm" else None
    adv = compute_advantages(cfg.advantage, rewards, codes, eps=cfg.eps, scaling=cfg.advantage_scaling,
                             baseline=baseline)
    sel = pa.array(adm)
    std_bucket = labels["reward_std_bucket"][gidx[adm]]
    admitted = pa.table({
        "trajectory_id": members.column("trajectory_id").combine_chunks().filter(sel),
        "group_id": members.column("group_id").filter(sel),
        "content_hash": members.column("content_hash").filter(sel),
        "advantage": pa.array(adv, pa.float64()),
        "reward": pa.array(rewards, pa.float64()),
        "policy_lag": members.column("policy_lag").filter(sel),
        "difficulty": members.column("difficulty").filter(sel),
        "length_bucket": pa.array(bucket_labels(_np(members.column("response_len").filter(sel), np.float64, np.nan),
                                                cfg.length_edges).tolist(), pa.string()),
        "tool_call_bucket": pa.array(bucket_labels(_np(members.column("num_tool_calls").filter(sel), np.float64,
                                                       np.nan), cfg.tool_call_edges).tolist(), pa.string()),
        "reward_std_bucket": pa.array(std_bucket.tolist(), pa.string()),
    }, schema=admitted_schema())
    return admitted, baseline


def member_schema(cfg: AdmissionConfig) -> pa.Schema:
    s = pa.string()
    return pa.schema(
        [("trajectory_id", s), ("group_id", s), ("group_size", pa.int32()), ("content_hash", s),
         ("reward", pa.float64()), ("queue_wait_ms", pa.int64()), ("response_len", pa.int64()),
         ("num_tool_calls", pa.int32()), ("difficulty", s), ("run_id", s), ("task_id", s),
         ("policy_lag", pa.int64()), ("reason", s)]
        + [(f"ref_{f}", t) for f, t in zip(REF_FIELDS, REF_TYPES)]
        + [(f"comp_{c}", pa.float64()) for c in cfg.components])


def group_schema(cfg: AdmissionConfig) -> pa.Schema:
    s = pa.string()
    return pa.schema(
        [("group_id", s), ("run_id", s), ("task_id", s), ("difficulty", s)]
        + [(f"ref_{f}", t) for f, t in zip(REF_FIELDS, REF_TYPES)]
        + [("group_size", pa.int32()), ("arrived_members", pa.int32()), ("max_response_len", pa.int64()),
           ("max_tool_calls", pa.int32()), ("n_valid", pa.int32()), ("min_valid_ok", pa.bool_()),
           ("spread_ok", pa.bool_()), ("policy_lag", pa.int64()), ("max_queue_wait_ms", pa.int64())]
        + [(f"gate_{i}", pa.float64()) for i in range(len(cfg.gates))])


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast an engine's output to the contract schema."""
    return table.select(schema.names).cast(schema)
