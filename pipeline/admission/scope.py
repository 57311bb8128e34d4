"""Admission scope: which decided groups a run may put into its snapshot.

Applied to every engine's members/groups tables before ``decide.finalize``, so
the DuckDB, Dask and reference engines need not know about it.

- ``run_id`` / ``env`` / ``task``: only groups of that run, environment
  (``env_version`` ``<env>/<rev>`` or exactly ``<env>``) or task are decided;
  the others stay undecided for a later, differently scoped run.
- One tokenizer per snapshot: the current policy's ``tokenizer_rev`` (when it is
  not recorded, the most common one among the groups; ties: the smallest rev).
  Groups sampled with another tokenizer are *deferred*: left undecided, whatever
  their age, until a policy of their tokenizer is current (token ids of two
  tokenizers mean different text: no policy can train on both). Deciding them
  now would close them for good although nothing is wrong with them; the run
  then records no incremental-scan state, so the next run scans them again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


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
          ) -> tuple[pa.Table, pa.Table, str | None, dict[str, int]]:
    """(members, groups, the snapshot's tokenizer_rev, deferred groups per tokenizer_rev) after scoping."""
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
        return members, groups, None, {}
    target = policy_tokenizer or sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
    deferred = {rev: n for rev, n in sorted(counts.items()) if rev != target}
    if not deferred:
        return members, groups, target, {}
    # a group without a reference (no valid member) has no tokenizer to wait for: it is decided now
    members, groups = _keep_groups(members, groups, np.array([r is None or r == target for r in revs], bool))
    return members, groups, target, deferred
