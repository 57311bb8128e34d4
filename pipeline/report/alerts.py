"""The report's alerts section: thresholds (``ALERTS``, each overridable per
report: ``ReportOptions.alert_bounds``, ``pipeline report --alert-bound
NAME=VALUE``), each alert a sentence that says what is wrong and where to look,
and the check that raised it (``pipeline report --check`` exits non-zero when
one fires; ``--json`` lists them as ``alert_checks``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

from pipeline.report.html import Note, Section

if TYPE_CHECKING:
    from pipeline.report.queries import Queries


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
    # reward-hacking alarms (docs/report-alerts.md)
    "train_heldout_gap": 0.15,    # train success minus held-out success widening by more than this from the first
                                  # version measured (train: the PASS share of the members a checkpoint trained on)
    "train_heldout_z": 3.0,       # ... and by more than this many standard errors (binomial): noise is not an alarm
    "approx_kl_max": 1.0,         # KL band: a checkpoint's mean approx_kl (k3, policy vs its batch's old log-probs);
                                  # above the demo's healthy run (0.06-0.72: a tiny model learning at lr 3e-4), far
                                  # above an LLM run's target_kl (0.01-0.05): set it there for such a run
    "approx_kl_min": 0.0,         # outside [min, max]; min 0 = off (one on-policy step per batch measures ~0 KL)
    "clip_fraction_min": 0.0,     # the clip band's lower edge (its upper edge is clip_fraction); 0 = off
    "verdict_disagreement": 0.05,  # share of re-verified groups whose re-verdict disagreed (admission's reverify)
    "component_share_drift": 0.3,  # a reward component's share of sum |components| moving by more than this between
                                   # a run's first and newest policy version, the hacking way: a heuristic (shaping)
                                   # component gaining, a fact component losing, an untagged one either way
}


def bounds(overrides: tuple[tuple[str, float], ...] | dict[str, float] = ()) -> dict[str, float]:
    """``ALERTS`` with ``overrides`` applied; an unknown name is a one-line error naming the known ones."""
    from pipeline.config import did_you_mean
    from pipeline.errors import ConfigError

    out = dict(ALERTS)
    for name, value in dict(overrides).items():
        if name not in ALERTS:
            close = did_you_mean(name, list(ALERTS))
            raise ConfigError(f"unknown alert bound {name!r}" + (f": {close}" if close else ""),
                              hint="known bounds: " + ", ".join(ALERTS))
        v = float(value)
        if not math.isfinite(v):
            raise ConfigError(f"alert bound {name}={value!r} is not a finite number")
        out[name] = v
    return out


def _worst_step(tr: pd.DataFrame, col: str, B: dict[str, float], *, lower: bool = False) -> pd.Series | None:
    """The training step with the worst value of ``col`` when it is beyond its bound in ``B``
    (below it for a ``lower`` bound), else None."""
    if col not in tr or not tr[col].notna().any():
        return None
    worst = tr.loc[tr[col].idxmin() if lower else tr[col].idxmax()]
    return worst if (worst[col] < B[col] if lower else worst[col] > B[col]) else None


def alerts(q: Queries) -> Section:
    s = Section("alerts", "Alerts",
                "Checks against fixed thresholds (pipeline.report.alerts.ALERTS); each alert says what is wrong "
                "and where to look.")
    found: list[tuple[str, str]] = []   # (check, message)
    B = bounds(getattr(q.opts, "alert_bounds", ()))
    tr = q.get("training")
    if isinstance(tr, pd.DataFrame) and not tr.empty:
        worst = _worst_step(tr, "mismatch_kl", B)
        if worst is not None:
            found.append(("mismatch_kl",
                          f"Rollout engine and trainer disagree: mismatch_kl reached {worst.mismatch_kl:.3g} "
                          f"(bound {B['mismatch_kl']:g}) in checkpoint {worst.checkpoint_id}, step "
                          f"{int(worst.global_step)}. Check the engine's dtype/sampling settings and the "
                          f"policy version workers load (Training metrics)."))
        worst = _worst_step(tr, "ess_seq_frac", B, lower=True)
        if worst is not None:
            found.append(("ess_seq_frac",
                          f"Training data is far off-policy: the sequence-level importance-sampling ESS/n of the "
                          f"policy against the rollout's sampling log-probs fell to {worst.ess_seq_frac:.3g} "
                          f"(bound {B['ess_seq_frac']:g}) in checkpoint {worst.checkpoint_id}, step "
                          f"{int(worst.global_step)}: a few trajectories carry the update. Lower the policy lag, "
                          f"the epochs or the learning rate, or gate it (min_ess_fraction) (Training metrics)."))
        worst = _worst_step(tr, "behav_ratio_p99", B)
        if worst is not None:
            found.append(("behav_ratio_p99",
                          f"Importance ratios against the behaviour policy have a heavy tail: p99 of pi/mu reached "
                          f"{worst.behav_ratio_p99:.3g} (bound {B['behav_ratio_p99']:g}) in checkpoint "
                          f"{worst.checkpoint_id}, step {int(worst.global_step)}. Check the policy lag and the "
                          f"engine/trainer mismatch, or gate it (max_ratio_p99) (Training metrics)."))
        if tr.grad_norm.notna().any() and not pd.Series(tr.grad_norm.dropna()).map(math.isfinite).all():
            found.append(("grad_norm",
                          "Gradient norm is not finite in some step: training diverged (Training metrics)."))
        # sustained, not one step: the first update from a warm start clips a burst and settles (the
        # demo's own run: 38% in one step, 15% over its run, under 5% after), which is not a problem
        found.extend(_kl_band(tr, B))
        clip = tr.groupby("checkpoint_id", sort=False).clip_fraction.mean().dropna()
        if len(clip) and clip.max() > B["clip_fraction"]:
            found.append(("clip_fraction",
                          f"{clip.max():.0%} of tokens were clipped on average over the steps of checkpoint "
                          f"{clip.idxmax()} (bound {B['clip_fraction']:.0%}): updates are too large or data too "
                          f"off-policy; lower the learning rate or the policy lag (Training metrics)."))
    rc = q.sql("SELECT decision, count(*) AS n FROM receipts GROUP BY decision")
    if isinstance(rc, pd.DataFrame) and not rc.empty:
        total = rc.n.sum()
        zv = rc.loc[rc.decision == "zero_variance", "n"].sum() / total
        if zv > B["zero_variance_share"]:
            found.append(("zero_variance_share",
                          f"{zv:.0%} of decided groups had zero reward variance (bound "
                          f"{B['zero_variance_share']:.0%}): they carry no learning signal; tasks are too easy "
                          f"or too hard for this policy (Success by difficulty)."))
    st = q.get("freshness_rejections", run_id=q.opts.run_id)
    if isinstance(st, pd.DataFrame) and not st.empty:
        for r in st[st.stale_exclusion_rate.fillna(0) > B["stale_share"]].itertuples():
            found.append(("stale_share",
                          f"{r.stale_exclusion_rate:.0%} of the members in bucket difficulty={r.difficulty}, "
                          f"length={r.length_bucket} (run {r.run_id}) were excluded as stale (bound "
                          f"{B['stale_share']:.0%}): rollouts of this bucket arrive too late for the policy; "
                          f"raise max_policy_lag or speed up their generation (Freshness)."))
    inf = q.sql("SELECT avg(CASE WHEN status = 'INFRA_FAILED' THEN 1.0 ELSE 0.0 END) AS rate, count(*) AS n "
                "FROM trajectories")
    if isinstance(inf, pd.DataFrame) and not inf.empty and inf.n.iloc[0] and inf.rate.iloc[0] > B[
            "infra_failure_rate"]:
        found.append(("infra_failure_rate",
                      f"{inf.rate.iloc[0]:.1%} of trajectories failed for infrastructure reasons (bound "
                      f"{B['infra_failure_rate']:.0%}): tools, environments or verifiers are failing "
                      f"(Efficiency: failures)."))
    ln = q.get("rollout_lengths", run_id=q.opts.run_id)
    if isinstance(ln, pd.DataFrame) and not ln.empty:
        newest = ln.sort_values("policy_version").groupby("run_id").tail(1)
        for r in newest[newest.truncation_rate > B["truncation_rate"]].itertuples():
            found.append(("truncation_rate",
                          f"{r.truncation_rate:.0%} of responses of policy version {r.policy_version} (run "
                          f"{r.run_id}) hit the length limit (bound {B['truncation_rate']:.0%}): answers are "
                          f"growing; truncated answers mostly fail (Rollout health)."))
    ev = q.get("eval_curve")
    if isinstance(ev, pd.DataFrame) and len(ev) > 1:
        for _, g in ev.groupby(["env", "n", "seed", "samples", "temperature"]):
            g = g.sort_values("policy_version")
            if len(g) > 1 and g.success.iloc[-2] - g.success.iloc[-1] > B["eval_drop"]:
                found.append(("eval_drop",
                              f"Held-out success fell from {g.success.iloc[-2]:.3f} to {g.success.iloc[-1]:.3f} at "
                              f"policy version {int(g.policy_version.iloc[-1])} ({g.env.iloc[0]}): the newest version "
                              f"is worse on tasks it never trained on (Held-out evaluation)."))
    found.extend(reward_hacking_alarms(q, B))
    s.blocks.extend(Note(text, "alert", check=check) for check, text in found)
    if not found:
        s.blocks.append(Note("No alerts: every check is within its threshold.", "info"))
    return s


# -- reward-hacking alarms: train vs held-out gap, KL band, reward-component drift ----------------------

TRAIN_SUCCESS_SQL = """
WITH ck AS (SELECT checkpoint_id, policy_version, unnest(snapshot_ids) AS snapshot_id FROM checkpoints)
SELECT ck.policy_version, count(*) AS n, avg(CASE WHEN t.verdict = 'PASS' THEN 1.0 ELSE 0.0 END) AS success
FROM ck JOIN snapshot_members AS m USING (snapshot_id) JOIN trajectories AS t USING (trajectory_id)
WHERE t.verdict IN ('PASS', 'FAIL')
GROUP BY 1 ORDER BY 1
"""

COMPONENT_SHARE_SQL = """
WITH kv AS (
    SELECT run_id, policy_version, env_version, unnest(map_entries(reward_components)) AS e
    FROM trajectories
    WHERE ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
      AND status NOT IN ('INFRA_FAILED', 'EXPIRED') AND verdict IN ('PASS', 'FAIL') AND reward_components IS NOT NULL
),
c AS (SELECT run_id, policy_version, e.key AS component, min(env_version) AS env_version, sum(abs(e.value)) AS mass
      FROM kv GROUP BY run_id, policy_version, e.key)
SELECT c.run_id, c.policy_version, c.component, c.mass, coalesce(t.tag, 'untagged') AS tag
FROM c LEFT JOIN component_tags AS t ON t.env_version = c.env_version AND t.component = c.component
ORDER BY 1, 2, 3
"""


def _kl_band(tr: pd.DataFrame, B: dict[str, float]) -> list[tuple[str, str]]:
    """A checkpoint whose steps' mean approx_kl (or clip fraction, below its lower edge) leaves the band."""
    out: list[tuple[str, str]] = []
    if "approx_kl" in tr and tr.approx_kl.notna().any():
        kl = tr.groupby("checkpoint_id", sort=False).approx_kl.mean().dropna()
        lo, hi = B["approx_kl_min"], B["approx_kl_max"]
        for cid, v in kl.items():
            if v > hi:
                out.append(("kl_band",
                            f"The policy moves too far per update: approx_kl averaged {v:.3g} over the steps of "
                            f"checkpoint {cid}, above the KL band [{lo:g}, {hi:g}]; lower the learning rate, the "
                            f"epochs per snapshot or the policy lag (Training metrics)."))
            elif v < lo:
                out.append(("kl_band",
                            f"The policy barely moves: approx_kl averaged {v:.3g} over the steps of checkpoint "
                            f"{cid}, below the KL band [{lo:g}, {hi:g}]; check the learning rate and that "
                            f"advantages are not all zero (Training metrics)."))
    if B["clip_fraction_min"] > 0 and "clip_fraction" in tr:
        clip = tr.groupby("checkpoint_id", sort=False).clip_fraction.mean().dropna()
        for cid, v in clip[clip < B["clip_fraction_min"]].items():
            out.append(("kl_band",
                        f"Almost nothing was clipped: {v:.1%} of tokens on average over the steps of checkpoint "
                        f"{cid}, below the clip band's lower edge {B['clip_fraction_min']:.1%}: updates may be "
                        f"too small to learn (Training metrics)."))
    return out


def _se(p: float, n: float) -> float:
    return p * (1.0 - p) / n if n > 0 else math.inf


def _train_heldout_gap(q: Queries, B: dict[str, float]) -> list[tuple[str, str]]:
    """Per held-out evaluation setting: the gap train success - held-out success at each version that has
    both, against the first such version's gap; the widest widening beyond both bounds alerts."""
    tr = q.sql(TRAIN_SUCCESS_SQL)
    ev = q.get("eval_curve")
    if not isinstance(tr, pd.DataFrame) or tr.empty or not isinstance(ev, pd.DataFrame) or ev.empty:
        return []
    train = {int(r.policy_version): (float(r.success), float(r.n)) for r in tr.itertuples()}
    out: list[tuple[str, str]] = []
    for _, g in ev.groupby(["env", "n", "seed", "samples", "temperature"]):
        rows = [(int(r.policy_version), train[int(r.policy_version)], (float(r.success), float(r.judged)))
                for r in g.sort_values("policy_version").itertuples() if int(r.policy_version) in train]
        if len(rows) < 2:
            continue
        v0, (t0, nt0), (h0, nh0) = rows[0]
        worst = None
        for v, (t, nt), (h, nh) in rows[1:]:
            widening = (t - h) - (t0 - h0)
            se = math.sqrt(_se(t, nt) + _se(h, nh) + _se(t0, nt0) + _se(h0, nh0))
            z = widening / se if se > 0 else (math.inf if widening > 0 else 0.0)
            # and train really above held-out: a train share catching up with a held-out success at its ceiling
            # (the demo: 0.39 -> 0.82 against 1.00 -> 0.985) is learning, not exploiting the training verifier
            if widening > B["train_heldout_gap"] and z > B["train_heldout_z"] and t > h \
                    and (worst is None or widening > worst[0]):
                worst = (widening, z, v, t, h)
        if worst is not None:
            widening, z, v, t, h = worst
            out.append(("train_heldout_gap",
                        f"Train success outruns held-out success: at policy version {v} the data it trained on "
                        f"passed {t:.3f} but held-out success is {h:.3f} ({g.env.iloc[0]}, {int(g.samples.iloc[0])} "
                        f"sample(s)); the gap widened by {widening:.3f} since version {v0} (bound "
                        f"{B['train_heldout_gap']:g}, {z:.1f} standard errors): the policy may be exploiting the "
                        f"training verifier or memorizing tasks; inspect passing train trajectories "
                        f"(Held-out evaluation)."))
    return out


def _component_drift(q: Queries, B: dict[str, float]) -> list[tuple[str, str]]:
    """Per run and component: its share of sum |components| at the run's first vs newest policy version."""
    df = q.sql(COMPONENT_SHARE_SQL, run_id=q.opts.run_id)
    if not isinstance(df, pd.DataFrame) or df.empty:
        return []
    total = df.groupby(["run_id", "policy_version"]).mass.transform("sum")
    df = df.assign(share=(df.mass / total.where(total > 0)).fillna(0.0))
    out: list[tuple[str, str]] = []
    for run, d in df.groupby("run_id", sort=True):
        versions = sorted(d.policy_version.unique())
        if len(versions) < 2:
            continue
        first, last = versions[0], versions[-1]
        share = d.pivot_table(index="component", columns="policy_version", values="share", aggfunc="first")
        tags = d.groupby("component").tag.first()
        worst = None
        for comp in share.index:
            a = 0.0 if pd.isna(share.at[comp, first]) else float(share.at[comp, first])
            b = 0.0 if pd.isna(share.at[comp, last]) else float(share.at[comp, last])
            tag = tags.get(comp, "untagged")
            move = b - a
            bad = move > B["component_share_drift"] if tag == "heuristic" else \
                -move > B["component_share_drift"] if tag == "fact" else abs(move) > B["component_share_drift"]
            if bad and (worst is None or (move > 0, abs(move)) > (worst[3] > worst[2], abs(worst[3] - worst[2]))):
                worst = (comp, tag, a, b)
        if worst is not None:   # one per run, the gainer first: the others' shares moved because it grew
            comp, tag, a, b = worst
            why = "the policy may be farming this term" if b > a else \
                "other terms are taking over the reward: the policy may be farming them"
            out.append(("component_share_drift",
                        f"Reward component {comp} ({tag}) went from {a:.0%} to {b:.0%} of the reward (sum of "
                        f"|components|) between policy versions {first} and {last} (run {run}; bound "
                        f"{B['component_share_drift']:.0%}): {why}; compare the components' within-group "
                        f"variance (pipeline sql --file diag_component_variance) (Quality)."))
    return out


REVERIFY_SQL = """
SELECT count(*) AS decided,
       count(*) FILTER (WHERE checks['reverify'] IS NOT NULL) AS reverified,
       count(*) FILTER (WHERE checks['reverify'] LIKE '%(shadow sample)') AS shadow,
       count(*) FILTER (WHERE decision = 'verdict_disagreement') AS disagreed
FROM receipts
WHERE ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
"""


def reverification(q: Queries) -> dict[str, float] | None:
    """Admission's re-verification over the receipts (pipeline/admission/reverify.py): decided groups,
    re-verified groups, of which shadow-sampled, of which held; None when nothing was re-verified."""
    df = q.sql(REVERIFY_SQL, run_id=q.opts.run_id)
    if not isinstance(df, pd.DataFrame) or df.empty or not df.reverified.iloc[0]:
        return None
    r = df.iloc[0]
    return {"decided": int(r.decided), "reverified": int(r.reverified), "shadow": int(r.shadow),
            "disagreed": int(r.disagreed), "shadow_rate": r.shadow / r.decided,
            "disagreement_rate": r.disagreed / r.reverified}


def _verdict_disagreement(q: Queries, B: dict[str, float]) -> list[tuple[str, str]]:
    rv = reverification(q)
    if rv is None or rv["disagreement_rate"] <= B["verdict_disagreement"]:
        return []
    return [("verdict_disagreement",
             f"Re-verification disagreed with the recorded verdict in {rv['disagreed']} of {rv['reverified']} "
             f"re-verified groups ({rv['disagreement_rate']:.0%}, bound {B['verdict_disagreement']:.0%}); those "
             f"groups are held as UNKNOWN (decision verdict_disagreement): the verifier is unreliable on these "
             f"tasks; read the receipts' reverify check (Latest receipts).")]


def reward_hacking_alarms(q: Queries, B: dict[str, float]) -> list[tuple[str, str]]:
    """The alarms that read several tables: train vs held-out gap, reward-component drift, verdicts
    that re-verification doubted."""
    return _train_heldout_gap(q, B) + _component_drift(q, B) + _verdict_disagreement(q, B)
