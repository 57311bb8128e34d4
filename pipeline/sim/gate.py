"""The in-simulator admission gate: docs/admission-rules.md, per group.

Pure and small on purpose: it decides one group from its members' policy
versions, terminal statuses, rewards and queue waits, in the order docs/admission-rules.md
gives (failures, comparability, freshness, group checks). The simulated
trajectories differ only in policy_version (tokenizer, template, env, verifier
and temperature are constant in a simulation), so comparability reduces to the
policy-version reference unless ``configs`` gives each member the rest of the
comparability key (CONFIG_FIELDS order). ``batch_config`` is the per-snapshot
rule over the groups of one decision round. ``--land`` replaces this gate with
the real admission job over Delta tables (lake_mode.py).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, Sequence

# terminal statuses of simulated trajectories (the trajectories.status enum)
ACCEPTED, INFRA_FAILED, EXPIRED = "ACCEPTED", "INFRA_FAILED", "EXPIRED"

VALID = ""  # member reason for a member that passed every member check

# the comparability key after policy_version, with each field's mismatch reason (docs/admission-rules.md)
CONFIG_FIELDS = (("tokenizer_rev", "tokenizer_mismatch"), ("prompt_template_rev", "template_mismatch"),
                 ("env_version", "env_mismatch"), ("verifier_version", "verifier_mismatch"),
                 ("temperature", "temperature_mismatch"), ("top_p", "top_p_mismatch"),
                 ("task_version", "task_version_mismatch"), ("harness_version", "harness_mismatch"),
                 ("tool_schema_version", "tool_schema_mismatch"), ("prompt_hash", "prompt_mismatch"))
BATCH_FIELDS = ("tokenizer_rev", "prompt_template_rev", "env_version", "verifier_version")


@dataclass(frozen=True)
class GateRules:
    max_policy_lag: int = 1
    max_queue_wait_ms: int | None = None
    min_valid_members: int = 2
    min_reward_std: float = 1e-6


@dataclass(frozen=True)
class Decision:
    decision: str               # admit, zero_variance, insufficient_valid, ...
    reasons: tuple[str, ...]    # per member: VALID or the exclusion reason


class Gate(Protocol):
    """Decides the groups that are complete at simulated time ``now``.

    ``members[k]`` lists the trajectory indices of ``groups[k]``; the engine's
    records (``sim.version``, ``sim.status``, ``sim.reward``, ``sim.end``) hold
    their data. Returns one Decision per group, in order."""

    def decide(self, sim, groups: Sequence[int], members: Sequence[Sequence[int]], now: float,
               current_version: int) -> list[Decision]: ...


def decide_group(versions: Sequence[int], statuses: Sequence[str], rewards: Sequence[float | None],
                 waits_ms: Sequence[float], current_version: int, rules: GateRules,
                 configs: Sequence[tuple] | None = None) -> Decision:
    """One group, docs/admission-rules.md steps 1-5. ``rewards`` use None for "no valid evaluation";
    ``configs[i]``, when given, is member i's CONFIG_FIELDS tuple."""
    n = len(versions)
    reasons = [VALID] * n
    # 1. failures never count as policy failures and never enter a baseline
    for i in range(n):
        if statuses[i] == INFRA_FAILED:
            reasons[i] = "infra_failed"
        elif statuses[i] == EXPIRED:
            reasons[i] = "expired"
        elif (r := rewards[i]) is None or (isinstance(r, float) and math.isnan(r)):
            reasons[i] = "no_reward"
    # 2. reference configuration: the most common key, ties to the higher policy_version,
    #    then the lexicographically smaller rest of the key
    keys = [(versions[i], *(tuple(configs[i]) if configs is not None else ())) for i in range(n)]
    counts = Counter(keys[i] for i in range(n) if reasons[i] == VALID)
    if counts:
        ref = sorted(counts.items(), key=lambda kv: (-kv[1], -kv[0][0], kv[0][1:]))[0][0]
        why = ("policy_mismatch",) + tuple(r for _, r in CONFIG_FIELDS)
        for i in range(n):
            if reasons[i] == VALID and keys[i] != ref:
                reasons[i] = why[next(k for k in range(len(ref)) if keys[i][k] != ref[k])]
    # 3. freshness
    for i in range(n):
        if reasons[i] != VALID:
            continue
        if current_version - versions[i] > rules.max_policy_lag:
            reasons[i] = "stale_policy"
        elif rules.max_queue_wait_ms is not None and waits_ms[i] > rules.max_queue_wait_ms:
            reasons[i] = "stale_wait"
    # 4. group checks over the valid members
    valid = [float(rewards[i]) for i in range(n) if reasons[i] == VALID]  # type: ignore[arg-type]
    if len(valid) < rules.min_valid_members:
        return Decision("insufficient_valid", tuple(reasons))
    # exact spread test first: variance functions return 1e-9..1e-8 for equal rewards (docs/dependency-notes.md)
    if not max(valid) > min(valid):
        return Decision("zero_variance", tuple(reasons))
    mean = sum(valid) / len(valid)
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / len(valid))
    if std < rules.min_reward_std:
        return Decision("zero_variance", tuple(reasons))
    return Decision("admit", tuple(reasons))


def batch_config(decisions: Sequence[Decision], group_configs: Sequence[dict], *,
                 mix_fields: Sequence[str] = ()) -> list[Decision]:
    """Per snapshot (docs/admission-rules.md): among the admitted groups, the
    most common BATCH_FIELDS tuple (fields in ``mix_fields`` left out; ties to
    the lexicographically smaller) is the snapshot's configuration; an admitted
    group with another becomes ``batch_config_mismatch``."""
    fields = [f for f in BATCH_FIELDS if f not in mix_fields]
    keys = [tuple(c[f] for f in fields) for c in group_configs]
    counts = Counter(k for k, d in zip(keys, decisions) if d.decision == "admit")
    if not fields or not counts:
        return list(decisions)
    ref = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    return [Decision("batch_config_mismatch", d.reasons) if d.decision == "admit" and k != ref else d
            for d, k in zip(decisions, keys)]


class FreshnessGate:
    """The simulator's own gate (pure mode)."""

    def __init__(self, rules: GateRules) -> None:
        self.rules = rules

    def decide(self, sim, groups, members, now, current_version):
        out = []
        for idx in members:
            out.append(decide_group(
                [sim.version[i] for i in idx],
                [sim.status[i] for i in idx],
                [sim.reward[i] for i in idx],
                [(now - sim.end[i]) * 1000.0 for i in idx],
                current_version, self.rules))
        return out
