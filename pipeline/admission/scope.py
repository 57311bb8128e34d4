"""Admission scope: which decided groups a run may put into its snapshot.

Applied to every engine's members/groups tables before ``decide.finalize``, so
the DuckDB, Dask and reference engines need not know about it.

- ``run_id`` / ``env`` / ``task``: only groups of that run, environment
  (``env_version`` ``<env>/<rev>`` or exactly ``<env>``) or task are decided;
  the others stay undecided for a later, differently scoped run.
- One tokenizer per snapshot: members whose group was sampled with another
  tokenizer than the snapshot's are excluded with reason ``tokenizer_scope``
  (their group then fails ``min_valid_members`` and its receipt says why). The
  snapshot's tokenizer is the current policy's when some group has it, else the
  most common one (ties: the smallest rev).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TOKENIZER_SCOPE = "tokenizer_scope"


@dataclass(frozen=True)
class Scope:
    run_id: str | None = None
    env: str | None = None
    task: str | None = None

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in (("run_id", self.run_id), ("env", self.env), ("task", self.task)) if v}


def _keep_groups(members: pa.Table, groups: pa.Table, keep: np.ndarray) -> tuple[pa.Table, pa.Table]:
    groups = groups.filter(pa.array(keep))
    members = members.filter(pc.is_in(members.column("group_id"), value_set=groups.column("group_id").combine_chunks()))
    return members, groups


def apply(members: pa.Table, groups: pa.Table, scope: Scope | None, policy_tokenizer: str | None
          ) -> tuple[pa.Table, pa.Table, str | None]:
    """(members, groups, the snapshot's tokenizer_rev) after scoping."""
    if scope is not None and (scope.run_id or scope.env or scope.task) and groups.num_rows:
        keep = np.ones(groups.num_rows, bool)
        if scope.run_id:
            keep &= np.asarray(groups.column("run_id").to_pylist(), dtype=object) == scope.run_id
        if scope.task:
            keep &= np.asarray(groups.column("task_id").to_pylist(), dtype=object) == scope.task
        if scope.env:
            envs = groups.column("ref_env_version").to_pylist()
            keep &= np.array([e is not None and (e == scope.env or e.startswith(scope.env + "/")) for e in envs], bool)
        members, groups = _keep_groups(members, groups, keep)
    revs = groups.column("ref_tokenizer_rev").to_pylist() if groups.num_rows else []
    counts = Counter(r for r in revs if r is not None)
    if not counts:
        return members, groups, None
    target = policy_tokenizer if policy_tokenizer in counts else sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    if len(counts) == 1:
        return members, groups, target
    other = np.array([r is not None and r != target for r in revs], bool)                         # [G]
    foreign = set(np.asarray(groups.column("group_id").to_pylist(), dtype=object)[other].tolist())
    gids = members.column("group_id").to_pylist()
    reasons = members.column("reason").to_pylist()
    reasons = [TOKENIZER_SCOPE if g in foreign and r is None else r for g, r in zip(gids, reasons)]
    members = members.set_column(members.schema.get_field_index("reason"), members.schema.field("reason"),
                                 pa.array(reasons, members.schema.field("reason").type))
    o = pa.array(other)

    def blank(name: str, value) -> None:
        nonlocal groups
        i = groups.schema.get_field_index(name)
        col = groups.column(name)
        groups = groups.set_column(i, groups.schema.field(name),
                                   pc.if_else(o, pa.scalar(value, col.type), col))
    blank("n_valid", 0)
    blank("min_valid_ok", False)
    blank("spread_ok", False)
    for name in groups.column_names:
        if name in ("policy_lag", "max_queue_wait_ms") or name.startswith("gate_"):
            blank(name, None)
    return members, groups, target
