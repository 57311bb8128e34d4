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

A per-event copy in plain Python for speed, but not a copy of the rules: the
reasons, their order, the tie-breaks and the tests are pipeline/admission/rules.py's
functions and the decisions come from the declared checks (checks.first_blocking);
tests/sim/test_sim_gate.py checks it decides like the real engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from pipeline.admission import rules as R
from pipeline.admission.checks import first_blocking

# terminal statuses of simulated trajectories (the trajectories.status enum)
ACCEPTED, INFRA_FAILED, EXPIRED = "ACCEPTED", R.INFRA_FAILED, R.EXPIRED

VALID = ""  # member reason for a member that passed every member check

# the comparability key after policy_version, with each field's mismatch reason (docs/admission-rules.md)
CONFIG_FIELDS = R.COMPARABILITY[1:]
BATCH_FIELDS = R.BATCH_FIELDS


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
    """One group, docs/admission-rules.md steps 1-5, with the rules of
    pipeline/admission/rules.py. ``rewards`` use None for "no valid evaluation";
    ``configs[i]``, when given, is member i's CONFIG_FIELDS tuple."""
    n = len(versions)
    # 1. failures never count as policy failures and never enter a baseline (no verdicts simulated)
    reasons = [R.member_exclusion(statuses[i], None, rewards[i]) or VALID for i in range(n)]
    # 2. reference configuration (a key is policy_version, then the CONFIG_FIELDS values)
    keys = [(versions[i], *(tuple(configs[i]) if configs is not None else ())) for i in range(n)]
    ref = R.reference_config(keys[i] for i in range(n) if reasons[i] == VALID)
    for i in range(n):
        if reasons[i] == VALID and ref is not None:   # ref is None only when no member is valid
            # 2. comparability, then 3. freshness
            reasons[i] = (R.first_mismatch(keys[i], ref)
                          or R.freshness(current_version - versions[i], waits_ms[i], max_policy_lag=rules.max_policy_lag,
                                         max_queue_wait_ms=rules.max_queue_wait_ms)
                          or VALID)
    # 4. group checks over the valid members, decided in the checks' declared order
    valid = [float(rewards[i]) for i in range(n) if reasons[i] == VALID]  # type: ignore[arg-type]
    failed = set()
    if len(valid) < rules.min_valid_members:
        failed.add("min_valid_members")
    if not R.has_spread(valid, rules.min_reward_std):
        failed.add("reward_spread")
    return Decision(first_blocking(failed), tuple(reasons))


def batch_config(decisions: Sequence[Decision], group_configs: Sequence[dict], *,
                 mix_fields: Sequence[str] = ()) -> list[Decision]:
    """Per snapshot (docs/admission-rules.md): among the admitted groups, the
    most common BATCH_FIELDS tuple (fields in ``mix_fields`` left out; ties to
    the lexicographically smaller) is the snapshot's configuration; an admitted
    group with another becomes ``batch_config_mismatch``."""
    fields = [f for f in BATCH_FIELDS if f not in mix_fields]
    keys = [tuple(c[f] for f in fields) for c in group_configs]
    ref = R.snapshot_config(k for k, d in zip(keys, decisions) if d.decision == "admit")
    if not fields or ref is None:
        return list(decisions)
    mismatch = first_blocking({"batch_config"})
    return [Decision(mismatch, d.reasons) if d.decision == "admit" and k != ref else d
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
