"""The report's alerts section: fixed thresholds (``ALERTS``), each alert a
sentence that says what is wrong and where to look, and the check that raised
it (``pipeline report --check`` exits non-zero when one fires; ``--json``
lists them as ``alert_checks``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

from pipeline.report.html import Note, Section

if TYPE_CHECKING:
    from pipeline.report.build import _Queries


# -- alerts -------------------------------------------------------------------------------------------

# Thresholds of the alerts section (a value beyond its bound raises the alert).
ALERTS = {
    "mismatch_kl": 1e-3,          # rollout-engine vs trainer log-probs: above this the engines drift apart
    "zero_variance_share": 0.5,   # share of decided groups with identical rewards: no learning signal
    "infra_failure_rate": 0.05,   # share of trajectories INFRA_FAILED: infrastructure, not policy
    "stale_share": 0.2,           # share of a bucket's groups rejected as stale (gated)
    "truncation_rate": 0.2,       # share of responses cut at the length limit (newest version)
    "clip_fraction": 0.2,         # share of tokens clipped, mean over a checkpoint's steps
    "eval_drop": 0.05,            # held-out success falling by more than this from the previous version
    "ess_seq_frac": 0.5,          # a LOWER bound: sequence-level IS ESS/n vs the behaviour policy below it in a step
                                  # (half the sampled trajectories carry the weight: SMC's resampling threshold)
    "behav_ratio_p99": 2.0,       # token ratio pi/mu p99 above it in a step (the default tis_cap: beyond it TIS truncates)
}


def _worst_step(tr: pd.DataFrame, col: str, *, lower: bool = False) -> pd.Series | None:
    """The training step with the worst value of ``col`` when it is beyond its bound in ``ALERTS``
    (below it for a ``lower`` bound), else None."""
    if col not in tr or not tr[col].notna().any():
        return None
    worst = tr.loc[tr[col].idxmin() if lower else tr[col].idxmax()]
    return worst if (worst[col] < ALERTS[col] if lower else worst[col] > ALERTS[col]) else None


def alerts(q: _Queries) -> Section:
    s = Section("alerts", "Alerts",
                "Checks against fixed thresholds (pipeline.report.alerts.ALERTS); each alert says what is wrong "
                "and where to look.")
    found: list[tuple[str, str]] = []   # (check, message)
    tr = q.get("training")
    if isinstance(tr, pd.DataFrame) and not tr.empty:
        worst = _worst_step(tr, "mismatch_kl")
        if worst is not None:
            found.append(("mismatch_kl",
                          f"Rollout engine and trainer disagree: mismatch_kl reached {worst.mismatch_kl:.3g} "
                          f"(bound {ALERTS['mismatch_kl']:g}) in checkpoint {worst.checkpoint_id}, step "
                          f"{int(worst.global_step)}. Check the engine's dtype/sampling settings and the "
                          f"policy version workers load (Training metrics)."))
        worst = _worst_step(tr, "ess_seq_frac", lower=True)
        if worst is not None:
            found.append(("ess_seq_frac",
                          f"Training data is far off-policy: the sequence-level importance-sampling ESS/n of the "
                          f"policy against the rollout's sampling log-probs fell to {worst.ess_seq_frac:.3g} "
                          f"(bound {ALERTS['ess_seq_frac']:g}) in checkpoint {worst.checkpoint_id}, step "
                          f"{int(worst.global_step)}: a few trajectories carry the update. Lower the policy lag, "
                          f"the epochs or the learning rate, or gate it (min_ess_fraction) (Training metrics)."))
        worst = _worst_step(tr, "behav_ratio_p99")
        if worst is not None:
            found.append(("behav_ratio_p99",
                          f"Importance ratios against the behaviour policy have a heavy tail: p99 of pi/mu reached "
                          f"{worst.behav_ratio_p99:.3g} (bound {ALERTS['behav_ratio_p99']:g}) in checkpoint "
                          f"{worst.checkpoint_id}, step {int(worst.global_step)}. Check the policy lag and the "
                          f"engine/trainer mismatch, or gate it (max_ratio_p99) (Training metrics)."))
        if tr.grad_norm.notna().any() and not pd.Series(tr.grad_norm.dropna()).map(math.isfinite).all():
            found.append(("grad_norm",
                          "Gradient norm is not finite in some step: training diverged (Training metrics)."))
        # sustained, not one step: the first update from a warm start clips a burst and settles (the
        # demo's own run: 38% in one step, 15% over its run, under 5% after), which is not a problem
        clip = tr.groupby("checkpoint_id", sort=False).clip_fraction.mean().dropna()
        if len(clip) and clip.max() > ALERTS["clip_fraction"]:
            found.append(("clip_fraction",
                          f"{clip.max():.0%} of tokens were clipped on average over the steps of checkpoint "
                          f"{clip.idxmax()} (bound {ALERTS['clip_fraction']:.0%}): updates are too large or data too "
                          f"off-policy; lower the learning rate or the policy lag (Training metrics)."))
    rc = q.sql("SELECT decision, count(*) AS n FROM receipts GROUP BY decision")
    if isinstance(rc, pd.DataFrame) and not rc.empty:
        total = rc.n.sum()
        zv = rc.loc[rc.decision == "zero_variance", "n"].sum() / total
        if zv > ALERTS["zero_variance_share"]:
            found.append(("zero_variance_share",
                          f"{zv:.0%} of decided groups had zero reward variance (bound "
                          f"{ALERTS['zero_variance_share']:.0%}): they carry no learning signal; tasks are too easy "
                          f"or too hard for this policy (Success by difficulty)."))
    st = q.get("freshness_rejections", run_id=q.opts.run_id)
    if isinstance(st, pd.DataFrame) and not st.empty:
        for r in st[st.stale_exclusion_rate.fillna(0) > ALERTS["stale_share"]].itertuples():
            found.append(("stale_share",
                          f"{r.stale_exclusion_rate:.0%} of the members in bucket difficulty={r.difficulty}, "
                          f"length={r.length_bucket} (run {r.run_id}) were excluded as stale (bound "
                          f"{ALERTS['stale_share']:.0%}): rollouts of this bucket arrive too late for the policy; "
                          f"raise max_policy_lag or speed up their generation (Freshness)."))
    inf = q.sql("SELECT avg(CASE WHEN status = 'INFRA_FAILED' THEN 1.0 ELSE 0.0 END) AS rate, count(*) AS n "
                "FROM trajectories")
    if isinstance(inf, pd.DataFrame) and not inf.empty and inf.n.iloc[0] and inf.rate.iloc[0] > ALERTS[
            "infra_failure_rate"]:
        found.append(("infra_failure_rate",
                      f"{inf.rate.iloc[0]:.1%} of trajectories failed for infrastructure reasons (bound "
                      f"{ALERTS['infra_failure_rate']:.0%}): tools, environments or verifiers are failing "
                      f"(Efficiency: failures)."))
    ln = q.get("rollout_lengths", run_id=q.opts.run_id)
    if isinstance(ln, pd.DataFrame) and not ln.empty:
        newest = ln.sort_values("policy_version").groupby("run_id").tail(1)
        for r in newest[newest.truncation_rate > ALERTS["truncation_rate"]].itertuples():
            found.append(("truncation_rate",
                          f"{r.truncation_rate:.0%} of responses of policy version {r.policy_version} (run "
                          f"{r.run_id}) hit the length limit (bound {ALERTS['truncation_rate']:.0%}): answers are "
                          f"growing; truncated answers mostly fail (Rollout health)."))
    ev = q.get("eval_curve")
    if isinstance(ev, pd.DataFrame) and len(ev) > 1:
        for _, g in ev.groupby(["env", "n", "seed", "samples", "temperature"]):
            g = g.sort_values("policy_version")
            if len(g) > 1 and g.success.iloc[-2] - g.success.iloc[-1] > ALERTS["eval_drop"]:
                found.append(("eval_drop",
                              f"Held-out success fell from {g.success.iloc[-2]:.3f} to {g.success.iloc[-1]:.3f} at "
                              f"policy version {int(g.policy_version.iloc[-1])} ({g.env.iloc[0]}): the newest version "
                              f"is worse on tasks it never trained on (Held-out evaluation)."))
    s.blocks.extend(Note(text, "alert", check=check) for check, text in found)
    if not found:
        s.blocks.append(Note("No alerts: every check is within its threshold.", "info"))
    return s
