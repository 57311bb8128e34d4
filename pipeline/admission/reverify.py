"""Rewards that can be doubted: re-verify before a snapshot is published.

GRPO spreads one wrong reward over the whole group, and the members with the
largest |advantage| move the policy most. With ``reverify_top = k`` admission
re-verifies, in every admitted group, the k valid members of largest
|advantage| (ties: smaller trajectory_id); with ``shadow_sample = p`` it also
re-verifies every member of a deterministic sample of the admitted groups (a
group is in it when the first 8 bytes of sha256(group_id), as an unsigned
integer over 2^64, fall below p: the same group is sampled by every run and
engine). The re-verifier is ``reverifier`` ("module:callable"): called once
per admission run with the selected trajectories rows (every trajectories
column, token lists included), it returns one verdict per row (PASS, FAIL or
UNKNOWN): the same verifier run again, or a second one.

A re-verdict that differs from the recorded verdict (UNKNOWN included: the
re-verifier could not confirm it) is a disagreement. A group with one is held
as UNKNOWN: decided ``verdict_disagreement``, never trained on, its receipt's
``checks`` map reading ``reverify: fail:<trajectory_id> <recorded> -> <re-verdict>,...``;
the other groups are decided again without it (so batch-level advantages do
not count it), and each re-verified group that agreed reads
``reverify: pass:<n> re-verified``; either ends in `` (shadow sample)`` for a
group of the shadow sample. Receipts of runs without re-verification have no
``reverify`` entry (the report reads these: sample rate, disagreement rate). docs/admission-rules.md "Re-verification".
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.admission.checks import FAIL, Decision
from pipeline.admission.config import AdmissionConfig
from pipeline.errors import ConfigError, PipelineError

Reverifier = Callable[[pa.Table], Sequence[str]]
DECISION: Decision = "verdict_disagreement"
VERDICTS = ("PASS", "FAIL", "UNKNOWN")


@dataclass(kw_only=True)
class ReverifyStats:
    groups: int = 0            # admitted groups re-verified (any member)
    shadow_groups: int = 0     # of which in the shadow sample
    members: int = 0           # trajectories re-verified
    disagreements: int = 0     # of which the verdict differed
    held: list[str] = field(default_factory=list)   # groups held as verdict_disagreement
    shadow: set[str] = field(default_factory=set)   # the shadow-sampled groups re-verified

    def as_dict(self) -> dict[str, Any]:
        return {"groups": self.groups, "shadow_groups": self.shadow_groups, "members": self.members,
                "disagreements": self.disagreements, "held_groups": len(self.held),
                "disagreement_rate": self.disagreements / self.members if self.members else None}


def load_reverifier(spec: str) -> Reverifier:
    """``module:callable`` -> the callable (a one-line error when it cannot be loaded)."""
    mod, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"reverifier {spec!r} cannot be loaded: {exc}",
                          hint="give module:callable, importable where admission runs") from None
    if not callable(fn):
        raise ConfigError(f"reverifier {spec!r} is not callable")
    return fn


def in_shadow_sample(group_ids: Sequence[str], rate: float) -> np.ndarray:
    """Whether each group is in the shadow sample of ``rate`` (sha256 of the id: deterministic)."""
    if rate <= 0:
        return np.zeros(len(group_ids), bool)
    u = [int.from_bytes(hashlib.sha256(g.encode()).digest()[:8], "big") / 2.0 ** 64 for g in group_ids]
    return np.asarray(u) < rate


def select(admitted: pa.Table, cfg: AdmissionConfig) -> tuple[list[str], set[str]]:
    """(trajectory ids to re-verify, the shadow-sampled group ids) among the admitted members."""
    gid = admitted.column("group_id").to_pylist()
    tid = admitted.column("trajectory_id").to_pylist()
    adv = np.abs(admitted.column("advantage").to_numpy())
    groups = sorted(set(gid))
    shadow = {g for g, s in zip(groups, in_shadow_sample(groups, cfg.shadow_sample)) if s}
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(gid):
        by_group.setdefault(g, []).append(i)
    pick: list[str] = []
    for g, rows in by_group.items():
        ranked = sorted(rows, key=lambda i: (-adv[i], tid[i]))
        pick.extend(tid[i] for i in (ranked if g in shadow else ranked[:cfg.reverify_top]))
    return sorted(pick), shadow


def _rows(sources: list[tuple[Any, Any]], ids: list[str]) -> pa.Table:
    """The trajectories rows of ``ids`` (every column) from the datasets admission read."""
    want = pa.array(ids, pa.string())
    parts = []
    for dataset, flt in sources:
        f = pc.is_in(pc.field("trajectory_id"), value_set=want)
        parts.append(dataset.to_table(filter=f if flt is None else (flt & f)))
    t = pa.concat_tables(parts, promote_options="default") if parts else pa.table({})
    if t.num_rows != len(ids) or set(t.column("trajectory_id").to_pylist()) != set(ids):
        raise PipelineError(f"re-verification found {t.num_rows} of {len(ids)} selected trajectories",
                            hint="rerun pipeline admit")
    return t.sort_by([("trajectory_id", "ascending")])


def reverify(sources: list[tuple[Any, Any]], admitted: pa.Table, cfg: AdmissionConfig
             ) -> tuple[dict[str, str], dict[str, int], ReverifyStats]:
    """(held group -> reverify detail, agreeing re-verified group -> members re-verified, stats)."""
    stats = ReverifyStats()
    ids, shadow = select(admitted, cfg)
    if not ids:
        return {}, {}, stats
    rows = _rows(sources, ids)
    got = list(load_reverifier(cfg.reverifier)(rows))
    if len(got) != rows.num_rows or any(v not in VERDICTS for v in got):
        raise PipelineError(f"reverifier {cfg.reverifier} returned {len(got)} verdicts for {rows.num_rows} rows "
                            f"(each must be one of {', '.join(VERDICTS)})", hint="fix the re-verifier")
    recorded = rows.column("verdict").to_pylist()
    group = dict(zip(admitted.column("trajectory_id").to_pylist(), admitted.column("group_id").to_pylist()))
    fails: dict[str, list[str]] = {}
    checked: dict[str, int] = {}
    for t, old, new in zip(rows.column("trajectory_id").to_pylist(), recorded, got):
        g = group[t]
        checked[g] = checked.get(g, 0) + 1
        if new != old:
            fails.setdefault(g, []).append(f"{t} {old} -> {new}")
    stats.groups, stats.members = len(checked), len(ids)
    stats.shadow = shadow & set(checked)
    stats.shadow_groups = len(stats.shadow)
    stats.disagreements = sum(len(v) for v in fails.values())
    stats.held = sorted(fails)
    held = {g: FAIL + ",".join(v) for g, v in sorted(fails.items())}
    return held, {g: n for g, n in checked.items() if g not in held}, stats


def with_checks(receipts: pa.Table, outcomes: dict[str, str], decision: dict[str, str] | None = None) -> pa.Table:
    """``receipts`` with ``reverify`` added to the checks of the groups in ``outcomes`` (and their
    decision replaced where ``decision`` names them)."""
    if not outcomes:
        return receipts
    rows = receipts.to_pylist()
    for r in rows:
        g = r["group_id"]
        if g in outcomes:
            r["checks"] = list(r["checks"]) + [("reverify", outcomes[g])]
            if decision and g in decision:
                r["decision"] = decision[g]
    return pa.Table.from_pylist(rows, schema=receipts.schema)


def apply(dec, members: pa.Table, groups: pa.Table, sources: list[tuple[Any, Any]], cfg: AdmissionConfig, *,
          config_hash: str, current_policy_version: int, previous_baseline: float | None):
    """``dec`` (decide.Decisions) after re-verification: held groups decided ``verdict_disagreement``,
    the rest decided again without them (until every admitted group was re-verified: dropping a group
    can change which configuration or which capped group the snapshot admits). -> (Decisions, stats)."""
    import dataclasses

    from pipeline.admission.decide import finalize

    held: dict[str, str] = {}
    agreed: dict[str, int] = {}
    stats = ReverifyStats()
    cur = dec
    while True:
        done = pa.array(sorted(set(held) | set(agreed)), pa.string())
        todo = cur.admitted.filter(pc.invert(pc.is_in(cur.admitted.column("group_id"), value_set=done)))
        if todo.num_rows == 0:
            break
        h, a, st = reverify(sources, todo, cfg)
        agreed.update(a)
        stats.groups += st.groups
        stats.shadow_groups += st.shadow_groups
        stats.shadow |= st.shadow
        stats.members += st.members
        stats.disagreements += st.disagreements
        if not h:
            break
        held.update(h)
        out = pa.array(sorted(held), pa.string())
        cur = finalize(members.filter(pc.invert(pc.is_in(members.column("group_id"), value_set=out))),
                       groups.filter(pc.invert(pc.is_in(groups.column("group_id"), value_set=out))), cfg,
                       config_hash=config_hash, current_policy_version=current_policy_version,
                       previous_baseline=previous_baseline)
    stats.held = sorted(held)
    tag = {g: " (shadow sample)" if g in stats.shadow else "" for g in set(held) | set(agreed)}
    held = {g: v + tag[g] for g, v in held.items()}
    receipts = with_checks(cur.receipts, {g: f"pass:{n} re-verified{tag[g]}" for g, n in agreed.items()})
    counts = dict(cur.counts)
    if held:
        out = pa.array(sorted(held), pa.string())
        hr = with_checks(dec.receipts.filter(pc.is_in(dec.receipts.column("group_id"), value_set=out)), held,
                         {g: DECISION for g in held})
        receipts = pa.concat_tables([receipts, hr]).sort_by([("group_id", "ascending")])
        counts[DECISION] = len(held)
    return dataclasses.replace(cur, receipts=receipts, counts=counts), stats
