"""DuckDB SQL == Dask == the plain-Python reference of docs/admission-rules.md, on random lakes."""

from __future__ import annotations

import shutil
import tempfile
from datetime import timedelta

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from admission_rows import NOW, land, traj
from pipeline.admission import candidates as cand
from pipeline.admission import engine_dask, engine_duckdb
from pipeline.admission.config import AdmissionConfig
from pipeline.admission.decide import conform, finalize, group_schema, member_schema
from pipeline.admission.reference import reference_members_groups, to_tables
from pipeline.lake.delta import Lake

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dask_address():
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    yield cluster.scheduler_address
    cluster.close()


@st.composite
def member(draw, tid, gid, group_size):
    pv = draw(st.sampled_from([3, 4, 5]))
    n = draw(st.integers(1, 4))
    tpv = draw(st.one_of(st.none(), st.lists(st.sampled_from([-1, 2, 3, 4, 5]), min_size=n, max_size=n)))
    if tpv is not None and all(v == -1 for v in tpv):
        tpv[0] = pv
    reward = draw(st.sampled_from([None, 0.0, 0.0, 0.5, 1.0, 1.0]))
    status = draw(st.sampled_from(["ACCEPTED"] * 6 + ["REJECTED", "INFRA_FAILED", "EXPIRED"]))
    verdict = draw(st.sampled_from(["PASS", "FAIL", "FAIL", "UNKNOWN", "ENV_ERROR"]))
    comps = draw(st.one_of(st.none(), st.fixed_dictionaries(
        {"task_success": st.sampled_from([0.0, 1.0]), "format": st.sampled_from([0.0, 0.1, 0.5])})))
    row = traj(tid, gid, group_size=group_size, policy_version=pv, tpv=tpv, reward=reward, status=status,
               verdict=verdict, components=comps,
               tokenizer_rev=draw(st.sampled_from(["tok-1", "tok-1", "tok-2"])),
               env_version=draw(st.sampled_from(["env-a", "env-a", "env-b"])),
               verifier_version=draw(st.sampled_from(["ver-1", "ver-1", "ver-2"])),
               temperature=draw(st.sampled_from([1.0, 1.0, 0.7])),
               top_p=draw(st.sampled_from([1.0, 1.0, 1.0, 0.9])),
               task_version=draw(st.sampled_from(["v1"] * 5 + ["v2"])),
               harness_version=draw(st.sampled_from(["h-1"] * 5 + ["h-2"])),
               tool_schema_version=draw(st.sampled_from([None, None, "calc/1", "calc/2"])),
               prompt_ids=draw(st.sampled_from([[1, 2]] * 5 + [[1, 3]])),
               difficulty=draw(st.sampled_from([None, "easy", "hard"])),
               num_tool_calls=draw(st.integers(0, 20)), queue_wait_ms=draw(st.sampled_from([10, 800, 3000])),
               age_s=draw(st.sampled_from([30.0, 300.0, 900.0])), response_len=n)
    if tpv is not None:
        row["loss_mask"] = [0 if v == -1 else 1 for v in tpv]
        row["response_logprobs"] = [0.0 if v == -1 else -0.5 for v in tpv]
    return row


@st.composite
def lakes(draw):
    rows = []
    for g in range(draw(st.integers(1, 8))):
        size = draw(st.integers(1, 5))
        arrived = draw(st.integers(1, size + 1))
        rows += [draw(member(f"t{g}-{k}", f"g{g}", size)) for k in range(arrived)]
    cfg = AdmissionConfig(
        quality=False,
        max_policy_lag=draw(st.sampled_from([0, 1, 2])),
        max_queue_wait_ms=draw(st.sampled_from([None, 1000])),
        min_valid_members=draw(st.sampled_from([2, 3])),
        update_if=draw(st.sampled_from([(), ("max(task_success) >= 0.5",), ("mean(format) <= 0.3",)])),
        component_caps=draw(st.sampled_from([{}, {"format": 0.2}])),
        advantage=draw(st.sampled_from(["grpo", "dr_grpo", "rloo"])),
        bucket_caps=draw(st.sampled_from([{}, {"difficulty:easy": 1}])),
        mix_batch_fields=draw(st.sampled_from([(), (), ("verifier_version", "env_version")])),
        vocab_size=draw(st.sampled_from([None, None, 5, 6])),     # response ids 3..6: some out_of_vocabulary
    )
    quality = {r["trajectory_id"]: "quality:expect_column_values_to_be_in_set(status)"
               for r in rows if draw(st.integers(0, 9)) == 0}
    decided = {f"g{g}" for g in range(8) if draw(st.integers(0, 6)) == 0}
    return rows, cfg, quality, decided


def _receipts(members, groups, cfg):
    d = finalize(members, groups, cfg, config_hash="h", current_policy_version=5)
    return d.receipts, d.admitted


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=lakes())
def test_duckdb_equals_dask_equals_reference(case, dask_address):
    rows, cfg, quality, decided = case
    tmp = tempfile.mkdtemp()
    try:
        lake = Lake(tmp)
        landed = land(lake, rows)
        now = NOW
        ref_m, ref_g = to_tables(*reference_members_groups(
            landed.to_pylist(), cfg, current_policy_version=5, now=now, decided=decided, quality=quality), cfg)
        dec_arr = pa.array(sorted(decided), pa.string())
        tv = lake.version("trajectories")
        cands = cand.scan(lake.dataset("trajectories", tv), cfg, dec_arr)
        rejects = pa.table({"trajectory_id": pa.array(sorted(quality), pa.string()),
                            "reason": pa.array([quality[k] for k in sorted(quality)], pa.string())})
        duck_m, duck_g = engine_duckdb.run(cands, rejects, cfg, current_policy_version=5, now=now)
        duck_m, duck_g = conform(duck_m, member_schema(cfg)), conform(duck_g, group_schema(cfg))
        dask_m, dask_g, _, _ = engine_dask.run_with_quality(
            lake, tv, cfg, decided=dec_arr, quality_fn=lambda t: (rejects, {}), current_policy_version=5,
            now=now, dask_scheduler=dask_address)
        gates = [f"gate_{i}" for i in range(len(cfg.gates))]
        for name, (m, g) in {"duckdb": (duck_m, duck_g), "dask": (dask_m, dask_g)}.items():
            assert m.to_pylist() == ref_m.to_pylist(), name
            assert g.drop_columns(gates).to_pylist() == ref_g.drop_columns(gates).to_pylist(), name
            for c in gates:
                assert g.column(c).to_pylist() == pytest.approx(ref_g.column(c).to_pylist(), nan_ok=True), name
        ref_r = _receipts(ref_m, ref_g, cfg)
        assert _receipts(duck_m, duck_g, cfg)[0].to_pylist() == ref_r[0].to_pylist()
        assert _receipts(dask_m, dask_g, cfg)[0].to_pylist() == ref_r[0].to_pylist()
        assert _receipts(duck_m, duck_g, cfg)[1].equals(ref_r[1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_admit_duckdb_and_dask_write_identical_receipts_and_snapshots(tmp_path, make_traj, dask_address):
    from pipeline.admission.run import admit
    from pipeline.lake.ingest import stamp_derived

    src = Lake(tmp_path / "a")
    t = make_traj(120, seed=3, group_size=4)
    # a few infra failures and a stale member, so exclusions are exercised
    status = t.column("status").to_pylist()
    for i in (1, 9, 17):
        status[i] = "INFRA_FAILED"
    t = t.set_column(t.schema.get_field_index("status"), "status", pa.array(status))
    src.append("trajectories", stamp_derived(t, "ing-1"), command="test")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    cfg = AdmissionConfig(quality=True)
    a = admit(src, cfg, now=NOW + timedelta(days=1))
    b = admit(Lake(tmp_path / "b"), cfg, engine="dask", dask_scheduler=dask_address, now=NOW + timedelta(days=1))
    assert a.snapshot_id is not None and a.snapshot_id == b.snapshot_id
    drop = ["admission_run_id", "decided_at"]
    ra = Lake(tmp_path / "a").read("receipts").drop_columns(drop).sort_by("group_id")
    rb = Lake(tmp_path / "b").read("receipts").drop_columns(drop).sort_by("group_id")
    assert ra.equals(rb)
    sa = Lake(tmp_path / "a").read("snapshots", columns=["snapshot_id", "manifest_sha256", "num_tokens"])
    sb = Lake(tmp_path / "b").read("snapshots", columns=["snapshot_id", "manifest_sha256", "num_tokens"])
    assert sa.equals(sb)  # same manifest bytes: same payload file hash
    assert a.counts == b.counts and a.counts.get("admit", 0) > 0


def test_token_ids_outside_the_policys_vocabulary_are_excluded_with_a_reason(tlake, make_traj):
    """The trainer refused such a snapshot after its groups were decided; now the
    member is excluded at admission (vocab_size from the current policy's config)."""
    import json as _json

    from pipeline.admission.run import admit
    from pipeline.ingest import ingest_table
    from pipeline.policy_store import HF_SUBDIR, local_checkpoint_dir, policy_info

    lake, _ = tlake
    info = policy_info(lake, 0)
    vocab = _json.loads((local_checkpoint_dir(lake, info["checkpoint_id"]) / HF_SUBDIR / "config.json")
                        .read_text())["vocab_size"]
    t = make_traj(8, seed=5, group_size=4, median_len=6, sigma=0.2, id_prefix="v-")
    t = t.set_column(t.schema.get_field_index("response_ids"), "response_ids",
                     pa.array([[i % vocab for i in r] for r in t.column("response_ids").to_pylist()],
                              pa.list_(pa.int32())))
    t = t.set_column(t.schema.get_field_index("prompt_ids"), "prompt_ids",
                     pa.array([[i % vocab for i in r] for r in t.column("prompt_ids").to_pylist()],
                              pa.list_(pa.int32())))
    rows = t.drop_columns(["content_hash"]).to_pylist()
    rows[1]["response_ids"][0] = vocab                      # one id the policy cannot embed
    bad = rows[1]["trajectory_id"]
    rewards = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    for r, w in zip(rows, rewards):
        r["reward"], r["verdict"] = w, "PASS" if w > 0 else "FAIL"
    assert ingest_table(lake, pa.Table.from_pylist(rows, schema=t.drop_columns(["content_hash"]).schema)).landed == 8
    res = admit(lake, AdmissionConfig(quality=False), current_policy_version=0)
    rec = {r["group_id"]: r for r in res.receipts.to_pylist()}
    excluded = dict(rec[rows[1]["group_id"]]["excluded_members"])
    assert excluded == {bad: "out_of_vocabulary"}
    assert "out_of_vocabulary=1" in dict(rec[rows[1]["group_id"]]["checks"])["member_exclusions"]
    assert res.snapshot_id is not None
    from pipeline.snapshots.format import read_snapshot_table

    assert bad not in read_snapshot_table(lake, res.snapshot_id).column("trajectory_id").to_pylist()
