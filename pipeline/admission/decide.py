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
from pipeline.admission.checks import CHECK_NAMES, decide, group_outcomes
from pipeline.admission.config import AdmissionConfig

REF_FIELDS = ("policy_version", "tokenizer_rev", "prompt_template_rev", "env_version", "verifier_version",
              "temperature")


def bucket_label(value, edges) -> str | None:
    """``<e0``, ``e_i-e_{i+1}`` (half-open) or ``>=e_last``; None for a null value."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    if not edges:
        return "all"
    if value < edges[0]:
        return f"<{edges[0]:g}"
    for lo, hi in zip(edges, edges[1:]):
        if lo <= value < hi:
            return f"{lo:g}-{hi:g}"
    return f">={edges[-1]:g}"


@dataclass
class Decisions:
    receipts: list[dict]            # receipt rows, minus admission_run_id / snapshot_id / decided_at
    admitted: pa.Table              # snapshot_members columns minus snapshot_id (sorted group, trajectory)
    counts: dict[str, int] = field(default_factory=dict)
    baseline: float | None = None   # reinforce_batch_norm running baseline to carry forward


def admitted_schema() -> pa.Schema:
    from pipeline.schema import table_spec

    spec = table_spec("snapshot_members")
    return pa.schema([f for f in spec.arrow_schema() if f.name != "snapshot_id"])


def finalize(members: pa.Table, groups: pa.Table, cfg: AdmissionConfig, *, config_hash: str,
             current_policy_version: int, previous_baseline: float | None = None) -> Decisions:
    members = members.sort_by([("group_id", "ascending"), ("trajectory_id", "ascending")])
    groups = groups.sort_by([("group_id", "ascending")])
    m = {c: members.column(c).to_pylist() for c in
         ("trajectory_id", "group_id", "content_hash", "reward", "reason", "policy_lag", "response_len",
          "num_tool_calls", "difficulty")}
    g = groups.to_pylist()
    gate_cols = [f"gate_{i}" for i in range(len(cfg.gates))]
    group_baseline = ESTIMATORS[cfg.advantage].group_baseline
    gid_m = m["group_id"]
    receipts: list[dict] = []
    adm_idx: list[int] = []        # member rows admitted
    adm_group: list[int] = []      # their receipt index
    std_bucket_of: dict[int, str | None] = {}
    cap_used: dict[str, int] = {}
    start = 0
    n = len(gid_m)
    for gi, row in enumerate(g):
        gid = row["group_id"]
        end = start
        while end < n and gid_m[end] == gid:
            end += 1
        if end == start:
            raise AssertionError(f"group {gid} has no member rows (engine output out of order)")
        idx = range(start, end)
        start = end
        reasons = [m["reason"][i] for i in idx if m["reason"][i] is not None]
        valid = [i for i in idx if m["reason"][i] is None]
        rewards = np.array([m["reward"][i] for i in valid], np.float64)
        mean = float(np.mean(rewards)) if rewards.size else None
        std = float(np.sqrt(np.mean((rewards - mean) ** 2))) if rewards.size else None
        outcomes = group_outcomes(
            cfg, group_baseline=group_baseline, reasons=reasons, arrived=row["arrived_members"],
            group_size=row["group_size"], n_valid=row["n_valid"], min_valid_ok=bool(row["min_valid_ok"]),
            spread_ok=bool(row["spread_ok"]), gate_values=[row[c] for c in gate_cols])
        labels = {
            "difficulty": row["difficulty"],
            "length_bucket": bucket_label(row["max_response_len"], cfg.length_edges),
            "tool_call_bucket": bucket_label(row["max_tool_calls"], cfg.tool_call_edges),
            "reward_std_bucket": bucket_label(std, cfg.reward_std_edges),
        }
        decision = decide(cfg, outcomes)
        if cfg.bucket_caps:
            outcomes["bucket_cap"] = "pass"
            if decision == "admit":
                over = [k for k in sorted(cfg.bucket_caps)
                        if labels.get(k.split(":", 1)[0]) == k.split(":", 1)[1]
                        and cap_used.get(k, 0) >= cfg.bucket_caps[k]]
                if over:
                    outcomes["bucket_cap"] = "fail:" + ",".join(f"{k} cap {cfg.bucket_caps[k]}" for k in over)
                    decision = decide(cfg, outcomes)
                else:
                    for k in cfg.bucket_caps:
                        if labels.get(k.split(":", 1)[0]) == k.split(":", 1)[1]:
                            cap_used[k] = cap_used.get(k, 0) + 1
        rec = {
            "group_id": gid,
            "config_hash": config_hash,
            "current_policy_version": int(current_policy_version),
            "run_id": row["run_id"],
            "task_id": row["task_id"],
            **{f"ref_{f}": row[f"ref_{f}"] for f in REF_FIELDS},
            "group_size": row["group_size"],
            "arrived_members": row["arrived_members"],
            "valid_members": [m["trajectory_id"][i] for i in valid],
            "excluded_members": [(m["trajectory_id"][i], m["reason"][i]) for i in idx
                                 if m["reason"][i] is not None],
            "reward_mean": mean,
            "reward_std": std,
            "policy_lag": row["policy_lag"],
            "max_queue_wait_ms": row["max_queue_wait_ms"],
            **labels,
            "checks": [(k, outcomes[k]) for k in CHECK_NAMES],
            "decision": decision,
        }
        receipts.append(rec)
        if decision == "admit":
            std_bucket_of[len(receipts) - 1] = labels["reward_std_bucket"]
            adm_idx.extend(valid)
            adm_group.extend([len(receipts) - 1] * len(valid))
    if start != n:
        raise AssertionError("member rows of groups missing from the group table")
    rewards = np.array([m["reward"][i] for i in adm_idx], np.float64)
    codes = np.unique(np.array(adm_group, np.int64), return_inverse=True)[1] if adm_group else np.zeros(0, np.int64)
    baseline = running_baseline(previous_baseline, rewards, cfg.baseline_momentum) \
        if cfg.advantage == "reinforce_batch_norm" else None
    adv = compute_advantages(cfg.advantage, rewards, codes, eps=cfg.eps, scaling=cfg.advantage_scaling,
                             baseline=baseline)
    admitted = pa.table({
        "trajectory_id": [m["trajectory_id"][i] for i in adm_idx],
        "group_id": [m["group_id"][i] for i in adm_idx],
        "content_hash": [m["content_hash"][i] for i in adm_idx],
        "advantage": adv,
        "reward": rewards,
        "policy_lag": [m["policy_lag"][i] for i in adm_idx],
        "difficulty": [m["difficulty"][i] for i in adm_idx],
        "length_bucket": [bucket_label(m["response_len"][i], cfg.length_edges) for i in adm_idx],
        "tool_call_bucket": [bucket_label(m["num_tool_calls"][i], cfg.tool_call_edges) for i in adm_idx],
        "reward_std_bucket": [std_bucket_of[r] for r in adm_group],
    }, schema=admitted_schema())
    counts: dict[str, int] = {}
    for r in receipts:
        counts[r["decision"]] = counts.get(r["decision"], 0) + 1
    return Decisions(receipts, admitted, counts, baseline)


def member_schema(cfg: AdmissionConfig) -> pa.Schema:
    s = pa.string()
    return pa.schema(
        [("trajectory_id", s), ("group_id", s), ("group_size", pa.int32()), ("content_hash", s),
         ("reward", pa.float64()), ("queue_wait_ms", pa.int64()), ("response_len", pa.int64()),
         ("num_tool_calls", pa.int32()), ("difficulty", s), ("run_id", s), ("task_id", s),
         ("policy_lag", pa.int64()), ("reason", s)]
        + [(f"ref_{f}", t) for f, t in zip(REF_FIELDS, (pa.int64(), s, s, s, s, pa.float64()))]
        + [(f"comp_{c}", pa.float64()) for c in cfg.components])


def group_schema(cfg: AdmissionConfig) -> pa.Schema:
    s = pa.string()
    return pa.schema(
        [("group_id", s), ("run_id", s), ("task_id", s), ("difficulty", s)]
        + [(f"ref_{f}", t) for f, t in zip(REF_FIELDS, (pa.int64(), s, s, s, s, pa.float64()))]
        + [("group_size", pa.int32()), ("arrived_members", pa.int32()), ("max_response_len", pa.int64()),
           ("max_tool_calls", pa.int32()), ("n_valid", pa.int32()), ("min_valid_ok", pa.bool_()),
           ("spread_ok", pa.bool_()), ("policy_lag", pa.int64()), ("max_queue_wait_ms", pa.int64())]
        + [(f"gate_{i}", pa.float64()) for i in range(len(cfg.gates))])


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast an engine's output to the contract schema."""
    return table.select(schema.names).cast(schema)
