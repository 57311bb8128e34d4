"""Every health query in sql/ equals the same numbers computed independently
in pandas/numpy from the raw rows (fast-equals-reference), on a real Delta
lake holding every table the queries read."""

from __future__ import annotations

import re
from collections import deque

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline.query.duck import declared_params, query
from pipeline.query.metrics import mean_pass_at_k, mixed_group_probability
from pipeline.resources import resource_dir, sql_path

HEALTH_QUERIES = (
    "comparability", "comparability_groups", "efficiency", "efficiency_latency", "efficiency_failures",
    "quality", "quality_over_time", "quality_components", "quality_pass_at_k",
    "freshness", "freshness_lag", "freshness_rejections", "lineage", "lineage_summary", "lineage_trajectory",
    "receipts_latest", "training", "eval_curve", "rollout_lengths", "rollout_throughput", "success_by_difficulty",
    "diag_component_variance", "diag_group_diversity", "diag_quantiles", "diag_token_shares", "diag_truncation",
    "diag_advantage_extremes",
)
KEYS = ["run_id", "policy_version"]


def views() -> dict[str, pa.Table]:
    """The non-lake view the diagnostics read, as the report and `pipeline sql` pass it."""
    from pipeline.rollout.envs.base import component_tags_table

    return {"component_tags": component_tags_table()}


def run_named(lake, name: str, **params) -> pd.DataFrame:
    return query(lake, sql_path(name).read_text(), params=params, views=views()).to_pandas()


def _edge_rows() -> pa.Table:
    """Groups the synthetic fleet lacks: a group spanning two policy versions,
    one mixing temperatures, one of equal non-binary PASS rewards (zero
    variance, all correct), one with a single valid member, 8-member groups
    with infra failures for pass@k with uneven n."""
    from pipeline.lake.contenthash import content_hashes
    from pipeline.testing.trajectories import make_trajectories

    t = make_trajectories(40, seed=11, group_size=8, run_id="run-a", policy_version=1, id_prefix="edge-",
                          median_len=20, reward_p=0.4, with_hash=False)
    n = t.num_rows
    pv = np.full(n, 1, np.int64)
    pv[[0, 1]] = 0                       # group 0 spans versions 0 and 1 (oldest: 0)
    temp = np.ones(n)
    temp[9] = 0.7                         # group 1 mixes temperatures
    reward = t.column("reward").to_numpy().copy()
    verdict = np.asarray(t.column("verdict").to_numpy(zero_copy_only=False), dtype=object)
    status = np.array(["ACCEPTED"] * n, dtype=object)
    reward[16:24] = 0.5                   # group 2: all PASS with reward 0.5
    verdict[16:24] = "PASS"
    status[25:32] = "INFRA_FAILED"        # group 3: one valid member left
    verdict[25:32] = "ENV_ERROR"
    status[33:35] = "EXPIRED"             # group 4: six valid members
    verdict[33:35] = "UNKNOWN"
    null_reward = status != "ACCEPTED"
    repl = {
        "policy_version": pa.array(pv),
        "temperature": pa.array(temp),
        "reward": pa.array(np.where(null_reward, 0.0, reward), mask=null_reward),
        "verdict": pa.array(verdict.astype(str)),
        "status": pa.array(status.astype(str)),
    }
    for name, col in repl.items():
        i = t.schema.get_field_index(name)
        t = t.set_column(i, t.schema.field(name), col.cast(t.schema.field(name).type))
    i = t.schema.get_field_index("content_hash")
    return t.set_column(i, pa.field("content_hash", pa.string()), content_hashes(t))


@pytest.fixture(scope="module")
def health(tmp_path_factory):
    from pipeline.lake.delta import Lake
    from pipeline.lake.ingest import stamp_derived
    from pipeline.testing.health_lake import HealthLakeSpec, build_health_lake

    lake = Lake(tmp_path_factory.mktemp("health") / "lake")
    build_health_lake(lake, HealthLakeSpec(trajectories_per_version=160, versions=3, runs=("run-a", "run-b"),
                                           chunk=100, event_episodes=300))
    lake.append("trajectories", stamp_derived(_edge_rows(), "edge"), command="test", app_id="edge", txn_version=0)
    cols = ["trajectory_id", "group_id", "run_id", "task_id", "task_version", "policy_version", "tokenizer_rev",
            "prompt_template_rev", "harness_version", "env_version", "verifier_version", "temperature", "status",
            "verdict", "stop_reason", "reward", "reward_components", "num_turns", "num_tool_calls", "created_at",
            "finished_at", "queue_wait_ms", "group_size"]
    t = lake.read("trajectories", columns=cols + ["response_ids", "prompt_ids"])
    df = t.select(cols).to_pandas()
    df["response_tokens"] = pc.list_value_length(t.column("response_ids")).to_numpy()
    df["prompt_tokens"] = pc.list_value_length(t.column("prompt_ids")).to_numpy()
    df["valid"] = (~df.status.isin(["INFRA_FAILED", "EXPIRED"])) & df.verdict.isin(["PASS", "FAIL"]) \
        & df.reward.notna()
    df["passed"] = df.valid & (df.verdict == "PASS")
    tables = {name: lake.read(name).to_pandas()
              for name in ("events", "receipts", "snapshot_members", "checkpoints", "metrics")}
    return lake, df, tables


def assert_same(got: pd.DataFrame, want: pd.DataFrame, keys: list[str], *, rtol: float = 1e-9) -> None:
    """Same key set and, per key, every column of ``want`` equal (floats within rtol; NaN == None)."""
    assert len(got) > 0, "query returned no rows: the comparison would prove nothing"
    got = got.sort_values(keys).reset_index(drop=True)
    want = want.sort_values(keys).reset_index(drop=True)
    assert len(got) == len(want), f"{len(got)} rows vs {len(want)} expected"
    for c in want.columns:
        a, b = got[c].to_numpy(), want[c].to_numpy()
        if c in keys or b.dtype == object:
            assert [None if _isnan(x) else x for x in a] == [None if _isnan(x) else x for x in b], c
        else:
            np.testing.assert_allclose(a.astype(float), b.astype(float), rtol=rtol, atol=1e-12, equal_nan=True,
                                       err_msg=c)


def _isnan(x) -> bool:
    return x is None or (isinstance(x, float) and np.isnan(x))


# -- headers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HEALTH_QUERIES)
def test_header_documents_summary_parameters_and_every_column(health, name):
    lake = health[0]
    text = sql_path(name).read_text()
    lines = text.splitlines()
    assert lines[0].startswith("-- ") and len(lines[0]) > 20, "first line: a one-line summary"
    header = "\n".join(ln for ln in lines if ln.startswith("--"))
    assert "Answers:" in header and "Parameters:" in header and "Columns:" in header
    used = set(re.findall(r"\$([A-Za-z_]\w*)", re.sub(r"--[^\n]*", "", text)))
    declared = set(re.findall(r"@param\s+(\w+)", header))
    assert used == declared, "every $parameter is declared with -- @param (and nothing else)"
    params = {"trajectory_id": "x"} if name == "lineage_trajectory" else {}
    cols = query(lake, text, params=params, views=views()).column_names
    for c in cols:
        assert re.search(rf"\b{re.escape(c)}\b", header), f"column {c} is not documented in the header"


def test_declared_params_parse():
    sql = "-- @param a = NULL\n-- @param b = 'x y'\n-- @param c = 3\n-- @param d = 1.5\n-- @param e\nSELECT 1"
    assert declared_params(sql) == {"a": None, "b": "x y", "c": 3, "d": 1.5}


@pytest.mark.parametrize("name", HEALTH_QUERIES)
def test_runs_on_an_empty_lake(lake, name):
    params = {"trajectory_id": "x"} if name == "lineage_trajectory" else {}
    out = query(lake, sql_path(name).read_text(), params=params, views=views())
    assert out.num_rows == 0


# -- comparability ----------------------------------------------------------------------------------


def _groups(df: pd.DataFrame) -> pd.DataFrame:
    v = df[df.valid]
    g = df.groupby(["run_id", "group_id"]).agg(
        policy_version=("policy_version", "min"), n_policy=("policy_version", "nunique"),
        n_env=("env_version", "nunique"), n_ver=("verifier_version", "nunique"),
        n_tok=("tokenizer_rev", "nunique"), n_tmpl=("prompt_template_rev", "nunique"),
        n_temp=("temperature", "nunique"), n_valid=("valid", "sum"), n_pass=("passed", "sum"),
        members=("trajectory_id", "size"), task_id=("task_id", "min"), group_size=("group_size", "max"))
    r = v.groupby(["run_id", "group_id"]).reward.agg(["min", "max"])
    g = g.join(r).reset_index()
    g["consistent"] = (g.n_policy == 1) & (g.n_env == 1) & (g.n_ver == 1) & (g.n_tok == 1) & (g.n_tmpl == 1) \
        & (g.n_temp == 1)
    g["scored"] = g.n_valid >= 2
    return g


def test_comparability_equals_reference(health):
    lake, df, _ = health
    g = _groups(df)
    rows = []
    for (run, ver), x in g.groupby(["run_id", "policy_version"]):
        s = x[x.scored]
        p = s.n_pass.sum() / s.n_valid.sum()
        rows.append({
            "run_id": run, "policy_version": ver, "groups": len(x), "consistent_groups": int(x.consistent.sum()),
            "consistency_rate": x.consistent.mean(), "policy_mixed_groups": int((x.n_policy > 1).sum()),
            "env_mixed_groups": int((x.n_env > 1).sum()), "verifier_mixed_groups": int((x.n_ver > 1).sum()),
            "other_mixed_groups": int(((x.n_tok > 1) | (x.n_tmpl > 1) | (x.n_temp > 1)).sum()),
            "scored_groups": len(s),
            "zero_variance_share": (s["max"] == s["min"]).mean(),
            "mixed_rate": ((s.n_pass > 0) & (s.n_pass < s.n_valid)).mean(),
            "all_correct_rate": (s.n_pass == s.n_valid).mean(),
            "all_wrong_rate": (s.n_pass == 0).mean(),
            "success_rate": p,
            "expected_mixed_rate": float(np.mean(mixed_group_probability(p, s.n_valid.to_numpy()))),
        })
    want = pd.DataFrame(rows)
    got = run_named(lake, "comparability")
    assert_same(got, want, KEYS)
    # the edge groups are really in there
    a1 = got[(got.run_id == "run-a") & (got.policy_version == 0)].iloc[0]
    assert a1.policy_mixed_groups == 1
    assert got.env_mixed_groups.sum() > 0 and got.verifier_mixed_groups.sum() > 0 and got.other_mixed_groups.sum() > 0
    assert run_named(lake, "comparability", run_id="run-b").run_id.unique().tolist() == ["run-b"]


def test_comparability_groups_equals_reference(health):
    lake, df, _ = health
    g = _groups(df)
    outcome = np.where(g.n_valid < 2, "too_few", np.where(g.n_pass == g.n_valid, "all_correct",
                                                          np.where(g.n_pass == 0, "all_wrong", "mixed")))
    want = pd.DataFrame({
        "run_id": g.run_id, "group_id": g.group_id, "task_id": g.task_id, "members": g.members,
        "valid_members": g.n_valid, "passes": g.n_pass, "policy_versions": g.n_policy, "env_versions": g.n_env,
        "verifier_versions": g.n_ver, "temperatures": g.n_temp, "consistent": g.consistent.astype(object),
        "zero_variance": [bool(a == b) if s else None for a, b, s in zip(g["max"], g["min"], g.scored)],
        "outcome": outcome.astype(object),
    })
    assert_same(run_named(lake, "comparability_groups"), want, ["run_id", "group_id"])
    bad = run_named(lake, "comparability_groups", inconsistent_only=1)
    assert set(bad.group_id) == set(g.group_id[~g.consistent]) and len(bad) > 0
    edge = run_named(lake, "comparability_groups", run_id="run-a").set_index("group_id")
    assert edge.loc["edge-11-g2", "outcome"] == "all_correct" and edge.loc["edge-11-g2", "zero_variance"]
    assert edge.loc["edge-11-g3", "outcome"] == "too_few"


# -- efficiency -------------------------------------------------------------------------------------


def test_efficiency_equals_reference(health):
    lake, df, _ = health
    df = df.assign(duration=(df.finished_at - df.created_at).dt.total_seconds())
    rows = []
    for (run, ver), x in df.groupby(KEYS):
        rows.append({
            "run_id": run, "policy_version": ver, "trajectories": len(x),
            "response_tokens_mean": x.response_tokens.mean(),
            "response_tokens_p50": np.percentile(x.response_tokens, 50),
            "response_tokens_p95": np.percentile(x.response_tokens, 95),
            "prompt_tokens_mean": x.prompt_tokens.mean(),
            "tool_calls_mean": x.num_tool_calls.mean(), "tool_calls_p95": np.percentile(x.num_tool_calls, 95),
            "turns_mean": x.num_turns.mean(), "turns_p95": np.percentile(x.num_turns, 95),
            "duration_s_p50": np.percentile(x.duration, 50), "duration_s_p95": np.percentile(x.duration, 95),
            "infra_failed_rate": (x.status == "INFRA_FAILED").mean(), "expired_rate": (x.status == "EXPIRED").mean(),
            "env_error_rate": x.verdict.isin(["ENV_ERROR", "UNKNOWN"]).mean(),
            "no_reward_rate": x.reward.isna().mean(),
        })
    assert_same(run_named(lake, "efficiency"), pd.DataFrame(rows), KEYS)


ORDER = ["CREATED", "GENERATING", "TOOL_WAITING", "ACTION_COMMITTED", "ACTION_EXECUTED",
         "OBSERVATION_PERSISTED", "VERIFYING", "TERMINAL"]


def _spans(ev: pd.DataFrame) -> pd.DataFrame:
    ev = ev.assign(rank=ev.event_type.map(ORDER.index))
    ev = ev.sort_values(["episode_id", "created_at", "step_id", "rank", "action_id"])
    nxt = ev.groupby("episode_id").created_at.shift(-1)
    ev = ev.assign(span_ms=(nxt - ev.created_at).dt.total_seconds() * 1e3)
    phase = {"GENERATING": "generation", "ACTION_COMMITTED": "tool", "VERIFYING": "verification"}
    ev = ev[ev.event_type.isin(phase) & ev.span_ms.notna()]
    return ev.assign(phase=ev.event_type.map(phase))


def test_efficiency_latency_equals_reference(health):
    lake, _, tables = health
    sp = _spans(tables["events"])
    rows = []
    for (run, ver, ph), x in sp.groupby(["run_id", "policy_version", "phase"]):
        s = x.span_ms.to_numpy()
        rows.append({"run_id": run, "policy_version": ver, "phase": ph, "spans": len(s), "mean_ms": s.mean(),
                     "p50_ms": np.percentile(s, 50), "p95_ms": np.percentile(s, 95), "p99_ms": np.percentile(s, 99),
                     "max_ms": s.max()})
    assert_same(run_named(lake, "efficiency_latency"), pd.DataFrame(rows), ["run_id", "policy_version", "phase"],
                rtol=1e-6)


def test_efficiency_latency_by_hand(lake):
    """One episode, times in ms: CREATED 0, GENERATING 0 (same instant: lifecycle order decides),
    TOOL_WAITING 200, ACTION_COMMITTED 201, ACTION_EXECUTED 251, OBSERVATION_PERSISTED 260,
    GENERATING 260 (step 1), VERIFYING 400, TERMINAL 430.
    generation spans: 200 (step 0), 140 (step 1); tool 50; verification 30."""
    from datetime import datetime, timedelta, timezone

    from pipeline.schema import table_spec

    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    ev = [("CREATED", 0, "", 0), ("GENERATING", 0, "", 0), ("TOOL_WAITING", 0, "a", 200),
          ("ACTION_COMMITTED", 0, "a", 201), ("ACTION_EXECUTED", 0, "a", 251), ("OBSERVATION_PERSISTED", 0, "a", 260),
          ("GENERATING", 1, "", 260), ("VERIFYING", 1, "", 400), ("TERMINAL", 1, "", 430)]
    rows = [{"episode_id": "e1", "step_id": s, "action_id": a, "event_type": e, "run_id": "r", "group_id": "g",
             "worker_id": "w", "policy_version": 3, "state": None, "payload": None,
             "created_at": t0 + timedelta(milliseconds=ms)} for e, s, a, ms in reversed(ev)]
    lake.append("events", pa.Table.from_pylist(rows, schema=table_spec("events").arrow_schema()), command="test")
    got = run_named(lake, "efficiency_latency").set_index("phase")
    assert got.loc["generation", "spans"] == 2
    assert got.loc["generation", "p50_ms"] == pytest.approx(170.0)   # median of 200 and 140
    assert got.loc["generation", "max_ms"] == pytest.approx(200.0)
    assert got.loc["tool", "p99_ms"] == pytest.approx(50.0)
    assert got.loc["verification", "mean_ms"] == pytest.approx(30.0)


def test_efficiency_failures_equals_reference(health):
    lake, df, tables = health
    rows = []
    for run, x in df.groupby("run_id"):
        f = x[x.status.isin(["INFRA_FAILED", "EXPIRED"]) | x.verdict.isin(["ENV_ERROR", "UNKNOWN"]) | x.reward.isna()]
        for cause, y in f.groupby(f.status + "/" + f.verdict + "/" + f.stop_reason):
            rows.append({"run_id": run, "kind": "infra_failure", "cause": cause, "n": len(y),
                         "denominator": len(x), "rate": len(y) / len(x)})
    ev = tables["events"]
    for run, e in ev.groupby("run_id"):
        eps = e.episode_id.nunique()
        counts = {
            "resumed_episode": int((e.groupby("episode_id").worker_id.nunique() > 1).sum()),
            "unconfirmed_action": len(set(map(tuple, e[e.event_type == "ACTION_COMMITTED"][
                ["episode_id", "step_id", "action_id"]].to_numpy().tolist())) - set(map(tuple, e[
                    e.event_type == "ACTION_EXECUTED"][["episode_id", "step_id", "action_id"]].to_numpy().tolist()))),
        }
        for et, cause in (("GENERATING", "repeated_generation"), ("VERIFYING", "repeated_verification")):
            k = e[e.event_type == et].groupby(["episode_id", "step_id"]).size()
            counts[cause] = int((k[k > 1] - 1).sum())
        for cause, n in counts.items():
            if n:
                rows.append({"run_id": run, "kind": "retry", "cause": cause, "n": n, "denominator": eps,
                             "rate": n / eps})
    want = pd.DataFrame(rows)
    assert {"resumed_episode", "unconfirmed_action"} <= set(want.cause)
    assert_same(run_named(lake, "efficiency_failures"), want, ["run_id", "kind", "cause"])


# -- quality ----------------------------------------------------------------------------------------


def test_quality_equals_reference(health):
    lake, df, _ = health
    v = df[df.valid]
    rows = []
    for (run, ver), x in df.groupby(KEYS):
        y = v[(v.run_id == run) & (v.policy_version == ver)]
        fmt = np.array([dict(c).get("format") if c is not None else None for c in y.reward_components], dtype=float)
        has = ~np.isnan(fmt)
        corr = np.corrcoef(y.reward, y.response_tokens)[0, 1] if y.reward.std() > 0 else np.nan
        rows.append({"run_id": run, "policy_version": ver, "trajectories": len(x), "valid_members": len(y),
                     "success_rate": (y.verdict == "PASS").mean(),
                     "hard_constraint_pass_rate": (fmt[has] >= 1.0).mean() if has.any() else np.nan,
                     "reward_mean": y.reward.mean(), "reward_std": y.reward.std(ddof=0),
                     "reward_length_corr": corr, "response_tokens_mean": y.response_tokens.mean()})
    assert_same(run_named(lake, "quality"), pd.DataFrame(rows), KEYS)
    # the gate component and threshold are parameters
    strict = run_named(lake, "quality", hard_component="tool_cost", hard_threshold=0.0)
    assert (strict.hard_constraint_pass_rate.dropna() < 1).any()


def _bucket(ts: pd.Series) -> pd.Series:
    return ts.dt.tz_convert("UTC").dt.tz_localize(None).dt.floor("h")


def test_quality_over_time_equals_reference(health):
    lake, df, _ = health
    df = df.assign(bucket=_bucket(df.finished_at))
    rows = []
    for (run, b), x in df.groupby(["run_id", "bucket"]):
        y = x[x.valid]
        rows.append({"run_id": run, "bucket": b, "trajectories": len(x), "valid_members": len(y),
                     "success_rate": (y.verdict == "PASS").mean() if len(y) else np.nan,
                     "reward_mean": y.reward.mean() if len(y) else np.nan,
                     "policy_version_min": x.policy_version.min(), "policy_version_max": x.policy_version.max()})
    got = run_named(lake, "quality_over_time")
    got["bucket"] = pd.to_datetime(got.bucket)
    assert_same(got, pd.DataFrame(rows), ["run_id", "bucket"])
    days = run_named(lake, "quality_over_time", bucket="day")
    assert days.trajectories.sum() == len(df) and len(days) < len(got)


def test_quality_components_equals_reference(health):
    lake, df, _ = health
    v = df[df.valid & df.reward_components.notna()]
    recs = [(r, b, k, val) for r, b, comps in zip(v.run_id, _bucket(v.finished_at), v.reward_components)
            for k, val in comps]
    long = pd.DataFrame(recs, columns=["run_id", "bucket", "component", "value"])
    want = long.groupby(["run_id", "bucket", "component"]).value.agg(
        n="count", mean="mean", std=lambda s: s.std(ddof=0)).reset_index()
    got = run_named(lake, "quality_components")
    got["bucket"] = pd.to_datetime(got.bucket)
    assert_same(got, want, ["run_id", "bucket", "component"])


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_pass_at_k_sql_equals_library(health, k):
    lake, df, _ = health
    g = _groups(df)
    rows = []
    for (run, ver), x in g.groupby(KEYS):
        m = x[x.n_valid >= k]
        if len(m):
            rows.append({"run_id": run, "policy_version": ver, "k": k, "groups": len(m),
                         "pass_at_k": mean_pass_at_k(m.n_valid.to_numpy(), m.n_pass.to_numpy(), k)})
    got = run_named(lake, "quality_pass_at_k", k=k)
    assert_same(got, pd.DataFrame(rows), KEYS, rtol=1e-12)
    if k == 8:  # only the 8-member edge groups (minus those with failures) reach k = 8
        assert got.groups.sum() == int((g.n_valid >= 8).sum()) > 0


# -- freshness --------------------------------------------------------------------------------------


def _trained(df, tables) -> pd.DataFrame:
    ck = tables["checkpoints"]
    ver = dict(zip(ck.checkpoint_id, ck.policy_version))
    pairs = [(cid, sid, ver[p] if p is not None and p in ver else pv - 1)
             for cid, sids, p, pv in zip(ck.checkpoint_id, ck.snapshot_ids, ck.parent_checkpoint_id, ck.policy_version)
             for sid in (sids if sids is not None else [])]
    cks = pd.DataFrame(pairs, columns=["checkpoint_id", "snapshot_id", "trained_version"])
    m = tables["snapshot_members"].merge(cks, on="snapshot_id")
    m = m.merge(df[["trajectory_id", "run_id", "policy_version"]], on="trajectory_id")
    return m.assign(lag=m.trained_version - m.policy_version)


def test_freshness_equals_reference(health):
    lake, df, tables = health
    tr = _trained(df, tables)
    adm = tables["snapshot_members"].merge(df[["trajectory_id", "run_id", "policy_version"]], on="trajectory_id")
    rows = []
    for (run, ver), x in df.groupby(KEYS):
        a = adm[(adm.run_id == run) & (adm.policy_version == ver)]
        t = tr[(tr.run_id == run) & (tr.policy_version == ver)]
        rows.append({
            "run_id": run, "policy_version": ver, "trajectories": len(x),
            "queue_wait_p50_ms": np.percentile(x.queue_wait_ms, 50),
            "queue_wait_p95_ms": np.percentile(x.queue_wait_ms, 95),
            "admitted_members": len(a), "admission_lag_mean": a.policy_lag.mean() if len(a) else np.nan,
            "admission_lag_max": a.policy_lag.max() if len(a) else np.nan,
            "trained_members": len(t),
            "trained_version_min": t.trained_version.min() if len(t) else np.nan,
            "trained_version_max": t.trained_version.max() if len(t) else np.nan,
            "training_lag_mean": t.lag.mean() if len(t) else np.nan,
            "training_lag_p50": np.percentile(t.lag, 50) if len(t) else np.nan,
            "training_lag_p95": np.percentile(t.lag, 95) if len(t) else np.nan,
            "training_lag_max": t.lag.max() if len(t) else np.nan,
        })
    want = pd.DataFrame(rows)
    assert want.trained_members.sum() > 0 and (want.training_lag_max > 0).any()
    assert_same(run_named(lake, "freshness"), want, KEYS)


def test_freshness_lag_equals_reference(health):
    lake, df, tables = health
    tr = _trained(df, tables)
    adm = tables["snapshot_members"].merge(df[["trajectory_id", "run_id"]], on="trajectory_id")
    parts = [adm.assign(kind="admission", lag=adm.policy_lag)[["run_id", "kind", "lag"]],
             tr.assign(kind="training")[["run_id", "kind", "lag"]]]
    want = pd.concat(parts).groupby(["run_id", "kind", "lag"]).size().rename("members").reset_index()
    want["share"] = want.members / want.groupby(["run_id", "kind"]).members.transform("sum")
    assert_same(run_named(lake, "freshness_lag"), want, ["run_id", "kind", "lag"])


def test_freshness_rejections_equals_reference(health):
    lake, _, tables = health
    r = tables["receipts"]
    reasons = r.excluded_members.map(lambda m: [v for _, v in m] if m is not None else [])
    r = r.assign(excluded=reasons.map(len), stale=reasons.map(lambda rs: sum(x.startswith("stale") for x in rs)),
                 rejected=r.decision != "admit")
    want = r.groupby(["run_id", "difficulty", "length_bucket"], dropna=False).agg(
        groups=("group_id", "size"), admitted_groups=("rejected", lambda s: int((~s).sum())),
        rejected_groups=("rejected", "sum"), arrived_members=("arrived_members", "sum"),
        excluded_members=("excluded", "sum"), stale_excluded_members=("stale", "sum")).reset_index()
    want["rejection_rate"] = want.rejected_groups / want.groups
    want["stale_exclusion_rate"] = want.stale_excluded_members / want.arrived_members
    assert want.stale_excluded_members.sum() > 0 and want.rejected_groups.sum() > 0
    assert_same(run_named(lake, "freshness_rejections"), want, ["run_id", "difficulty", "length_bucket"])


# -- lineage ----------------------------------------------------------------------------------------


def test_lineage_equals_reference(health):
    lake, df, tables = health
    ck = tables["checkpoints"].sort_values(["policy_version", "created_at"])
    for cid in (None, ck.checkpoint_id.iloc[1]):
        row = ck.iloc[-1] if cid is None else ck[ck.checkpoint_id == cid].iloc[0]
        m = tables["snapshot_members"]
        m = m[m.snapshot_id.isin(list(row.snapshot_ids))]
        want = m.merge(df, on="trajectory_id", how="left", suffixes=("", "_t"))
        want = pd.DataFrame({"checkpoint_id": row.checkpoint_id, "checkpoint_policy_version": row.policy_version,
                             "snapshot_id": want.snapshot_id, "trajectory_id": want.trajectory_id,
                             "group_id": want.group_id, "task_id": want.task_id, "run_id": want.run_id,
                             "policy_version": want.policy_version, "env_version": want.env_version,
                             "verifier_version": want.verifier_version, "reward": want.reward,
                             "advantage": want.advantage})
        got = run_named(lake, "lineage") if cid is None else run_named(lake, "lineage", checkpoint_id=cid)
        assert_same(got, want, ["snapshot_id", "trajectory_id"])


def test_lineage_summary_equals_reference(health):
    lake, df, tables = health
    ck = tables["checkpoints"]
    rows = []
    for _, c in ck.iterrows():
        m = tables["snapshot_members"]
        m = m[m.snapshot_id.isin(list(c.snapshot_ids))].merge(df, on="trajectory_id", how="left",
                                                                  suffixes=("", "_t"))
        rows.append({"checkpoint_id": c.checkpoint_id, "policy_version": c.policy_version,
                     "snapshots": m.snapshot_id.nunique(), "groups": m.group_id.nunique(),
                     "trajectories": m.trajectory_id.nunique(), "tasks": m.task_id.nunique(),
                     "reward_mean": m.reward.mean() if len(m) else np.nan})
    got = run_named(lake, "lineage_summary")
    assert_same(got, pd.DataFrame(rows), ["checkpoint_id"])
    last = got.sort_values("policy_version").iloc[-1]
    want_versions = sorted(_trained(df, tables).query("checkpoint_id == @last.checkpoint_id").policy_version.unique())
    assert list(last.policy_versions) == want_versions and len(want_versions) == 2


def test_lineage_trajectory_equals_reference(health):
    lake, df, tables = health
    ck = tables["checkpoints"]
    m = tables["snapshot_members"]
    children: dict[str, list[str]] = {}
    for cid, p in zip(ck.checkpoint_id, ck.parent_checkpoint_id):
        if p is not None:
            children.setdefault(p, []).append(cid)
    tid = m[m.trajectory_id.str.contains("-v0-")].trajectory_id.iloc[0]
    snaps = set(m[m.trajectory_id == tid].snapshot_id)
    depth: dict[str, int] = {}
    queue = deque((cid, 0) for cid, sids in zip(ck.checkpoint_id, ck.snapshot_ids) if snaps & set(sids))
    while queue:  # breadth first: the first visit is the shortest distance
        cid, d = queue.popleft()
        if cid in depth and depth[cid] <= d:
            continue
        depth[cid] = d
        queue.extend((c, d + 1) for c in children.get(cid, []))
    want = pd.DataFrame({"checkpoint_id": list(depth), "depth": list(depth.values())})
    want["relation"] = np.where(want.depth == 0, "direct", "inherited").astype(object)
    got = run_named(lake, "lineage_trajectory", trajectory_id=tid)
    assert_same(got, want, ["checkpoint_id"])
    assert (got.relation == "inherited").any() and (got.relation == "direct").any()
    assert run_named(lake, "lineage_trajectory", trajectory_id="no-such").empty


# -- receipts and training --------------------------------------------------------------------------


def test_receipts_latest_equals_reference(health):
    lake, _, tables = health
    r = tables["receipts"].sort_values(["decided_at", "group_id"], ascending=[False, True])

    def reasons(m):
        counts: dict[str, int] = {}
        for _, why in (m or []):
            counts[why] = counts.get(why, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or None

    want = pd.DataFrame({"group_id": r.group_id, "decision": r.decision, "valid": r.valid_members.map(len),
                         "reasons": r.excluded_members.map(reasons).astype(object),
                         "failed_checks": r.checks.map(lambda m: ", ".join(
                             f"{k}: {v}" for k, v in sorted(m) if v not in ("pass", "skip")) or None).astype(object)})
    got = run_named(lake, "receipts_latest", limit=100_000)
    assert got.group_id.tolist() == want.group_id.tolist()      # newest first, ties by group_id
    assert_same(got, want, ["group_id"])
    assert want.reasons.notna().any() and want.failed_checks.notna().any()
    assert run_named(lake, "receipts_latest").group_id.tolist() == want.group_id.head(25).tolist()


def test_training_equals_reference(health):
    lake, _, tables = health
    m = tables["metrics"].merge(tables["checkpoints"][["checkpoint_id", "policy_version", "created_at"]],
                                on="checkpoint_id", how="left", suffixes=("", "_ck"))
    m = m.sort_values(["policy_version", "created_at_ck", "checkpoint_id", "global_step"]).reset_index(drop=True)
    want = m.assign(step=np.arange(len(m)))[["step", "checkpoint_id", "policy_version", "global_step", "loss",
                                              "reward_mean", "kl", "entropy", "tokens_per_s"]]
    got = run_named(lake, "training")
    assert_same(got, want, ["step"])
    one = run_named(lake, "training", checkpoint_id="ck-0002")
    assert set(one.checkpoint_id) == {"ck-0002"} and len(one) == (m.checkpoint_id == "ck-0002").sum()


# -- the CLI ----------------------------------------------------------------------------------------


def test_cli_runs_named_queries_with_params(health, capsys):
    import json

    from pipeline.cli import main

    lake = health[0]
    assert main(["sql", "--lake", lake.uri, "--file", "quality_pass_at_k", "--param", "k=2",
                 "--param", "run_id=run-b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["row_count"] == 3 and {r["k"] for r in out["rows"]} == {2}
    assert {r["run_id"] for r in out["rows"]} == {"run-b"}
    assert main(["sql", "--list"]) == 0
    listing = capsys.readouterr().out
    for name in HEALTH_QUERIES:
        summary = sql_path(name).read_text().splitlines()[0][3:].strip()
        assert f"{name}" in listing and summary[:20] in listing
    assert main(["sql", "--lake", lake.uri, "--file", "lineage_trajectory"]) != 0
    assert "trajectory_id" in capsys.readouterr().err


def test_all_health_queries_are_listed():
    names = {p.stem for p in resource_dir("sql").glob("*.sql")}
    assert set(HEALTH_QUERIES) <= names


# -- evaluations ------------------------------------------------------------------------------------


def test_eval_curve_equals_reference(health):
    lake = health[0]
    ev = lake.read("evaluations").to_pandas()
    assert len(ev) > 0
    got = run_named(lake, "eval_curve")
    want = ev.sort_values(["samples", "policy_version"]).reset_index(drop=True)
    assert got.policy_version.tolist() == want.policy_version.tolist()
    np.testing.assert_allclose(got.success, want.success)
    pk = [dict(m)[s] for m, s in zip(want.pass_at_k, want.samples)]
    np.testing.assert_allclose(got.pass_at_max, pk)
    one = run_named(lake, "eval_curve", samples=4)
    assert set(one.samples) == {4} and len(one) == int((ev.samples == 4).sum())


# -- rollout health panels --------------------------------------------------------------------------


def _traj(lake) -> pd.DataFrame:
    return lake.read("trajectories", columns=["run_id", "policy_version", "response_len", "stop_reason", "status",
                                              "verdict", "reward", "difficulty", "task_id", "finished_at"]).to_pandas()


def test_rollout_lengths_equals_reference(health):
    lake = health[0]
    t = _traj(lake)
    want = t.groupby(["run_id", "policy_version"]).agg(
        trajectories=("response_len", "size"), response_len_mean=("response_len", "mean"),
        response_len_max=("response_len", "max"),
        truncation_rate=("stop_reason", lambda s: float((s == "max_length").mean()))).reset_index()
    got = run_named(lake, "rollout_lengths").sort_values(["run_id", "policy_version"]).reset_index(drop=True)
    assert got.trajectories.tolist() == want.trajectories.tolist()
    np.testing.assert_allclose(got.response_len_mean, want.response_len_mean)
    np.testing.assert_allclose(got.truncation_rate, want.truncation_rate)
    assert got.response_len_max.tolist() == want.response_len_max.tolist()


def test_rollout_throughput_equals_reference(health):
    lake = health[0]
    t = _traj(lake).dropna(subset=["finished_at"])
    t["bucket"] = t.finished_at.dt.tz_convert("UTC").dt.tz_localize(None).dt.floor("h")
    want = t.groupby(["run_id", "bucket"]).agg(n=("response_len", "size"), tok=("response_len", "sum")).reset_index()
    got = run_named(lake, "rollout_throughput", bucket="hour")
    assert got.trajectories.tolist() == want.n.tolist()
    np.testing.assert_allclose(got.tokens_per_s, want.tok / 3600.0)


def test_success_by_difficulty_equals_reference(health):
    lake = health[0]
    t = _traj(lake)
    v = t[~t.status.isin(["INFRA_FAILED", "EXPIRED"]) & t.verdict.isin(["PASS", "FAIL"]) & t.reward.notna()].copy()
    v["difficulty"] = v.difficulty.fillna("(none)")
    want = v.groupby(["difficulty", "policy_version"]).agg(
        valid=("verdict", "size"), success_rate=("verdict", lambda s: float((s == "PASS").mean()))).reset_index()
    got = run_named(lake, "success_by_difficulty")
    assert got.valid.tolist() == want.valid.tolist()
    np.testing.assert_allclose(got.success_rate, want.success_rate)
