"""The real chain: ingest -> admit (the admission materializer) -> train -> lineage."""

from __future__ import annotations

import pyarrow.parquet as pq


def test_train_on_an_admitted_snapshot(lake, tmp_path):
    from pipeline.admission.run import admit
    from pipeline.ingest import ingest_files
    from pipeline.lineage import walk
    from pipeline.testing.trajectories import make_trajectories
    from pipeline.train.config import TrainConfig
    from pipeline.train.data import receipt_counts
    from pipeline.testing.train_fixtures import publish_tiny_policy
    from pipeline.train.run import train_snapshot

    publish_tiny_policy(lake, vocab_size=30000, hidden_size=16, intermediate_size=32)   # synth ids < 30000
    pq.write_table(make_trajectories(48, seed=2, median_len=20, prompt_len=6), tmp_path / "t.parquet")
    ingest_files(lake, [tmp_path / "t.parquet"])
    adm = admit(lake)
    assert adm.snapshot_id and adm.admitted_members > 0
    counts = receipt_counts(lake, adm.snapshot_id)
    assert counts and sum(counts.values()) == adm.admitted_members        # the receipts check is live

    res = train_snapshot(lake, adm.snapshot_id, TrainConfig(lr=1e-3, micro_batch_tokens=512), progress=False)
    assert res.policy_version == 1 and res.samples_seen == adm.admitted_members
    w = walk(lake, res.checkpoint_id)
    (s,) = w["snapshots"]
    assert s["members"] == adm.admitted_members and s["trajectories_found"] == adm.admitted_members
    assert s["source_versions"]["trajectories"] == s["trajectories_table_version"]
