"""The rollout health report: run the named queries in sql/, turn their rows
into plots and tables, write one self-contained HTML file.

Every section is built from one or more named queries (the same ones
`pipeline sql --file NAME` runs), so a number in the report can always be
reproduced from the command line. A table that does not exist yet (a fresh
lake, a stage that has not run) gives "no data yet", never a crash; a query
that fails shows its error in its own section and the rest still renders.
"""

from __future__ import annotations

import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pandas as pd

from pipeline.lake.ref import as_lake
from pipeline.report.alerts import alerts
from pipeline.report.html import Note, Plot, Section, Table, render
from pipeline.report.queries import Queries, ReportOptions

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

DEFAULT_OPTIONS = ReportOptions()   # frozen: one shared default


def _rows(df: pd.DataFrame | Exception, what: str) -> pd.DataFrame | Note:
    """``df`` when it has rows, else the Note that says why not (the query failed, or it is empty)."""
    if isinstance(df, Exception):
        msg = getattr(df, "message", None) or str(df)
        return Note(f"{what}: query failed: {msg}", "error")
    if df.empty:
        return Note(f"{what}: no data yet.", "empty")
    return df


def _series_by_run(df: pd.DataFrame, x: str, cols: dict[str, str]) -> dict[str, tuple[list, list]]:
    """``{label: (x, y)}`` for each run and each column (label ``run: name`` when several runs)."""
    out: dict[str, tuple[list, list]] = {}
    runs = sorted(df.run_id.unique()) if "run_id" in df else [None]
    for run in runs:
        d = df[df.run_id == run] if run is not None else df
        d = d.sort_values(x)
        for col, name in cols.items():
            if col in d and d[col].notna().any():
                label = name if len(runs) == 1 else f"{run}: {name}"
                out[label] = (d[x].tolist(), d[col].tolist())
    return out


SPARSE_MIN = 5          # a time bucket with fewer members than this (or than 10% of the run's median) is
                        # not drawn: a partial bucket holding 3 fast failures is not a collapse


def _hide_sparse(df: pd.DataFrame, count: str, cols: list[str]) -> tuple[pd.DataFrame, int]:
    """``df`` with ``cols`` blanked in buckets too sparse to read, and how many were."""
    med = df.groupby("run_id")[count].transform("median") if "run_id" in df else df[count].median()
    sparse = df[count] < np.maximum(SPARSE_MIN, 0.1 * med)
    out = df.copy()
    out.loc[sparse, cols] = None
    return out, int(sparse.sum())


def _sparse_note(n: int) -> str:
    return f" ({n} sparse bucket{'s' if n != 1 else ''} not drawn)" if n else ""


def _table(df: pd.DataFrame, columns: list[str] | None = None, caption: str = "", limit: int = 200) -> Table:
    d = df[columns] if columns else df
    rows = [[_py(v) for v in r] for r in d.head(limit).itertuples(index=False, name=None)]
    cap = caption + (f" (first {limit} of {len(d)} rows)" if len(d) > limit else "")
    return Table(list(d.columns), rows, cap)


def _py(v: Any) -> Any:
    if isinstance(v, pd.Timestamp):
        return v.to_pydatetime()
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):
        return v.tolist()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


# -- sections -------------------------------------------------------------------------------------


def overview(q: Queries) -> Section:
    from pipeline.schema import ALL_TABLES

    s = Section("overview", "Lake", "Tables the report read, with their Delta versions and row counts.")
    rows: list[list[Any]] = []
    for name in ALL_TABLES:
        try:
            version = q.lake.version(name)
        except Exception:
            version = None
        if version is None:
            rows.append([name, None, "no data yet"])
            continue
        n = q.sql(f'SELECT count(*) AS n FROM "{name}"')
        rows.append([name, version, int(n.n.iloc[0]) if not isinstance(n, Exception) else f"error: {n}"])
    s.blocks.append(Table(["table", "delta version", "rows"], rows))
    return s


def quality(q: Queries) -> Section:
    o = q.opts
    s = Section("quality", "Quality",
                "Success rate, hard-constraint pass rate and pass@k per policy version (sql/quality.sql, "
                "sql/quality_pass_at_k.sql, unbiased estimator 1 - C(n-c,k)/C(n,k) over groups); success and "
                "reward components over time (sql/quality_over_time.sql, sql/quality_components.sql). "
                "Valid members only: infrastructure failures are not policy failures.")
    qd = _rows(q.get("quality", run_id=o.run_id), "trajectories")
    if isinstance(qd, Note):
        s.blocks.append(qd)
        return s
    p1 = q.get("quality_pass_at_k", run_id=o.run_id, k=1)
    pk = q.get("quality_pass_at_k", run_id=o.run_id, k=o.pass_k)
    df = qd.copy()
    for frame, col in ((p1, "pass_at_1"), (pk, f"pass_at_{o.pass_k}")):
        if isinstance(frame, pd.DataFrame) and not frame.empty:
            df = df.merge(frame[["run_id", "policy_version", "pass_at_k"]].rename(columns={"pass_at_k": col}),
                          on=["run_id", "policy_version"], how="left")
    s.blocks.append(Plot("Success over policy versions", _lines(
        _series_by_run(df, "policy_version", {"success_rate": "success rate",
                                              "hard_constraint_pass_rate": "hard-constraint pass",
                                              "pass_at_1": "pass@1", f"pass_at_{o.pass_k}": f"pass@{o.pass_k}"}),
        title="Success over policy versions", xlabel="policy version", ylabel="rate", integer_x=True,
        ylim=(0, 1.02))))
    s.blocks.append(Plot("Reward over policy versions", _lines(
        _series_by_run(df, "policy_version", {"reward_mean": "reward mean", "reward_std": "reward std",
                                              "reward_length_corr": "corr(reward, length)"}),
        title="Reward over policy versions", xlabel="policy version", ylabel="reward", integer_x=True)))
    ot = _rows(q.get("quality_over_time", run_id=o.run_id, bucket=o.bucket), "over time")
    if isinstance(ot, pd.DataFrame):
        ot, hidden = _hide_sparse(ot, "valid_members", ["success_rate", "reward_mean"])
        s.blocks.append(Plot("Success and reward over time", _lines(
            _series_by_run(ot, "bucket", {"success_rate": "success rate", "reward_mean": "reward mean"}),
            title=f"Success and reward over time (per {o.bucket}, UTC){_sparse_note(hidden)}", xlabel="finished at",
            ylabel="rate")))
    comp = _rows(q.get("quality_components", run_id=o.run_id, bucket=o.bucket), "components")
    if isinstance(comp, pd.DataFrame):
        series = {}
        for (run, c), d in comp.groupby(["run_id", "component"]):
            label = c if comp.run_id.nunique() == 1 else f"{run}: {c}"
            d = d.sort_values("bucket")
            series[label] = (d.bucket.tolist(), d["mean"].tolist())
        s.blocks.append(Plot("Reward components over time", _lines(
            series, title=f"Reward components over time (mean per {o.bucket})", xlabel="finished at",
            ylabel="component value")))
    s.blocks.append(_table(df, caption="per policy version"))
    return s


def comparability(q: Queries) -> Section:
    s = Section("comparability", "Comparability",
                "Per policy version: groups with one configuration (policy, tokenizer, template, environment, "
                "verifier, temperature), zero-variance share, and the share of mixed / all-correct / all-wrong "
                "groups among groups with at least 2 valid members; the dashed line is the mixed rate expected "
                "if members succeeded independently: 1 - p^n - (1-p)^n (sql/comparability.sql).")
    df = _rows(q.get("comparability", run_id=q.opts.run_id), "trajectories")
    if isinstance(df, Note):
        s.blocks.append(df)
        return s
    cats = [f"v{v}" if df.run_id.nunique() == 1 else f"{r} v{v}" for r, v in zip(df.run_id, df.policy_version)]
    s.blocks.append(Plot("Group outcomes per policy version", _bars(
        cats, {"mixed": df.mixed_rate.tolist(), "all correct": df.all_correct_rate.tolist(),
               "all wrong": df.all_wrong_rate.tolist()},
        title="Group outcomes per policy version (share of scored groups)", ylabel="share", stacked=True)))
    s.blocks.append(Plot("Zero variance and consistency", _lines(
        _series_by_run(df, "policy_version", {"zero_variance_share": "zero-variance share",
                                              "mixed_rate": "mixed rate", "expected_mixed_rate": "expected mixed",
                                              "consistency_rate": "one configuration"}),
        title="Zero variance, mixed rate, consistency", xlabel="policy version", ylabel="share",
        integer_x=True, ylim=(0, 1.02), dashed=["expected mixed"])))
    s.blocks.append(_table(df, caption="per policy version"))
    return s


def efficiency(q: Queries) -> Section:
    o = q.opts
    s = Section("efficiency", "Efficiency",
                "Tokens, tool calls and turns per trajectory (sql/efficiency.sql); latency of generation, tool "
                "and verification from the events table (sql/efficiency_latency.sql); infrastructure failures "
                "and retries by cause (sql/efficiency_failures.sql).")
    df = _rows(q.get("efficiency", run_id=o.run_id), "trajectories")
    if isinstance(df, Note):
        s.blocks.append(df)
    else:
        s.blocks.append(Plot("Tokens per trajectory", _lines(
            _series_by_run(df, "policy_version", {"response_tokens_mean": "response mean",
                                                  "response_tokens_p95": "response p95",
                                                  "prompt_tokens_mean": "prompt mean"}),
            title="Tokens per trajectory", xlabel="policy version", ylabel="tokens", integer_x=True)))
        s.blocks.append(Plot("Tool calls and turns", _lines(
            _series_by_run(df, "policy_version", {"tool_calls_mean": "tool calls (mean)",
                                                  "turns_mean": "turns (mean)", "tool_calls_p95": "tool calls p95"}),
            title="Tool calls and turns per trajectory", xlabel="policy version", ylabel="count",
            integer_x=True)))
    lat = _rows(q.get("efficiency_latency", run_id=o.run_id), "events (latency)")
    if isinstance(lat, Note):
        s.blocks.append(lat)
    else:
        newest = lat[lat.policy_version == lat.policy_version.max()]
        agg = newest.groupby("phase")[["p50_ms", "p95_ms", "p99_ms"]].max().reindex(
            [p for p in ("generation", "tool", "verification") if p in set(newest.phase)])
        s.blocks.append(Plot("Latency by phase", _bars(
            list(agg.index), {"p50": agg.p50_ms.tolist(), "p95": agg.p95_ms.tolist(), "p99": agg.p99_ms.tolist()},
            title=f"Latency by phase, policy version {int(lat.policy_version.max())}", ylabel="ms")))
        series = {}
        for (run, phase), d in lat.groupby(["run_id", "phase"]):
            label = f"{phase} p95" if lat.run_id.nunique() == 1 else f"{run}: {phase} p95"
            series[label] = (d.policy_version.tolist(), d.p95_ms.tolist())
        s.blocks.append(Plot("p95 latency over policy versions", _lines(
            series, title="p95 latency over policy versions", xlabel="policy version", ylabel="ms",
            integer_x=True)))
    fail = _rows(q.get("efficiency_failures", run_id=o.run_id), "failures and retries")
    if isinstance(fail, Note):
        s.blocks.append(Note("failures and retries: none recorded yet.", "empty") if fail.kind == "empty" else fail)
    else:
        top = fail.sort_values("rate", ascending=False).head(12)
        labels = [f"{k}: {c}" if fail.run_id.nunique() == 1 else f"{r} {k}: {c}"
                  for r, k, c in zip(top.run_id, top.kind, top.cause)]
        s.blocks.append(Plot("Failures and retries by cause", _bars(
            labels, {"rate": top.rate.tolist()}, title="Infra failures and retries by cause", ylabel="rate",
            horizontal=True)))
        s.blocks.append(_table(fail, caption="failures and retries by cause"))
    if isinstance(df, pd.DataFrame) and not df.empty:
        s.blocks.append(_table(df, caption="per policy version"))
    return s


def freshness(q: Queries) -> Section:
    o = q.opts
    s = Section("freshness", "Freshness",
                "Queue wait and policy lag per generation policy version (sql/freshness.sql), the lag "
                "distribution at admission and at training (sql/freshness_lag.sql), and rejection rates by "
                "difficulty and length bucket from the receipts (sql/freshness_rejections.sql).")
    df = _rows(q.get("freshness", run_id=o.run_id), "trajectories")
    if isinstance(df, Note):
        s.blocks.append(df)
    else:
        s.blocks.append(Plot("Queue wait", _lines(
            _series_by_run(df, "policy_version", {"queue_wait_p50_ms": "queue wait p50",
                                                  "queue_wait_p95_ms": "queue wait p95"}),
            title="Queue wait per policy version", xlabel="policy version", ylabel="ms", integer_x=True)))
        if df.trained_members.sum() > 0:
            s.blocks.append(Plot("Training lag", _lines(
                _series_by_run(df, "policy_version", {"training_lag_mean": "lag mean",
                                                      "training_lag_p95": "lag p95",
                                                      "admission_lag_mean": "admission lag mean"}),
                title="Policy lag of trained data, by generation version", xlabel="policy version at generation",
                ylabel="versions behind", integer_x=True)))
    lag = _rows(q.get("freshness_lag", run_id=o.run_id), "lag distribution (snapshot_members, checkpoints)")
    if isinstance(lag, Note):
        s.blocks.append(lag)
    else:
        lags = sorted(lag.lag.unique())
        series = {}
        for kind, d in lag.groupby("kind"):
            share = d.groupby("lag").members.sum() / d.members.sum()
            series[kind] = [float(share.get(x, 0.0)) for x in lags]
        s.blocks.append(Plot("Lag distribution", _bars(
            [str(x) for x in lags], series, title="Policy-lag distribution", ylabel="share of members",
            xlabel="lag (versions)")))
    rej = _rows(q.get("freshness_rejections", run_id=o.run_id), "rejections (receipts)")
    if isinstance(rej, Note):
        s.blocks.append(rej)
    else:
        g = rej.groupby(["difficulty", "length_bucket"], dropna=False)[
            ["groups", "rejected_groups", "stale_excluded_members", "arrived_members"]].sum().reset_index()
        cats = [f"{d if isinstance(d, str) else '-'} / {b if isinstance(b, str) else '-'}"
                for d, b in zip(g.difficulty, g.length_bucket)]
        s.blocks.append(Plot("Rejection by bucket", _bars(
            cats, {"group rejection rate": (g.rejected_groups / g.groups).tolist(),
                   "stale member exclusion rate": (g.stale_excluded_members / g.arrived_members).tolist()},
            title="Rejection by difficulty / length bucket", ylabel="rate")))
        s.blocks.append(_table(rej, caption="by difficulty and length bucket"))
    if isinstance(df, pd.DataFrame) and not df.empty:
        s.blocks.append(_table(df, caption="per generation policy version"))
    return s


def receipts(q: Queries) -> Section:
    s = Section("receipts", "Latest receipts",
                "The newest admission decisions with member exclusion reasons and failed checks "
                "(sql/receipts_latest.sql).")
    df = _rows(q.get("receipts_latest", run_id=q.opts.run_id, limit=q.opts.receipts), "receipts")
    if isinstance(df, Note):
        s.blocks.append(df)
        return s
    df = df.assign(snapshot_id=df.snapshot_id.map(lambda x: x[:12] if isinstance(x, str) else None))
    from pipeline.report.alerts import reverification

    rv = reverification(q)
    if rv is not None:   # admission re-verified rewards (reverify_top / shadow_sample)
        s.blocks.append(Note(
            f"Re-verification: {rv['reverified']} of {rv['decided']} decided groups re-verified, "
            f"{rv['shadow']} of them in the shadow verifier sample (rate {rv['shadow_rate']:.1%} of decided "
            f"groups); {rv['disagreed']} disagreed (disagreement rate {rv['disagreement_rate']:.1%}) and are "
            f"held as UNKNOWN (decision verdict_disagreement).", "info"))
    s.blocks.append(_table(df, ["decided_at", "run_id", "group_id", "task_id", "decision", "arrived_members",
                                "valid", "reasons", "failed_checks", "reward_mean", "reward_std", "policy_lag",
                                "difficulty", "length_bucket", "snapshot_id"]))
    return s


def lineage(q: Queries) -> Section:
    s = Section("lineage", "Lineage of the newest checkpoint",
                "What the newest checkpoint trained on: snapshots, groups, tasks and the versions the data was "
                "generated with (sql/lineage.sql, sql/lineage_summary.sql); and the checkpoint chain.")
    summ = _rows(q.get("lineage_summary"), "checkpoints")
    if isinstance(summ, Note):
        s.blocks.append(summ)
        return s
    newest = summ.sort_values(["policy_version", "created_at"]).iloc[-1]
    s.blocks.append(Table(["field", "value"], [[k, _py(newest[k])] for k in summ.columns],
                          caption=f"checkpoint {newest.checkpoint_id}"))
    rows = _rows(q.get("lineage", checkpoint_id=newest.checkpoint_id), "trajectories behind it")
    if isinstance(rows, Note):
        s.blocks.append(rows)
    else:
        g = rows.groupby(["snapshot_id", "run_id", "policy_version", "env_version", "verifier_version"],
                         dropna=False).agg(trajectories=("trajectory_id", "nunique"), groups=("group_id", "nunique"),
                                           tasks=("task_id", "nunique"), reward_mean=("reward", "mean")).reset_index()
        g["snapshot_id"] = g.snapshot_id.str.slice(0, 12)
        s.blocks.append(_table(g, caption="members by snapshot and generation versions"))
    if len(summ) > 1:
        s.blocks.append(Plot("Checkpoint chain", _bars(
            [f"{c} (v{v})" for c, v in zip(summ.checkpoint_id, summ.policy_version)],
            {"trajectories": summ.trajectories.tolist(), "groups": summ.groups.tolist()},
            title="Data behind each checkpoint", ylabel="count")))
    s.blocks.append(_table(summ, ["checkpoint_id", "parent_checkpoint_id", "policy_version", "created_at",
                                  "snapshots", "groups", "trajectories", "tasks", "policy_versions"],
                           caption="every checkpoint"))
    return s


def training(q: Queries) -> Section:
    s = Section("training", "Training metrics",
                "Per optimizer step, across training runs in the order their checkpoints were published "
                "(sql/training.sql over the metrics table the trainer writes).")
    df = _rows(q.get("training"), "metrics")
    if isinstance(df, Note):
        s.blocks.append(df)
        return s
    groups: tuple[tuple[str, dict[str, str], str], ...]   # (title, {column: line label}, y axis label)
    groups = (("Loss", {"loss": "loss", "pg_loss": "policy-gradient loss"}, "loss"),
              ("Reward and policy lag", {"reward_mean": "reward mean", "policy_lag": "policy lag (mean)"}, "value"),
              ("KL and entropy", {"kl": "KL(pi || ref)", "approx_kl": "KL(old || pi)", "entropy": "entropy"},
               "nats"),
              ("Clipping and padding", {"clip_fraction": "clip fraction", "padding_ratio": "padding ratio"}, "share"),
              ("Throughput", {"tokens_per_s": "tokens/s"}, "tokens/s"))
    groups += (("Gradient norm", {"grad_norm": "grad norm (before clipping)"}, "norm"),
               ("Learning rate", {"lr": "learning rate"}, "lr"),
               ("Importance ratio quantiles", {"ratio_p05": "p05", "ratio_p50": "p50", "ratio_p95": "p95"}, "ratio"),
               ("Engine/trainer mismatch", {"mismatch_kl": "mismatch_kl (rollout vs trainer log-probs)"}, "nats"),
               ("Clip high vs clip low", {"clip_frac_high": "clipped above (ratio > 1 + clip_high)",
                                          "clip_frac_low": "clipped below (ratio < 1 - clip_low)"}, "share"),
               ("Advantage", {"advantage_mean": "advantage mean per step"}, "advantage"),
               ("Importance-sampling ESS vs the behaviour policy",
                {"ess_token_frac": "ESS/n, token-level", "ess_seq_frac": "ESS/n, sequence-level"}, "ESS / n"),
               ("Ratio tail vs the behaviour policy",
                {"behav_ratio_p50": "p50", "behav_ratio_p90": "p90", "behav_ratio_p99": "p99",
                 "behav_ratio_max": "max"}, "pi / mu"))
    xcol, xlabel, per = {"time": ("elapsed_s", "seconds since the run's first step", "over wall time"),
                         "samples": ("samples", "trajectories trained on (per run)", "over samples")}.get(
        q.opts.train_x, ("step", "step (across runs)", "per step"))
    multi = xcol != "step" and df.checkpoint_id.nunique() > 1
    # where each training run (checkpoint) begins on the shared step axis: dotted lines labelled v<version>
    starts = df.groupby("checkpoint_id", sort=False).agg(x=(xcol, "min"), v=("policy_version", "first"))
    bounds = [] if multi or len(starts) < 2 else [(r.x, f"v{int(r.v)}") for r in starts.itertuples()]
    for title, cols, ylabel in groups:
        series = {}
        for c, name in cols.items():
            if c not in df or not df[c].notna().any():
                continue
            if multi:   # wall time and samples restart with every run: one line per run
                for ck, g in df.groupby("checkpoint_id", sort=False):
                    series[f"{name} ({ck})"] = (g[xcol].tolist(), g[c].tolist())
            else:
                series[name] = (df[xcol].tolist(), df[c].tolist())
        if series:
            s.blocks.append(Plot(title if xcol == "step" else f"{title} {per}",
                                 _lines(series, title=f"{title} {per}", xlabel=xlabel, boundaries=bounds,
                                        ylabel=ylabel, integer_x=xcol != "elapsed_s")))
    adv = q.sql("SELECT advantage FROM snapshot_members")
    if isinstance(adv, pd.DataFrame) and not adv.empty:
        import numpy as np

        counts, edges = np.histogram(adv.advantage.dropna().to_numpy(), bins=20)
        s.blocks.append(Plot("Advantage distribution", _bars(
            [f"{(a + b) / 2:.2f}" for a, b in zip(edges[:-1], edges[1:])], {"members": counts.tolist()},
            title="Advantage distribution (admitted snapshot members)", ylabel="members", xlabel="advantage")))
    last = df.groupby("checkpoint_id", sort=False).agg(
        policy_version=("policy_version", "first"), steps=("global_step", "size"), loss=("loss", "last"),
        reward_mean=("reward_mean", "last"), kl=("kl", "last"), tokens_per_s=("tokens_per_s", "mean")).reset_index()
    s.blocks.append(_table(last, caption="per training run (last step; mean tokens/s)"))
    return s


def evaluation(q: Queries) -> Section:
    s = Section("evaluation", "Held-out evaluation",
                "Success on the environment's held-out split per policy version, one curve per evaluation setting "
                "(sql/eval_curve.sql over the evaluations table written by pipeline policy eval and the demo).")
    df = _rows(q.get("eval_curve"), "evaluations")
    if isinstance(df, Note):
        s.blocks.append(df)
        return s
    series: dict[str, tuple[list, list]] = {}
    keys = ["env", "split", "n", "seed", "samples", "temperature"]
    settings = df[keys].drop_duplicates().to_dict("records")
    for st in settings:
        d = df
        for k in keys:
            d = d[d[k] == st[k]]
        d = d.sort_values("policy_version")
        label = f"{st['env']} n={st['n']}" + (f" x{st['samples']}" if st["samples"] > 1 else "")
        if len(settings) == 1:
            label = "success"
        series[label] = (d.policy_version.tolist(), d.success.tolist())
        if st["samples"] > 1:
            series[f"{label} pass@{st['samples']}"] = (d.policy_version.tolist(), d.pass_at_max.tolist())
    s.blocks.append(Plot("Eval curve", _lines(series, title="Held-out success per policy version",
                                              xlabel="policy version", ylabel="success", integer_x=True)))
    s.blocks.append(_table(df, ["env", "n", "samples", "policy_version", "checkpoint_id", "success", "pass_at_max",
                                "reward_mean", "format_rate", "tool_use_rate", "evaluated_at"],
                           caption="every evaluation (newest per version and setting)"))
    return s


def rollout(q: Queries) -> Section:
    o = q.opts
    s = Section("rollout", "Rollout health",
                "Response length and truncation (share stopped at the length limit) per policy version "
                "(sql/rollout_lengths.sql), throughput over time (sql/rollout_throughput.sql), success per task "
                "difficulty over versions (sql/success_by_difficulty.sql), the engine's busy share and the waits "
                "per stage of the streaming harness (sql/rollout_engine.sql), and where the wall time goes "
                "(rollout / admit / train, from the jobs' OpenLineage START and COMPLETE events).")
    ln = _rows(q.get("rollout_lengths", run_id=o.run_id), "trajectories")
    if isinstance(ln, Note):
        s.blocks.append(ln)
    else:
        s.blocks.append(Plot("Response length", _lines(
            _series_by_run(ln, "policy_version", {"response_len_mean": "mean", "response_len_p95": "p95",
                                                  "response_len_max": "max"}),
            title="Response length per policy version", xlabel="policy version", ylabel="tokens", integer_x=True)))
        s.blocks.append(Plot("Truncation rate", _lines(
            _series_by_run(ln, "policy_version", {"truncation_rate": "truncation rate"}),
            title="Share of responses cut at the length limit", xlabel="policy version", ylabel="share",
            integer_x=True, ylim=(0, 1.02))))
        tp = _rows(q.get("rollout_throughput", run_id=o.run_id, bucket=o.bucket), "throughput")
        if isinstance(tp, pd.DataFrame):
            tp, hidden = _hide_sparse(tp, "trajectories", ["tokens_per_s"])
            s.blocks.append(Plot("Rollout throughput", _lines(
                _series_by_run(tp, "bucket", {"tokens_per_s": "response tokens/s"}),
                title=f"Rollout throughput (per {o.bucket}, UTC){_sparse_note(hidden)}", xlabel="finished at",
                ylabel="tokens/s")))
        sd = _rows(q.get("success_by_difficulty", run_id=o.run_id), "difficulty")
        if isinstance(sd, pd.DataFrame):
            series = {str(d): (g.policy_version.tolist(), g.success_rate.tolist())
                      for d, g in sd.sort_values("policy_version").groupby("difficulty")}
            s.blocks.append(Plot("Success by difficulty", _lines(
                series, title="Success per difficulty over policy versions", xlabel="policy version",
                ylabel="success rate", integer_x=True, ylim=(0, 1.02))))
    eng = _rows(q.get("rollout_engine", run_id=o.run_id), "engine (events)")
    if isinstance(eng, Note):
        if eng.kind == "error":
            s.blocks.append(eng)
    elif eng.engine_calls.notna().any():       # events of the streaming harness (harness/2) only
        eng = eng[eng.engine_calls.notna()]
        s.blocks.append(Plot("Engine busy share", _bars(
            [str(r) for r in eng.run_id], {"busy share": [float(x) for x in eng.busy_share.fillna(0.0)]},
            title="Engine busy share of the workers' wall time, per run", ylabel="share")))
        s.blocks.append(_table(eng, ["run_id", "workers", "episodes", "engine_calls", "engine_busy_s", "wall_s",
                                     "busy_share", "queue_p50_ms", "queue_p95_ms", "tool_p50_ms", "tool_p95_ms",
                                     "verify_p50_ms", "verify_p95_ms", "injected_tool_ms"],
                               caption="engine time and waits per stage (ms), per run (sql/rollout_engine.sql)"))
    tb = time_breakdown(q.lake)
    if tb:
        s.blocks.append(Plot("Time breakdown", _bars(
            list(tb), {"seconds": [v["seconds"] for v in tb.values()]},
            title="Wall time per job (completed runs)", ylabel="seconds")))
        s.blocks.append(Table(["job", "runs", "seconds", "failed"],
                              [[k, v["runs"], round(v["seconds"], 3), v["failed"]] for k, v in tb.items()],
                              "from the OpenLineage events of the lake"))
    return s


def time_breakdown(lake: Lake) -> dict[str, dict[str, Any]]:
    """job -> runs, seconds (START to COMPLETE), failed runs, from the lake's lineage events."""
    from pipeline.lineage import read_events

    try:
        events = read_events(lake)
    except Exception:
        return {}
    starts: dict[str, datetime] = {}
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        rid, job, t = e.get("run", {}).get("runId"), e.get("job", {}).get("name", "?"), e.get("eventTime")
        if not isinstance(t, str):
            continue
        try:
            ts = datetime.fromisoformat(t)
        except ValueError:
            continue
        name = job.removeprefix("pipeline.")
        if e.get("eventType") == "START":
            starts[rid] = ts
        elif e.get("eventType") in ("COMPLETE", "FAIL") and rid in starts:
            d = out.setdefault(name, {"runs": 0, "seconds": 0.0, "failed": 0})
            d["runs"] += 1
            d["seconds"] += (ts - starts.pop(rid)).total_seconds()
            d["failed"] += e["eventType"] == "FAIL"
    return dict(sorted(out.items()))


BUCKETS = ("second", "minute", "hour", "day", "week")
MIN_PER_BUCKET = 20     # trajectories a typical time bucket holds at least, or the next coarser one is used


def choose_bucket(lake: Lake) -> str:
    """The time bucket that gives the over-time plots a usable number of points
    for the span of the data (finished_at of the trajectories), coarser while the
    median bucket holds fewer than ``MIN_PER_BUCKET`` trajectories and the coarser
    one still gives two points or more: a short run's per-second buckets of a few
    trajectories each drew success rates zig-zagging to 0."""
    from pipeline.query.duck import query

    try:
        r = query(lake, "SELECT epoch(max(finished_at)) - epoch(min(finished_at)) AS span FROM trajectories")
        span = r.column("span")[0].as_py()
    except Exception:
        span = None
    if span is None:
        return "hour"
    if span <= 15 * 60:
        bucket = "second" if span <= 120 else "minute"
    elif span <= 2 * 86400:
        bucket = "minute" if span <= 3 * 3600 else "hour"
    else:
        bucket = "day" if span <= 120 * 86400 else "week"
    parts = " UNION ALL ".join(
        f"SELECT '{b}' AS b, date_trunc('{b}', finished_at) AS k, count(*) AS n FROM trajectories "
        f"WHERE finished_at IS NOT NULL GROUP BY 2" for b in BUCKETS[BUCKETS.index(bucket):])
    stats = {row["b"]: (row["buckets"], row["med"]) for row in query(
        lake, f"SELECT b, count(*) AS buckets, median(n) AS med FROM ({parts}) GROUP BY b").to_pylist()}
    i = BUCKETS.index(bucket)
    while (i + 1 < len(BUCKETS) and stats.get(BUCKETS[i], (0, 0))[1] < MIN_PER_BUCKET
           and stats.get(BUCKETS[i + 1], (0, 0))[0] >= 2):
        i += 1
    return BUCKETS[i]


SECTIONS: tuple[Callable[[Queries], Section], ...] = (
    alerts, overview, quality, comparability, efficiency, freshness, receipts, lineage, training, rollout,
    evaluation)


# -- plotting wrappers: an empty series gives no plot ---------------------------------------------


def _lines(series, **kw) -> str:
    from pipeline.report import plots

    return plots.lines(series, **kw)


def _bars(categories, series, **kw) -> str:
    from pipeline.report import plots

    return plots.bars(categories, series, **kw)


# -- entry point ------------------------------------------------------------------------------------


def build_report(lake: Lake | str | os.PathLike[str], opts: ReportOptions = DEFAULT_OPTIONS) -> tuple[str, dict[str, Any]]:
    """The HTML page and a summary (sections, plots, notes)."""
    lake = as_lake(lake)
    import dataclasses

    if opts.bucket == "auto":
        opts = dataclasses.replace(opts, bucket=choose_bucket(lake))
    q = Queries(lake, opts)
    sections = []
    for fn in SECTIONS:
        try:
            sections.append(fn(q))
        except Exception as exc:  # a bug in one section still leaves a readable report
            sections.append(Section(fn.__name__, fn.__name__.title(), "",
                                    [Note(f"section failed: {type(exc).__name__}: {exc}", "error")]))
    meta = [f"lake: {lake.uri}", f"run: {opts.run_id or 'every run'}",
            f"generated: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M:%S UTC')}"]
    page = render("Rollout health report", meta, sections)
    blocks = [b for s in sections for b in s.blocks]
    summary = {
        "sections": len(sections),
        "plots": sum(isinstance(b, Plot) for b in blocks),
        "tables": sum(isinstance(b, Table) for b in blocks),
        "no_data": [b.text for b in blocks if isinstance(b, Note) and b.kind == "empty"],
        "errors": [b.text for b in blocks if isinstance(b, Note) and b.kind == "error"],
        "alerts": [b.text for b in blocks if isinstance(b, Note) and b.kind == "alert"],
        "alert_checks": [{"check": b.check, "message": b.text} for b in blocks if isinstance(b, Note) and b.kind == "alert"],
        "bucket": opts.bucket,
    }
    return page, summary


def write_report(lake: Lake | str | os.PathLike[str], out: str | Path,
                 opts: ReportOptions = DEFAULT_OPTIONS) -> dict[str, Any]:
    lake = as_lake(lake)
    page, summary = build_report(lake, opts)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return {"out": str(path.resolve()), "bytes": path.stat().st_size, **summary}
