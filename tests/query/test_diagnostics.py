"""The diagnostic named queries (sql/diag_*.sql, issue 19 item 7), each equal
to an independent pandas/numpy computation from the raw rows of a real lake."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from pipeline.query.duck import query
from pipeline.resources import sql_path

VALID = "valid"


def _edit(t: pa.Table, fn) -> pa.Table:
    """Rows of a synth table edited in Python, content hashes recomputed."""
    from pipeline.lake.contenthash import content_hashes

    rows = t.drop_columns(["content_hash"]).to_pylist()
    for i, r in enumerate(rows):
        fn(i, r)
    out = pa.Table.from_pylist(rows, schema=t.drop_columns(["content_hash"]).schema)
    return out.append_column(t.schema.field("content_hash"), content_hashes(out))


@pytest.fixture(scope="module")
def diag(tmp_path_factory):
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.lake.delta import Lake
    from pipeline.lake.ingest import stamp_derived
    from pipeline.schema import table_spec
    from pipeline.testing.trajectories import make_trajectories

    lake = Lake(tmp_path_factory.mktemp("diag") / "lake")
    rng = np.random.default_rng(7)

    def tweak(i, r):
        r["env_version"] = "arithmetic-tool/1"  # declares task_success fact, format / tool_cost heuristic
        comps = dict(r["reward_components"])
        comps["format"] = float(rng.choice([0.0, 0.5, 1.0]))
        r["reward_components"] = list(comps.items())
        if i % 7 == 3:
            r["stop_reason"] = "max_length"
        if i % 11 == 5:
            r["status"], r["verdict"], r["reward"] = "INFRA_FAILED", "ENV_ERROR", None
        if 8 <= i < 12:  # group 2 collapses: every member writes the same response
            r["response_ids"] = [5, 5, 6, 7, 5]
            r["loss_mask"] = [1, 1, 0, 1, 1]
            r["response_logprobs"] = [-0.5, -0.5, 0.0, -0.5, -0.5]
            r["token_policy_versions"] = [0, 0, -1, 0, 0]

    a = _edit(make_trajectories(64, seed=2, group_size=4, run_id="run-a", median_len=12), tweak)
    b = make_trajectories(48, seed=3, group_size=4, run_id="run-b", policy_version=1, id_prefix="b",
                          median_len=12)
    for t, name in ((a, "a"), (b, "b")):
        lake.append("trajectories", stamp_derived(t, name), command="test")
    admit(lake, AdmissionConfig(quality=False, max_policy_lag=5), now=datetime(2027, 1, 1, tzinfo=timezone.utc))
    spec = table_spec("metrics")
    rows = []
    for step in range(9):
        row = {}
        for f in spec.arrow_schema():
            if pa.types.is_string(f.type):
                row[f.name] = "ck-1"
            elif pa.types.is_timestamp(f.type):
                row[f.name] = datetime(2027, 1, 1, tzinfo=timezone.utc)
            elif pa.types.is_integer(f.type):
                row[f.name] = step
            else:
                row[f.name] = float(rng.uniform(0, 1))
        row["kl"] = None if step == 4 else float(rng.exponential(0.01))
        rows.append(row)
    lake.append("metrics", pa.Table.from_pylist(rows, schema=spec.arrow_schema()), command="test")
    t = lake.read("trajectories")
    df = t.drop_columns(["reward_components"]).to_pandas()
    df["reward_components"] = [dict(x) if x is not None else None for x in t.column("reward_components").to_pylist()]
    df[VALID] = (~df.status.isin(["INFRA_FAILED", "EXPIRED"])) & df.verdict.isin(["PASS", "FAIL"]) & df.reward.notna()
    tables = {n: lake.read(n).to_pandas() for n in ("snapshot_members", "receipts", "metrics", "snapshots")}
    return lake, df, tables


def run(lake, name: str, **params) -> pd.DataFrame:
    from pipeline.rollout.envs.base import component_tags_table

    return query(lake, sql_path(name).read_text(), params=params,
                 views={"component_tags": component_tags_table()}).to_pandas()


def same(got: pd.DataFrame, want: pd.DataFrame, keys: list[str]) -> None:
    assert len(want) > 0
    got = got.sort_values(keys).reset_index(drop=True)
    want = want.sort_values(keys).reset_index(drop=True)
    assert len(got) == len(want)
    for c in want.columns:
        a, b = got[c].to_numpy(), want[c].to_numpy()
        if b.dtype == object or c in keys:
            assert list(a) == list(b), c
        else:
            np.testing.assert_allclose(a.astype(float), b.astype(float), rtol=1e-9, atol=1e-12, err_msg=c)


def test_component_variance(diag):
    lake, df, _ = diag
    from pipeline.rollout.envs.base import declared_component_tags

    tags = {(r["env_version"], r["component"]): r["tag"] for r in declared_component_tags()}
    v = df[df[VALID] & df.reward_components.notna()]
    rows = []
    for (run_id, gid), g in v.groupby(["run_id", "group_id"]):
        comps = sorted({k for d in g.reward_components for k in d})
        for c in comps:
            vals = np.array([d[c] for d in g.reward_components if d.get(c) is not None])
            if len(vals) >= 2:
                rows.append((run_id, g.env_version.min(), c, vals.var(), vals.max() > vals.min()))
    per = pd.DataFrame(rows, columns=["run_id", "env_version", "component", "v", "varies"])
    want = per.groupby(["run_id", "env_version", "component"]).agg(
        groups=("v", "size"), mean_within_var=("v", "mean"), varying_groups=("varies", "sum")).reset_index()
    want["varying_share"] = want.varying_groups / want.groups
    want["tag"] = [tags.get((e, c), "untagged") for e, c in zip(want.env_version, want.component)]
    got = run(lake, "diag_component_variance")
    same(got, want, ["run_id", "env_version", "component"])
    a = got[got.run_id == "run-a"].set_index("component")
    assert a.loc["task_success", "tag"] == "fact" and a.loc["format", "tag"] == "heuristic"
    assert set(got[got.run_id == "run-b"].tag) == {"untagged"}
    assert len(run(lake, "diag_component_variance", run_id="run-b")) == (got.run_id == "run-b").sum()


def test_group_diversity(diag):
    lake, df, _ = diag
    v = df[df[VALID]]
    rows = []
    for (run_id, gid), g in v.groupby(["run_id", "group_id"]):
        if len(g) < 2:
            continue
        r = g.reward.to_numpy(float)
        a = r - r.mean()
        spread = r.max() > r.min()
        ess = (np.abs(a).sum() ** 2 / (a * a).sum()) if spread else 0.0
        uniq = len({tuple(x) for x in g.response_ids}) / len(g)
        rows.append((run_id, g.policy_version.min(), len(g), uniq, uniq == 1 / len(g), ess, not spread))
    per = pd.DataFrame(rows, columns=["run_id", "policy_version", "n", "u", "collapsed", "ess", "nosig"])
    want = per.groupby(["run_id", "policy_version"]).agg(
        groups=("n", "size"), mean_valid_members=("n", "mean"), mean_unique_answer_ratio=("u", "mean"),
        collapsed_groups=("collapsed", "sum"), mean_effective_group_size=("ess", "mean"),
        no_signal_groups=("nosig", "sum")).reset_index()
    got = run(lake, "diag_group_diversity")
    same(got, want, ["run_id", "policy_version"])
    assert got.collapsed_groups.sum() >= 1  # the edited group


def test_quantiles(diag):
    lake, df, t = diag
    q = [0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99]
    series = {
        "reward": df[df[VALID]].reward.to_numpy(float),
        "advantage": t["snapshot_members"].advantage.to_numpy(float),
        "kl": t["metrics"].kl.dropna().to_numpy(float),
        "approx_kl": t["metrics"].approx_kl.to_numpy(float),
    }
    want = pd.DataFrame([{"metric": m, "n": len(x), "mean": x.mean(), "min": x.min(),
                          **{f"p{int(round(p * 100)):02d}": np.quantile(x, p) for p in q}, "max": x.max()}
                         for m, x in series.items()])
    got = run(lake, "diag_quantiles")
    same(got, want, ["metric"])
    # run_id scopes reward and advantage (via receipts), not the training steps
    runs = t["receipts"].set_index("group_id").run_id
    adv_a = t["snapshot_members"][t["snapshot_members"].group_id.map(runs) == "run-a"].advantage
    got_a = run(lake, "diag_quantiles", run_id="run-a").set_index("metric")
    assert got_a.loc["advantage", "n"] == len(adv_a) and got_a.loc["kl", "n"] == len(series["kl"])
    assert got_a.loc["reward", "n"] == (df[VALID] & (df.run_id == "run-a")).sum()


def test_token_shares(diag):
    lake, df, _ = diag
    rows = []
    for _, r in df.iterrows():
        ids, mask = np.asarray(r.response_ids), np.asarray(r.loss_mask)
        act = ids[mask == 1]
        rows.append((r.run_id, r.policy_version, len(ids), len(act),
                     1 - len(set(act.tolist())) / len(act) if len(act) else np.nan))
    per = pd.DataFrame(rows, columns=["run_id", "policy_version", "n", "a", "rep"])
    want = per.groupby(["run_id", "policy_version"]).agg(
        trajectories=("n", "size"), response_tokens=("n", "sum"), action_tokens=("a", "sum"),
        mean_repeated_token_share=("rep", "mean"), max_repeated_token_share=("rep", "max")).reset_index()
    want["action_token_share"] = want.action_tokens / want.response_tokens
    got = run(lake, "diag_token_shares")
    same(got, want, ["run_id", "policy_version"])
    assert (want.action_token_share < 1).all()  # multi-turn synth rows carry observation tokens


def test_truncation(diag):
    lake, df, _ = diag
    v = df[df[VALID]].assign(correct=lambda d: d.verdict == "PASS",
                             trunc=lambda d: d.stop_reason == "max_length")
    want = v.groupby(["run_id", "policy_version", "correct"]).agg(n=("trunc", "size"),
                                                                   truncated=("trunc", "sum")).reset_index()
    want["truncation_rate"] = want.truncated / want.n
    got = run(lake, "diag_truncation")
    same(got, want, ["run_id", "policy_version", "correct"])
    assert want.truncated.sum() > 0


def test_advantage_extremes(diag):
    lake, df, t = diag
    snaps = t["snapshots"].sort_values(["created_at", "snapshot_id"], ascending=[False, True])
    sid = snaps.snapshot_id.iloc[0]
    m = t["snapshot_members"][t["snapshot_members"].snapshot_id == sid]
    top = m.sort_values(["advantage", "trajectory_id"], ascending=[False, True]).head(3)
    bottom = m.sort_values(["advantage", "trajectory_id"], ascending=[True, True]).head(3)
    got = run(lake, "diag_advantage_extremes", k=3)
    assert list(got[got.side == "top"].trajectory_id) == list(top.trajectory_id)
    assert list(got[got.side == "bottom"].trajectory_id) == list(bottom.trajectory_id)
    assert list(got[got.side == "top"]["rank"]) == [1, 2, 3]
    by_id = df.set_index("trajectory_id")
    for _, r in got.iterrows():
        assert r.stop_reason == by_id.loc[r.trajectory_id, "stop_reason"]
        assert r.reward == pytest.approx(m.set_index("trajectory_id").loc[r.trajectory_id, "reward"])
    assert len(run(lake, "diag_advantage_extremes", snapshot_id="nope")) == 0
