"""Freshness at use: how stale a snapshot's data is against the policy it would update,
in versions (``check_freshness``, ``max_train_lag``) and in probability (the
importance-sampling figures ``offpolicy_figures`` and their gate ``check_offpolicy``:
``min_ess_fraction``, ``max_ratio_p99``)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import numpy as np

    from pipeline.lake.delta import Lake
    from pipeline.policy_store import PolicyRef
    from pipeline.train.data import Members


def snapshot_wait_ms(lake: Lake, snapshot_id: str, consumed_at: datetime) -> int | None:
    """How long the snapshot waited between its publication and its use (ms);
    with the members' ``queue_wait_ms`` (finish -> landing) this measures the
    queue to the point of use. None when the snapshots table has no row for it."""
    import pyarrow.dataset as ds

    if not lake.exists("snapshots"):
        return None
    rows = lake.read("snapshots", columns=["created_at"], filter=ds.field("snapshot_id") == snapshot_id).to_pylist()
    if not rows:
        return None
    return max(0, int((consumed_at - rows[0]["created_at"]).total_seconds() * 1000))


def check_freshness(members: Members, parent_version: int, max_train_lag: int | None, snapshot_id: str) -> dict[str, Any]:
    """Freshness at use: the lag between the snapshot's data and the policy this
    update starts from, ``parent_version - oldest sampled token version`` per
    member (the version that started it when the row has no per-token versions).
    Raises StaleSnapshotError beyond ``max_train_lag``; returns the figures
    recorded with the checkpoint (``train_lag_max``, ``train_lag_mean``)."""
    import numpy as np

    from pipeline.errors import StaleSnapshotError

    if parent_version < 0 or len(members) == 0:      # an unpublished directory has no version to compare
        return {"train_lag_max": None, "train_lag_mean": None, "parent_version": parent_version}
    oldest = []
    started = members.policy_version
    for i, tv in enumerate(members.token_versions):
        sampled = tv[tv >= 0] if tv is not None else np.zeros(0)
        oldest.append(int(sampled.min()) if sampled.size else
                      (int(started[i]) if started is not None else None))
    lags = np.array([parent_version - o if o is not None else np.nan for o in oldest], np.float64)
    known = lags[~np.isnan(lags)]
    worst = int(known.max()) if known.size else None
    if max_train_lag is not None and worst is not None and worst > max_train_lag:
        i = int(np.nanargmax(lags))
        raise StaleSnapshotError(
            f"snapshot {snapshot_id} is stale at use: trajectory {members.trajectory_id[i]} was sampled by policy "
            f"version {oldest[i]}, {worst} versions behind the policy it would update (version {parent_version}; "
            f"max_train_lag={max_train_lag})",
            hint="admit fresher data (pipeline admit) and train on that snapshot, or raise --set max_train_lag=N "
                 "(null: no limit) if this off-policy lag is intended")
    return {"train_lag_max": worst, "train_lag_mean": float(known.mean()) if known.size else None,
            "parent_version": parent_version}



def check_lineage(lake: Lake, members: Members, parent: PolicyRef, snapshot_id: str) -> None:
    """Lineage at use: every policy version that sampled a member (each sampled
    token's, and the one that started it) must be the policy the update starts
    from or one of its ancestors (the parent chain of the ``checkpoints`` rows).
    A sibling line's version, or a version published nowhere, raises
    ForeignSnapshotError: its lag against this line means nothing (it can be
    negative) and its importance ratios would be taken against a behaviour policy
    this line never had. An unpublished directory (version -1) has no lineage to
    check."""
    import numpy as np

    from pipeline.errors import ForeignSnapshotError
    from pipeline.train.line import line_versions

    if parent.policy_version < 0 or len(members) == 0:
        return
    ancestors = line_versions(lake, parent.checkpoint_id)
    started = members.policy_version
    for i, tv in enumerate(members.token_versions):
        sampled = {int(v) for v in np.unique(tv[tv >= 0])} if tv is not None else set()
        if started is not None:
            sampled.add(int(started[i]))
        foreign = sorted(sampled - ancestors)
        if foreign:
            published = _published_versions(lake)
            where = ("a version of another line (not an ancestor of it)" if foreign[0] in published
                     else "a version that is published nowhere in this lake")
            raise ForeignSnapshotError(
                f"snapshot {snapshot_id} was sampled by another line: trajectory {members.trajectory_id[i]} was "
                f"sampled by policy version {foreign[0]}, {where}, not by the policy it would update (version "
                f"{parent.policy_version}, {parent.checkpoint_id}) or its ancestors "
                f"{sorted(ancestors, reverse=True)[:8]}",
                hint="train it from the line that sampled it (--from-checkpoint that version or a descendant of "
                     "it), or admit data this line sampled (pipeline admit) and train on that snapshot")


def _published_versions(lake: Lake) -> set[int]:
    if not lake.exists("checkpoints"):
        return set()
    return {int(v) for v in lake.read("checkpoints", columns=["policy_version"]).column("policy_version").to_pylist()}



# -- off-policy figures: how far the policy being trained is from the one that sampled ------------

# The token ratio is clamped like the loss's (losses.policy_loss: log-ratio in [-20, 20]).
LOG_RATIO_CLAMP = 20.0
OFFPOLICY_KEYS = ("ess_token_frac", "ess_seq_frac", "behav_ratio_p50", "behav_ratio_p90", "behav_ratio_p99",
                  "behav_ratio_max", "behav_ratio_above")


def ess_fraction(log_w: np.ndarray) -> float:
    """ESS / n = (sum w)^2 / (n * sum w^2) of importance weights given as logs
    (computed with w / max w, which the fraction does not depend on: no overflow)."""
    import numpy as np

    log_w = np.asarray(log_w, np.float64)
    if log_w.size == 0:
        return 1.0
    w = np.exp(log_w - log_w.max())
    return float(w.sum() ** 2 / (log_w.size * (w * w).sum()))


def offpolicy_figures(log_ratios: list[np.ndarray], bound: float) -> dict[str, float]:
    """The importance-sampling figures of the policy pi against the behaviour
    policy mu that sampled the tokens, from ``log_ratios``: one array per
    sequence of log pi(y_t) - log mu(y_t) over its policy-sampled response
    tokens (loss_mask 1; observation tokens are nobody's sample).

    - token level: w_t = exp(clamp(log-ratio, -20, 20)) over every token of every
      sequence; ``ess_token_frac`` = ESS/n of the w_t, and their p50/p90/p99/max
      and share above ``bound`` (``behav_ratio_*``);
    - sequence level: w_b = exp(sum_t log-ratio), the likelihood ratio of the whole
      response (the product of its token ratios, unclamped); ``ess_seq_frac`` =
      ESS/n of the w_b over the sequences.
    """
    import numpy as np

    seqs = [np.asarray(x, np.float64) for x in log_ratios]
    if not seqs or not any(s.size for s in seqs):
        return {"ess_token_frac": 1.0, "ess_seq_frac": 1.0, "behav_ratio_p50": 1.0, "behav_ratio_p90": 1.0,
                "behav_ratio_p99": 1.0, "behav_ratio_max": 1.0, "behav_ratio_above": 0.0}
    tok = np.clip(np.concatenate(seqs), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = np.exp(tok)
    p50, p90, p99 = np.quantile(r, [0.5, 0.9, 0.99])
    return {"ess_token_frac": ess_fraction(tok), "ess_seq_frac": ess_fraction(np.array([s.sum() for s in seqs])),
            "behav_ratio_p50": float(p50), "behav_ratio_p90": float(p90), "behav_ratio_p99": float(p99),
            "behav_ratio_max": float(r.max()), "behav_ratio_above": float((r > bound).mean())}


def member_log_ratios(members: Members, logprobs: list[np.ndarray | None], idx: Sequence[int] | None = None,
                      ) -> list[np.ndarray]:
    """Per member: ``logprobs`` (the pre-pass's, [R_i], 0 off the mask) minus the
    rollout's sampling log-probs, on the loss tokens."""
    import numpy as np

    out = []
    for i in (range(len(members)) if idx is None else idx):
        lp = logprobs[i]
        keep = members.loss_mask[i] > 0
        out.append(np.zeros(0) if lp is None else
                   (lp.astype(np.float64) - members.rollout_logprobs[i].astype(np.float64))[keep])
    return out


def check_offpolicy(figures: dict[str, float], *, min_ess_fraction: float | None, max_ratio_p99: float | None,
                    snapshot_id: str, policy: str) -> None:
    """The trainer's off-policy gate: refuse the snapshot when the policy about to
    be trained is too far from the behaviour policy (sequence-level ESS/n below
    ``min_ess_fraction``, or the token ratio's p99 above ``max_ratio_p99``)."""
    from pipeline.errors import OffPolicySnapshotError

    why = []
    if min_ess_fraction is not None and figures["ess_seq_frac"] < min_ess_fraction:
        why.append(f"sequence-level ESS/n {figures['ess_seq_frac']:.3g} < min_ess_fraction={min_ess_fraction:g}")
    if max_ratio_p99 is not None and figures["behav_ratio_p99"] > max_ratio_p99:
        why.append(f"token ratio p99 {figures['behav_ratio_p99']:.3g} > max_ratio_p99={max_ratio_p99:g}")
    if why:
        raise OffPolicySnapshotError(
            f"snapshot {snapshot_id} is too far off-policy for {policy}: {'; '.join(why)} (importance ratio of the "
            f"policy it would update against the rollout's sampling log-probs; token ESS/n "
            f"{figures['ess_token_frac']:.3g}, ratio max {figures['behav_ratio_max']:.3g})",
            hint="admit fresher data (pipeline admit) and train on that snapshot, or loosen --set min_ess_fraction=X / "
                 "--set max_ratio_p99=Y (null: off) if this off-policy distance is intended")
