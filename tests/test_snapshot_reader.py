"""pipeline.snapshots: the reader any trainer (and ours) uses for a snapshot."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def snap_lake(lake):
    from pipeline.testing.train_fixtures import publish_synthetic_snapshot

    return lake, publish_synthetic_snapshot(lake, 12, seed=3, median_len=10, prompt_len=4)


def test_open_verifies_and_reads_members(snap_lake):
    import torch

    import pipeline.snapshots
    from pipeline.snapshots.format import read_snapshot_table

    lake, sid = snap_lake
    snap = pipeline.snapshots.open(lake, sid)
    assert snap.verification["ok"] and snap.verification["registered"] and len(snap) == 12
    full = read_snapshot_table(lake, sid)
    batches = list(snap.batches(5))
    assert [b.num_rows for b in batches] == [5, 5, 2]
    assert batches[0].schema.names == pipeline.snapshots.MEMBER_COLUMNS
    assert sum((b.column("trajectory_id").to_pylist() for b in batches), []) == full.column("trajectory_id").to_pylist()
    ds = snap.dataset()
    assert isinstance(ds, torch.utils.data.Dataset) and len(ds) == 12
    m = ds[3]
    assert m["response_ids"].tolist() == full.column("response_ids")[3].as_py()
    assert m["loss_mask"].tolist() == full.column("loss_mask")[3].as_py()
    assert m["behaviour_logprobs"].tolist() == full.column("response_logprobs")[3].as_py()
    assert float(m["advantage"]) == full.column("advantage")[3].as_py() and m["group_id"] == full.column("group_id")[3].as_py()
    loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=pipeline.snapshots.collate)
    seen = 0
    for batch in loader:
        B, L = batch["input_ids"].shape
        for b in range(B):
            i = seen + b
            p, r = full.column("prompt_ids")[i].as_py(), full.column("response_ids")[i].as_py()
            mask = np.array(full.column("loss_mask")[i].as_py(), np.float32)
            assert batch["input_ids"][b, :len(p) + len(r)].tolist() == p + r
            assert batch["loss_mask"][b].tolist() == [0.0] * len(p) + mask.tolist() + [0.0] * (L - len(p) - len(r))
            adv = full.column("advantage")[i].as_py()
            assert np.allclose(batch["advantages"][b, len(p):len(p) + len(r)].numpy(), np.float32(adv) * mask)
        seen += B
    assert seen == 12


def test_tampered_snapshot_is_refused(snap_lake):
    import pipeline.snapshots
    from pipeline.errors import IntegrityError

    lake, sid = snap_lake
    import pathlib

    path = pathlib.Path(lake.uri) / "_snapshots" / sid / "members.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        pipeline.snapshots.open(lake, sid)


def test_the_trainer_reads_through_the_same_reader(snap_lake, monkeypatch):
    import pipeline.snapshots
    from pipeline.train.data import load_members

    lake, sid = snap_lake
    opened = []
    real = pipeline.snapshots.open
    monkeypatch.setattr(pipeline.snapshots, "open", lambda *a, **k: opened.append(a[1]) or real(*a, **k))
    members, summary = load_members(lake, sid)
    assert opened == [sid] and summary["ok"] and len(members) == 12
    assert len(real(lake.uri, sid)) == 12  # a path works as well as a Lake
