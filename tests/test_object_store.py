"""The whole loop against S3-compatible object storage (moto's server on
127.0.0.1, started by the test): ingest, rollout, admit, train, lineage, SQL.
First a canary: Delta's concurrent commits on S3 rely on conditional writes
(If-None-Match), so a store that ignores them must fail the test. Racing writers
on the S3 lake (four ingests, maintains beside ingests, two publishers, a kill
inside a commit) are tests/lake/test_write_protocol.py's S3 test."""

from __future__ import annotations

import pytest


def test_canary_store_honours_conditional_writes(s3_env):
    s3, bucket = s3_env
    s3.put_object(Bucket=bucket, Key="canary", Body=b"first", IfNoneMatch="*")
    with pytest.raises(Exception, match="PreconditionFailed"):
        s3.put_object(Bucket=bucket, Key="canary", Body=b"second", IfNoneMatch="*")
    assert s3.get_object(Bucket=bucket, Key="canary")["Body"].read() == b"first"


@pytest.mark.slow
def test_whole_loop_on_object_storage(s3_env, tmp_path, make_traj):
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.snapshots.format import verify_snapshot
    from pipeline.cli import main
    from pipeline.lake.delta import Lake
    from pipeline.ingest import ingest_files
    from pipeline.query.duck import query
    from pipeline.rollout.policy import init_policy
    from pipeline.rollout.run import run_rollout
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    _, bucket = s3_env
    lake = Lake(f"s3://{bucket}/lake")
    # external ingest (exactly once); token ids inside the tiny policy's vocabulary
    ext = make_traj(16, seed=3, median_len=12, sigma=0.2, prompt_len=8).drop_columns(["content_hash"])
    for name in ("prompt_ids", "response_ids"):
        col = ext.column(name).combine_chunks()
        small = pa.ListArray.from_arrays(col.offsets, pc.add(pc.bit_wise_and(col.values, 31), 3))
        ext = ext.set_column(ext.schema.get_field_index(name), name, small)
    pq.write_table(ext, tmp_path / "ext.parquet")
    assert ingest_files(lake, [tmp_path / "ext.parquet"]).landed == 16
    assert ingest_files(lake, [tmp_path / "ext.parquet"]).landed == 0
    # the policy, real rollouts, admission, training
    ref = init_policy(lake, seed=0)
    assert ref.policy_version == 0
    s = run_rollout(lake, groups=4, group_size=4, seed=1, run_id="s3", spool_dir=str(tmp_path / "spool"))
    assert s.landed == 16
    a = admit(lake, AdmissionConfig(), current_policy_version=0)
    assert a.snapshot_id is not None
    assert verify_snapshot(lake, a.snapshot_id)["ok"]
    r = train_snapshot(lake, a.snapshot_id, TrainConfig(epochs=1))
    assert r.policy_version == 1
    rows = query(lake, "SELECT policy_version FROM checkpoints ORDER BY 1").column(0).to_pylist()
    assert rows == [0, 1]
    assert main(["lineage", r.checkpoint_id, "--lake", lake.uri, "--json"]) == 0
