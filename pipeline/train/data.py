"""Snapshot -> training members, the pre-training assertions, and collation.

``load_members`` reads exactly the snapshot's own files through
``pipeline.snapshots.open`` (which verifies them first); ``check_members`` refuses, naming the trajectory, any
member that could leak a non-policy token into the loss or silently train on
the wrong thing; ``collate`` builds one micro-batch's tensors.

Micro-batch layout (B rows, L = longest prompt+response, R = longest response):
    input_ids  [B, L]   prompt then response, right-padded (causal attention
                        means real tokens never see the padding)
    rows       [M]      flat index b*L + P_b - 1 + j of the hidden state that
                        predicts response token j, for loss tokens only
    cols       [M]      flat index b*R + j into the [B, R] loss tensors
    targets    [M]      response_ids[b][j]
    mask       [B, R]   1.0 on policy-sampled response tokens only
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa

from pipeline.errors import PipelineError
from pipeline.snapshots import MEMBER_COLUMNS as COLUMNS  # one list of member columns
from pipeline.snapshots import TURN_COLUMNS, turn_token_advantages

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


class TrainDataError(PipelineError):
    """A snapshot member cannot be trained on safely (names the trajectory)."""


@dataclass(kw_only=True)
class Members:
    """Columnar members of a snapshot, in snapshot order (group_id, trajectory_id)."""

    trajectory_id: list[str]
    group_id: list[str]
    group_size: np.ndarray                       # [N] int
    advantage: np.ndarray                        # [N] float64
    reward: np.ndarray                           # [N] float64
    policy_lag: np.ndarray                       # [N] int64
    prompt: list[np.ndarray]                     # N x [P_i] int64
    response: list[np.ndarray]                   # N x [R_i] int64
    rollout_logprobs: list[np.ndarray]           # N x [R_i] float32
    loss_mask: list[np.ndarray]                  # N x [R_i] int8
    token_versions: list[np.ndarray | None]      # N x [R_i] int32 or None
    # filled by the pre-pass: per member, [R_i] float32 (0 off the mask)
    old_logprobs: list[np.ndarray | None] = field(default_factory=list)
    ref_logprobs: list[np.ndarray | None] = field(default_factory=list)
    current_logprobs: list[np.ndarray | None] = field(default_factory=list)  # the starting weights' (= old in recompute)
    policy_version: np.ndarray | None = None     # [N] int64: the version that started each member
    # per-turn credit (snapshots of advantage grpo_turn): per member, [K_i] float64 or None (advantage applies)
    turn_advantages: list[np.ndarray | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.trajectory_id)

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Input length of each member: prompt + response (computed once; read every step)."""
        return np.array([len(p) + len(r) for p, r in zip(self.prompt, self.response)], dtype=np.int64)

    def loss_tokens(self, idx: list[int] | tuple[int, ...]) -> int:
        return int(sum(int(self.loss_mask[i].sum()) for i in idx))


def _lists(col: pa.ChunkedArray, dtype) -> list[np.ndarray | None]:
    out: list[np.ndarray | None] = []
    for chunk in col.chunks:
        if chunk.null_count == len(chunk):
            out.extend([None] * len(chunk))
            continue
        offsets = chunk.offsets.to_numpy()
        values = chunk.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        valid = chunk.is_valid().to_numpy(zero_copy_only=False)
        for i in range(len(chunk)):
            out.append(values[offsets[i]:offsets[i + 1]].copy() if valid[i] else None)
    return out


def members_from_table(table: pa.Table) -> Members:
    """Columnar members from a snapshot payload table (schemas/snapshot_payload.yaml)."""
    t = table.select(COLUMNS + [c for c in TURN_COLUMNS if c in table.column_names])
    return Members(
        trajectory_id=t.column("trajectory_id").to_pylist(),
        group_id=t.column("group_id").to_pylist(),
        group_size=t.column("group_size").to_numpy(),
        advantage=t.column("advantage").to_numpy().astype(np.float64),
        reward=t.column("reward").to_numpy().astype(np.float64),
        policy_lag=t.column("policy_lag").to_numpy().astype(np.int64),
        prompt=_lists(t.column("prompt_ids"), np.int64),               # type: ignore[arg-type]
        response=_lists(t.column("response_ids"), np.int64),           # type: ignore[arg-type]
        rollout_logprobs=_lists(t.column("response_logprobs"), np.float32),  # type: ignore[arg-type]
        loss_mask=_lists(t.column("loss_mask"), np.int8),              # type: ignore[arg-type]
        token_versions=_lists(t.column("token_policy_versions"), np.int32),
        policy_version=t.column("policy_version").to_numpy().astype(np.int64),
        turn_advantages=_lists(t.column("turn_advantages"), np.float64) if "turn_advantages" in t.column_names
        else [],
    )


def load_members(lake: Lake, snapshot_id: str) -> tuple[Members, dict[str, Any]]:
    """Verify the snapshot (files against the manifest, the manifest against the
    snapshots table, the id against the members) and read its members, through
    the same reader any external trainer uses (``pipeline.snapshots.open``).
    Returns (members, verification summary)."""
    import pipeline.snapshots

    snap = pipeline.snapshots.open(lake, snapshot_id)
    return members_from_table(snap.table(snap.columns)), snap.verification  # type: ignore[return-value]


def _fail(m: Members, i: int, what: str, hint: str | None = None) -> TrainDataError:
    return TrainDataError(f"trajectory {m.trajectory_id[i]} (group {m.group_id[i]}): {what}",
                          hint=hint or "fix the producer of this trajectory or exclude it at admission")


def check_members(m: Members, *, vocab_size: int, max_positions: int | None = None,
                  valid_counts: dict[str, int] | None = None) -> None:
    """The pre-training assertions. Raises TrainDataError naming the first bad
    trajectory. ``valid_counts`` (group -> valid members per the admission
    receipt) checks that every group's reward count matches its valid members."""
    if len(m) == 0:
        raise TrainDataError("the snapshot has no members", hint="admit at least one group before training")
    for i in range(len(m)):
        p, r, lp, mask, tv = m.prompt[i], m.response[i], m.rollout_logprobs[i], m.loss_mask[i], m.token_versions[i]
        if p is None or len(p) == 0:
            raise _fail(m, i, "empty prompt")
        if r is None or len(r) == 0:
            raise _fail(m, i, "no response tokens")
        if lp is None or len(lp) != len(r):
            raise _fail(m, i, f"{0 if lp is None else len(lp)} rollout log-probs for {len(r)} response tokens "
                              "(old log-probs must match the response shape)")
        if mask is None or len(mask) != len(r):
            raise _fail(m, i, f"loss_mask has {0 if mask is None else len(mask)} entries for {len(r)} response tokens")
        if not np.isin(mask, (0, 1)).all():
            raise _fail(m, i, "loss_mask holds values other than 0/1")
        if mask.sum() == 0:
            raise _fail(m, i, "no policy-sampled token (loss_mask is all 0): nothing to learn from")
        if tv is not None:
            if len(tv) != len(r):
                raise _fail(m, i, f"token_policy_versions has {len(tv)} entries for {len(r)} response tokens")
            obs = tv < 0
            if (mask[obs] != 0).any():
                j = int(np.flatnonzero(obs & (mask != 0))[0])
                raise _fail(m, i, f"loss_mask is 1 on observation token {j} (token_policy_versions = -1): "
                                  "tool output would enter the loss")
        if (lp[mask == 0] != 0).any():
            j = int(np.flatnonzero((mask == 0) & (lp != 0))[0])
            raise _fail(m, i, f"rollout log-prob {lp[j]} at masked-out token {j} (the contract says 0 there)")
        sel = lp[mask == 1]
        if not np.isfinite(sel).all() or (sel > 1e-4).any():
            raise _fail(m, i, "rollout log-probs on policy tokens must be finite and <= 0")
        if not np.isfinite(m.advantage[i]):
            raise _fail(m, i, f"advantage {m.advantage[i]} is not finite")
        ta = m.turn_advantages[i] if m.turn_advantages else None
        if ta is not None:
            from pipeline.snapshots import policy_turns

            turns = int(policy_turns(mask).max()) + 1 if mask.size else 0
            if ta.size != turns or not np.isfinite(ta).all():
                raise _fail(m, i, f"turn_advantages {ta.tolist()} must be finite, one per policy turn ({turns})")
        lo = min(int(p.min()), int(r.min()))
        hi = max(int(p.max()), int(r.max()))
        if lo < 0 or hi >= vocab_size:
            raise _fail(m, i, f"token id {hi if hi >= vocab_size else lo} outside the model's vocabulary [0, {vocab_size})",
                        hint="the snapshot was produced with another tokenizer than the policy's")
        if max_positions is not None and len(p) + len(r) > max_positions:
            raise _fail(m, i, f"{len(p) + len(r)} tokens exceed the model's {max_positions} positions")
    if valid_counts is not None:
        counts: dict[str, int] = {}
        for g in m.group_id:
            counts[g] = counts.get(g, 0) + 1
        for g, n in counts.items():
            if g in valid_counts and valid_counts[g] != n:
                i = m.group_id.index(g)
                raise _fail(m, i, f"group has {n} members with rewards in the snapshot but its receipt lists "
                                  f"{valid_counts[g]} valid members", hint="the snapshot and its receipts disagree; "
                                                                          "re-run admission")


def receipt_counts(lake: Lake, snapshot_id: str) -> dict[str, int] | None:
    """group -> number of valid members from the admission receipts of this snapshot (None without receipts)."""
    if not lake.exists("receipts"):
        return None

    import pyarrow.dataset as ds

    t = lake.read("receipts", columns=["group_id", "valid_members", "snapshot_id"],
                  filter=ds.field("snapshot_id") == snapshot_id)
    if t.num_rows == 0:
        return None
    return {g: len(v or []) for g, v in zip(t.column("group_id").to_pylist(), t.column("valid_members").to_pylist())}


def collate(m: Members, idx: Sequence[int], *, need: tuple[str, ...] = ()) -> dict[str, Any]:
    """One micro-batch as tensors (layout in the module docstring). ``need``
    names per-member arrays to gather into [B, R]: "old", "ref", "rollout"."""
    import torch

    B = len(idx)
    P = [len(m.prompt[i]) for i in idx]
    R = [len(m.response[i]) for i in idx]
    L, Rmax = max(p + r for p, r in zip(P, R)), max(R)
    input_ids = np.zeros((B, L), dtype=np.int64)                                  # [B, L]
    mask = np.zeros((B, Rmax), dtype=np.float32)                                  # [B, R]
    adv = np.zeros((B, Rmax), dtype=np.float32)                                   # [B, R]
    extra = {k: np.zeros((B, Rmax), dtype=np.float32) for k in need}
    per_member: dict[str, Sequence[np.ndarray | None]] = {
        "old": m.old_logprobs, "ref": m.ref_logprobs, "rollout": m.rollout_logprobs}
    rows, cols, targets = [], [], []
    for b, i in enumerate(idx):
        p, r = m.prompt[i], m.response[i]
        input_ids[b, :P[b]] = p
        input_ids[b, P[b]:P[b] + R[b]] = r
        mk = m.loss_mask[i].astype(np.float32)
        mask[b, :R[b]] = mk
        turn_adv = m.turn_advantages[i] if m.turn_advantages else None
        if turn_adv is None:
            adv[b, :R[b]] = np.float32(m.advantage[i]) * mk
        else:   # per-turn credit: turn k's advantage on turn k's tokens
            adv[b, :R[b]] = turn_token_advantages(turn_adv, m.loss_mask[i]).astype(np.float32)
        j = np.flatnonzero(mk)
        rows.append(b * L + P[b] - 1 + j)
        cols.append(b * Rmax + j)
        targets.append(r[j])
        for k in need:
            src = per_member[k][i]
            assert src is not None, f"collate(need={k!r}): member {i} has no {k} log-probs"
            extra[k][b, :R[b]] = src * mk
    _check_layout(m, idx, input_ids, rows, targets, mask, P, R)
    out = {
        "input_ids": torch.from_numpy(input_ids),
        "rows": torch.from_numpy(np.concatenate(rows)),
        "cols": torch.from_numpy(np.concatenate(cols)),
        "targets": torch.from_numpy(np.concatenate(targets)),
        "mask": torch.from_numpy(mask),
        "advantages": torch.from_numpy(adv),
        "shape": (B, Rmax),
        "slots": B * L,
        "tokens_in": int(sum(P) + sum(R)),
    }
    for k in need:
        out[k] = torch.from_numpy(extra[k])
    return out


def _check_layout(m: Members, idx, input_ids: np.ndarray, rows: list[np.ndarray], targets: list[np.ndarray],
                  mask: np.ndarray, P: list[int], R: list[int]) -> None:
    """Before any forward: every loss position predicts a response token of its
    own row (never a prompt or padding token), and the mask is zero on padding
    and on observation tokens."""
    L = input_ids.shape[1]
    flat = input_ids.reshape(-1)
    for b, i in enumerate(idx):
        r = rows[b]
        lo, hi = b * L + P[b], b * L + P[b] + R[b]          # flat span of row b's response tokens
        if len(r) and (r.min() + 1 < lo or r.max() + 1 >= hi or not np.array_equal(flat[r + 1], targets[b])):
            raise _fail(m, i, "a loss position does not predict one of its own response tokens (layout bug)")
        if mask[b, R[b]:].any():
            raise _fail(m, i, "loss mask is non-zero on padding")
        tv = m.token_versions[i]
        if tv is not None and mask[b, :R[b]][tv < 0].any():
            raise _fail(m, i, "loss mask is non-zero on an observation token")


def snapshot_revisions(lake: Lake, snapshot_id: str) -> dict[str, set[str]]:
    """tokenizer_rev / prompt_template_rev values the admission receipts of this
    snapshot recorded for its admitted groups (empty sets when not recorded)."""
    out: dict[str, set[str]] = {"tokenizer_rev": set(), "prompt_template_rev": set()}
    if not lake.exists("receipts"):
        return out
    import pyarrow.dataset as ds

    t = lake.read("receipts", columns=["ref_tokenizer_rev", "ref_prompt_template_rev", "snapshot_id"],
                  filter=ds.field("snapshot_id") == snapshot_id)
    for name in out:
        out[name] = {v for v in t.column(f"ref_{name}").to_pylist() if v is not None}
    return out


def _family(template_rev: str) -> str:
    return template_rev.rsplit("/", 1)[0] if "/" in template_rev else template_rev


def check_comparable(lake: Lake, snapshot_id: str, *, policy_tokenizer: str, policy_templates: list[str] | None,
                     policy_name: str) -> dict[str, set[str]]:
    """Refuse a snapshot the policy cannot learn from: sampled with another
    tokenizer than the policy's, or with a revision of a prompt template whose
    other revision the policy was trained with (when the policy records its
    templates: ``prompt_template_revs`` in its train config). Returns the
    snapshot's revisions."""
    revs = snapshot_revisions(lake, snapshot_id)
    foreign = sorted(revs["tokenizer_rev"] - {policy_tokenizer})
    if foreign:
        raise TrainDataError(
            f"snapshot {snapshot_id[:16]}… was sampled with tokenizer {', '.join(foreign)}; policy {policy_name} "
            f"uses {policy_tokenizer}: its token ids mean other text",
            hint="train it from a policy with that tokenizer (--from-checkpoint), or re-admit with "
                 "`pipeline admit --run-id RUN` the runs sampled by this policy")
    if policy_templates:
        known = {_family(t): t for t in policy_templates}
        bad = sorted(t for t in revs["prompt_template_rev"] if _family(t) in known and t not in policy_templates)
        if bad:
            raise TrainDataError(
                f"snapshot {snapshot_id[:16]}… uses prompt template revision(s) {', '.join(bad)}; policy "
                f"{policy_name} was trained with {', '.join(known[_family(t)] for t in bad)}",
                hint="roll out with the template revision the policy knows, or start from a policy trained on it")
    return revs
