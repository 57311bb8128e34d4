"""A plain-Python reference implementation of the admission rules (docs/admission-rules.md).

Slow and obvious on purpose: one loop per rule over raw trajectory rows
(dicts, as ``pa.Table.to_pylist()`` gives them). Tests check that the DuckDB
SQL and the Dask engine produce exactly its members/groups tables
(pipeline/admission/decide.py's contract).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Set
from datetime import datetime, timedelta
from statistics import fmean, pstdev

import pyarrow as pa

from pipeline.admission.config import AdmissionConfig

MISMATCH = (("policy_version", "policy_mismatch"), ("tokenizer_rev", "tokenizer_mismatch"),
            ("prompt_template_rev", "template_mismatch"), ("env_version", "env_mismatch"),
            ("verifier_version", "verifier_mismatch"), ("temperature", "temperature_mismatch"),
            ("top_p", "top_p_mismatch"), ("task_version", "task_version_mismatch"),
            ("harness_version", "harness_mismatch"), ("tool_schema_version", "tool_schema_mismatch"),
            ("prompt_hash", "prompt_mismatch"), ("env_state_hash", "env_state_mismatch"))
REF = tuple(f for f, _ in MISMATCH)


def _oldest_version(row: dict) -> int:
    sampled = [v for v in (row.get("token_policy_versions") or []) if v is not None and v >= 0]
    return min(sampled) if sampled else row["policy_version"]


def _capped_reward(row: dict, cfg: AdmissionConfig):
    if row["reward"] is None:
        return None
    comps = dict(row.get("reward_components") or [])
    r = row["reward"]
    for name, cap in cfg.component_caps.items():
        r = r - max(0.0, (comps.get(name) or 0.0) - cap)
    return r


def _key(row: dict, f: str):
    v = row.get(f)
    return "" if v is None and f in ("tool_schema_version", "prompt_hash", "env_state_hash") else v  # unrecorded == unrecorded


def _ref_config(rows: list[dict]) -> tuple | None:
    counts = Counter(tuple(_key(r, f) for f in REF) for r in rows)
    if not counts:
        return None
    # most common; ties -> higher policy_version, then the lexicographically smaller tuple
    return sorted(counts.items(), key=lambda kv: (-kv[1], -kv[0][0], kv[0][1:]))[0][0]


def reference_members_groups(rows: list[dict], cfg: AdmissionConfig, *, current_policy_version: int,
                             now: datetime, decided: Set[str] = frozenset(),
                             quality: dict[str, str] | None = None) -> tuple[list[dict], list[dict]]:
    quality = quality or {}
    by_group: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["group_id"] not in decided:
            by_group[r["group_id"]].append(r)
    members_out: list[dict] = []
    groups_out: list[dict] = []
    for gid in sorted(by_group):
        grp = sorted(by_group[gid], key=lambda r: r["trajectory_id"])
        group_size = max(r["group_size"] for r in grp)
        oldest_finish = min(r["finished_at"] for r in grp)
        if not (len(grp) >= group_size or oldest_finish <= now - timedelta(seconds=cfg.group_timeout_s)):
            continue
        reason: dict[str, str | None] = {}
        for r in grp:  # 1. member exclusions
            tid = r["trajectory_id"]
            if tid in quality:
                reason[tid] = quality[tid]
            elif r["status"] == "INFRA_FAILED":
                reason[tid] = "infra_failed"
            elif r["status"] == "EXPIRED":
                reason[tid] = "expired"
            elif r["verdict"] in ("UNKNOWN", "ENV_ERROR") or r["reward"] is None:
                reason[tid] = "no_reward"
            elif cfg.vocab_size is not None and r.get("max_token_id") is not None \
                    and r["max_token_id"] >= cfg.vocab_size:
                reason[tid] = "out_of_vocabulary"
            else:
                reason[tid] = None
        ref = _ref_config([r for r in grp if reason[r["trajectory_id"]] is None])  # 2.
        lag = {r["trajectory_id"]: current_policy_version - _oldest_version(r) for r in grp}
        for r in grp:
            tid = r["trajectory_id"]
            if reason[tid] is not None:
                continue
            assert ref is not None  # this member has no reason, so the group has a reference configuration
            for (f, why), ref_value in zip(MISMATCH, ref):
                if _key(r, f) != ref_value:
                    reason[tid] = why
                    break
            else:  # 3. freshness
                if lag[tid] > cfg.max_policy_lag:
                    reason[tid] = "stale_policy"
                elif cfg.max_queue_wait_ms is not None and r["queue_wait_ms"] > cfg.max_queue_wait_ms:
                    reason[tid] = "stale_wait"
        valid = [r for r in grp if reason[r["trajectory_id"]] is None]
        rewards = [_capped_reward(r, cfg) for r in valid]
        comps = [dict(r.get("reward_components") or []) for r in valid]
        for r in grp:
            row = {"trajectory_id": r["trajectory_id"], "group_id": gid, "group_size": r["group_size"],
                   "content_hash": r["content_hash"], "reward": _capped_reward(r, cfg),
                   "queue_wait_ms": r["queue_wait_ms"],
                   "response_len": len(r["loss_mask"]), "num_tool_calls": r["num_tool_calls"],
                   "difficulty": r["difficulty"], "run_id": r["run_id"], "task_id": r["task_id"],
                   "policy_lag": lag[r["trajectory_id"]], "reason": reason[r["trajectory_id"]]}
            row.update({f"ref_{f}": (ref[i] if ref else None) for i, f in enumerate(REF)})
            row.update({f"comp_{c}": dict(r.get("reward_components") or []).get(c) for c in cfg.components})
            members_out.append(row)
        gates = {}
        for i, gt in enumerate(cfg.gates):  # reward-decomposition gates over valid members
            vals = [v for c in comps if (v := c.get(gt.component)) is not None]
            gates[f"gate_{i}"] = (None if not vals else
                                  min(vals) if gt.agg == "min" else max(vals) if gt.agg == "max" else fmean(vals))
        difficulties = [r["difficulty"] for r in grp if r["difficulty"] is not None]
        groups_out.append({
            "group_id": gid, "run_id": grp[0]["run_id"], "task_id": grp[0]["task_id"],
            "difficulty": min(difficulties) if difficulties else None,
            **{f"ref_{f}": (ref[i] if ref else None) for i, f in enumerate(REF)},
            "group_size": group_size, "arrived_members": len(grp),
            "max_response_len": max(len(r["loss_mask"]) for r in grp),
            "max_tool_calls": max(r["num_tool_calls"] for r in grp),
            "n_valid": len(valid),
            "min_valid_ok": len(valid) >= cfg.min_valid_members,
            # 4. exact spread first, then the std threshold
            "spread_ok": bool(rewards) and max(rewards) > min(rewards) and pstdev(rewards) >= cfg.min_reward_std,
            "policy_lag": max((lag[r["trajectory_id"]] for r in valid), default=None),
            "max_queue_wait_ms": max((r["queue_wait_ms"] for r in valid), default=None),
            **gates,
        })
    return members_out, groups_out


def to_tables(members: list[dict], groups: list[dict], cfg: AdmissionConfig) -> tuple[pa.Table, pa.Table]:
    from pipeline.admission.decide import group_schema, member_schema

    ms, gs = member_schema(cfg), group_schema(cfg)
    return (pa.Table.from_pylist(members, schema=ms) if members else ms.empty_table(),
            pa.Table.from_pylist(groups, schema=gs) if groups else gs.empty_table())
