"""Per-run summary of a finished Simulation: one flat-ish dict (JSON-ready).

Trajectory-level rates are over *decided* trajectories (members of groups that
an admission run decided before the end of simulated time); a trajectory is
``admitted`` when it is a valid member of an admitted group. The rejection
rate of a class counts every reason (failures, staleness, group decisions);
``stale_rate`` only the freshness gate's (stale_policy + stale_wait), which is
where a strict gate's bias against slow tasks shows.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from pipeline.config import config_dict, config_hash
from pipeline.sim.gate import ACCEPTED, EXPIRED, INFRA_FAILED, VALID

STALE = ("stale_policy", "stale_wait")
STARVING_IDLE = 0.5  # trainer idle share above which an under-loaded trainer is flagged starving


def littles_law(*, duration_s: float, end: np.ndarray, decided_at: np.ndarray, admitted: int, trained: int,
                trainer_train_s: float, trainer_idle_fraction: float) -> dict[str, Any]:
    """Little's law on the admission queue, and the trainer's load.

    The queue holds a trajectory from its finish (``end``) until its group is
    decided (``decided_at``; the end of simulated time when never decided).
    lambda = finished trajectories / duration (arrival rate); W = mean time in
    the queue; L = lambda * W, the time-average number of trajectories waiting
    (equal to the integral of the queue length over time / duration, reported
    as ``queue_l_measured``). mu = trained trajectories per second of trainer
    training time (its service rate); rho = (admitted / duration) / mu, the
    trainer's load: rho > 1 is a backlog (admitted data arrives faster than
    the trainer can consume it, so it ages), rho <= 1 with the trainer idle
    more than STARVING_IDLE of the time is starvation (rollouts cannot keep
    the trainer busy); otherwise balanced."""
    fin = ~np.isnan(end)
    leave = np.where(np.isnan(decided_at), duration_s, np.minimum(decided_at, duration_s))
    sojourn = (leave - end)[fin]                                                    # [finished]
    lam = float(fin.sum()) / duration_s
    w = float(sojourn.mean()) if sojourn.size else None
    mu = trained / trainer_train_s if trainer_train_s > 0 and trained else None
    rho = (admitted / duration_s) / mu if mu else None
    if rho is not None and rho > 1.0:
        state = "backlog"
    elif trainer_idle_fraction > STARVING_IDLE:
        state = "starvation"
    else:
        state = "balanced"
    return {"lambda_per_s": lam, "queue_w_s": w, "queue_l": (lam * w) if w is not None else None,
            "queue_l_measured": float(sojourn.sum()) / duration_s, "mu_per_s": mu, "rho": rho,
            "load_state": state}


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def _per_class(classes: list[str], g_class: np.ndarray, t_class: np.ndarray, *, finished: np.ndarray,
               decided: np.ndarray, admitted: np.ndarray, why: np.ndarray) -> dict[str, Any]:
    """Per task class: groups created, completions, decisions and why the decided were not admitted."""
    per_class: dict[str, Any] = {}
    for k, name in enumerate(classes):
        m = decided & (t_class == k)
        nd = int(m.sum())
        na = int((admitted & m).sum())
        reasons = Counter(why[m & ~admitted].tolist())
        stale = sum(reasons.get(r, 0) for r in STALE)
        per_class[name] = {
            "groups_created": int((g_class == k).sum()),
            "completions": int((finished & (t_class == k)).sum()),
            "decided": nd,
            "admitted": na,
            "rejection_rate": (1 - na / nd) if nd else None,
            "stale_rate": (stale / nd) if nd else None,
            "reasons": dict(sorted(reasons.items())),
        }
    return per_class


def _rates(mask_cls: np.ndarray, *, decided: np.ndarray, admitted: np.ndarray,
           why: np.ndarray) -> tuple[float | None, float | None]:
    """(rejection rate, stale rate) of the decided trajectories in ``mask_cls``; (None, None) when none."""
    m = decided & mask_cls
    nd = int(m.sum())
    if not nd:
        return None, None
    stale = int(np.isin(why[m], STALE).sum())
    return 1 - int((admitted & m).sum()) / nd, stale / nd


def summarize(sim) -> dict[str, Any]:
    cfg = sim.cfg
    G = sim.G
    hours = cfg.duration_s / 3600.0
    n = len(sim.version)
    classes = [c.name for c in sim.classes]
    slow = cfg.slow_class
    g_class = np.asarray(sim.g_class, np.int64)
    t_class = np.repeat(g_class, G) if n else np.zeros(0, np.int64)
    status = np.asarray([s or "" for s in sim.status], object)
    end = np.asarray(sim.end, float)
    start = np.asarray(sim.start, float)
    version = np.asarray(sim.version, np.int64)
    reason = np.asarray(sim.reason, object)
    g_dec = np.asarray([d or "" for d in sim.g_decision], object)
    t_dec = np.repeat(g_dec, G) if n else np.zeros(0, object)
    g_decided_at = np.asarray(sim.g_decided_at, float)
    t_decided_at = np.repeat(g_decided_at, G) if n else np.zeros(0)
    decided_version = np.asarray(sim.decided_version, np.int64)

    finished = ~np.isnan(end)
    decided = t_dec != ""
    admitted = decided & (t_dec == "admit") & (reason == VALID)
    g_trained_v = np.asarray(sim.g_trained_version, np.int64)
    t_trained_v = np.repeat(g_trained_v, G) if n else np.zeros(0, np.int64)
    trained = admitted & (t_trained_v >= 0)

    # why each decided trajectory was not admitted: its own exclusion, else its group's decision
    why = np.where(reason == VALID, t_dec, reason)
    per_class = _per_class(classes, g_class, t_class, finished=finished, decided=decided, admitted=admitted, why=why)
    slow_idx = classes.index(slow)
    rej_slow, stale_slow = _rates(t_class == slow_idx, decided=decided, admitted=admitted, why=why)
    rej_rest, stale_rest = (_rates(t_class != slow_idx, decided=decided, admitted=admitted, why=why)
                            if len(classes) > 1 else (None, None))

    ok_decided = decided & (status == ACCEPTED)
    qage = (t_decided_at - end)[ok_decided]
    lag = (decided_version - version)[ok_decided]
    lag_trained = (t_trained_v - version)[trained]
    busy = np.clip(np.where(finished, end, cfg.duration_s), None, cfg.duration_s) - start
    busy = busy[~np.isnan(start)]
    dur = cfg.duration_s
    out: dict[str, Any] = {
        "mode": cfg.mode,
        "sim_hours": hours,
        "events": sim.events,
        "wall_s": round(sim.wall_s, 4),
        "events_per_s": round(sim.events / sim.wall_s) if sim.wall_s > 0 else None,
        "groups_created": len(sim.g_class),
        "started": int((~np.isnan(start)).sum()),
        "completions": int(finished.sum()),
        "infra_failed": int((status == INFRA_FAILED).sum()),
        "expired": int((status == EXPIRED).sum()),
        "decided": int(decided.sum()),
        "admitted": int(admitted.sum()),
        "admitted_per_hour": round(int(admitted.sum()) / hours, 2),
        "trained": int(trained.sum()),
        "trained_per_hour": round(int(trained.sum()) / hours, 2),
        "rejection_rate": (1 - int(admitted.sum()) / int(decided.sum())) if decided.any() else None,
        "slow_class": slow,
        "rejection_rate_slow": rej_slow,
        "rejection_rate_rest": rej_rest,
        "stale_rate_slow": stale_slow,
        "stale_rate_rest": stale_rest,
        "slow_share_created": per_class[slow]["groups_created"] / max(len(sim.g_class), 1),
        "slow_share_admitted": per_class[slow]["admitted"] / max(int(admitted.sum()), 1),
        "group_decisions": dict(sorted(Counter(g_dec[g_dec != ""].tolist()).items())),
        "per_class": per_class,
        "trainer_idle_fraction": sim.trainer_idle_s / dur,
        "trainer_busy_fraction": sim.trainer_train_s / dur,
        "trainer_sync_fraction": sim.trainer_sync_s / dur,
        "worker_utilization": float(busy.sum() / (cfg.workers * dur)),
        "queue_age_p50_s": _pct(qage, 50),
        "queue_age_p95_s": _pct(qage, 95),
        "policy_lag_hist": {int(k): int(v) for k, v in zip(*np.unique(lag, return_counts=True))},
        "policy_lag_p50": _pct(lag, 50),
        "policy_lag_p95": _pct(lag, 95),
        "trained_lag_hist": {int(k): int(v) for k, v in zip(*np.unique(lag_trained, return_counts=True))},
        "steps": sim.steps,
        "final_policy_version": sim.policy_version,
        "admission_runs": sim.admission_runs,
        "pending_groups": int(sum(1 for d in sim.g_decision if d is None)),
        **littles_law(duration_s=dur, end=end, decided_at=t_decided_at, admitted=int(admitted.sum()),
                      trained=int(trained.sum()), trainer_train_s=sim.trainer_train_s,
                      trainer_idle_fraction=sim.trainer_idle_s / dur),
        "config": config_dict(cfg),
        "config_hash": config_hash(cfg),
    }
    return out


SUMMARY_FIELDS = (
    ("completions", "completions", "{:d}"),
    ("admitted", "admitted", "{:d}"),
    ("admitted_per_hour", "admitted/h", "{:.0f}"),
    ("rejection_rate_slow", "rej slow", "{:.1%}"),
    ("rejection_rate_rest", "rej rest", "{:.1%}"),
    ("stale_rate_slow", "stale slow", "{:.1%}"),
    ("stale_rate_rest", "stale rest", "{:.1%}"),
    ("slow_share_admitted", "slow share", "{:.1%}"),
    ("trainer_idle_fraction", "trainer idle", "{:.1%}"),
    ("queue_age_p50_s", "qage p50 s", "{:.0f}"),
    ("queue_age_p95_s", "qage p95 s", "{:.0f}"),
    ("policy_lag_p95", "lag p95", "{:.0f}"),
    ("steps", "steps", "{:d}"),
    ("rho", "rho", "{:.2f}"),
    ("load_state", "load", "{}"),
)


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def render_text(s: dict[str, Any]) -> str:
    """Human summary of one run."""
    lines = [f"simulated {s['sim_hours']:g} h ({s['mode']}) in {s['wall_s']:.2f} s wall, "
             f"{s['events']:,} events ({s['events_per_s'] or 0:,}/s)"]
    lines.append(f"  completions {s['completions']:,} (infra_failed {s['infra_failed']:,}, expired {s['expired']:,}); "
                 f"decided {s['decided']:,}; admitted {s['admitted']:,} ({s['admitted_per_hour']:,.0f}/h); "
                 f"trained {s['trained']:,} in {s['steps']} step{'' if s['steps'] == 1 else 's'}")
    lines.append(f"  rejection rate: {s['slow_class']} {fmt(s['rejection_rate_slow'], '{:.1%}')} vs rest "
                 f"{fmt(s['rejection_rate_rest'], '{:.1%}')} (freshness only: {fmt(s['stale_rate_slow'], '{:.1%}')} "
                 f"vs {fmt(s['stale_rate_rest'], '{:.1%}')}); {s['slow_class']} share: created "
                 f"{s['slow_share_created']:.1%}, admitted {s['slow_share_admitted']:.1%}")
    lines.append(f"  trainer idle {s['trainer_idle_fraction']:.1%}, training {s['trainer_busy_fraction']:.1%}, "
                 f"syncing {s['trainer_sync_fraction']:.1%}; worker utilization {s['worker_utilization']:.1%}")
    lines.append(f"  queue age p50 {fmt(s['queue_age_p50_s'], '{:.0f}')} s, p95 {fmt(s['queue_age_p95_s'], '{:.0f}')} s; "
                 f"policy lag at decision {_kv(s['policy_lag_hist'], ': ')}")
    lines.append(f"  group decisions {_kv(s['group_decisions'])}; pending groups {s['pending_groups']}")
    lines.append(f"  Little's law: lambda {s['lambda_per_s']:.3f}/s, W {fmt(s['queue_w_s'], '{:.0f}')} s, "
                 f"L = lambda*W {fmt(s['queue_l'], '{:.1f}')} trajectories waiting; trainer mu "
                 f"{fmt(s['mu_per_s'], '{:.3f}')}/s, load rho {fmt(s['rho'], '{:.2f}')}: {s['load_state'].upper()}")
    for name, pc in s["per_class"].items():
        reasons = _kv(pc["reasons"])
        lines.append(f"  {name}: decided {pc['decided']:,}, admitted {pc['admitted']:,}, "
                     f"rejected {fmt(pc['rejection_rate'], '{:.1%}')}" + (f" ({reasons})" if pc["reasons"] else ""))
    if s.get("lake"):
        lk = s["lake"]
        lines.append(f"  lake {lk['uri']}: {lk['landed']:,} trajectories and {lk['events']:,} events landed, "
                     f"{lk['quarantined']:,} quarantined; {lk['admission_runs']} admission runs decided "
                     f"{lk['groups_decided']:,} groups into {len(lk['snapshots'])} snapshots; gate mismatches "
                     f"{lk['gate_mismatches']}")
    if s.get("out"):
        lines.append(f"  summary written to {s['out']}")
    return "\n".join(lines)


def _kv(d: dict[Any, Any] | None, sep: str = " ") -> str:
    """``{"admit": 3, "stale": 1}`` -> ``admit 3, stale 1`` (text output never shows a Python dict)."""
    if not d:
        return "none"
    return ", ".join(f"{k}{sep}{v:,}" if isinstance(v, int) else f"{k}{sep}{v}" for k, v in d.items())
