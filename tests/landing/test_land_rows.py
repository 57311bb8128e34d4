"""The landing door for in-memory batches (pipeline/landing/rows.py) and the
deprecated path of the moved ingest module (pipeline/lake/ingest.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest


def _with_one_nan_reward(make_traj, n: int = 4) -> pa.Table:
    t = make_traj(n, seed=3, with_hash=False)
    reward = t.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
    reward[1] = np.nan
    return t.set_column(t.schema.get_field_index("reward"), "reward",
                        pa.array(reward, t.schema.field("reward").type))


def test_land_rows_quarantines_then_lands_and_a_rerun_of_the_batch_is_a_no_op(lake, make_traj):
    from pipeline.landing.rows import land_rows

    raw = _with_one_nan_reward(make_traj)
    kw = dict(command="test", ingest_id="test:0", source="mem", fingerprint="w:0", app_id="w", txn_version=0)
    res = land_rows(lake, {"trajectories": raw}, **kw)
    assert res.landed == {"trajectories": 3}
    assert res.quarantined == res.offered_quarantine == 1 and res.reasons == {"not_finite": 1}
    q = lake.read("quarantine", columns=["trajectory_id", "reason_code", "ingest_id"]).to_pylist()
    assert q == [{"trajectory_id": raw.column("trajectory_id")[1].as_py(), "reason_code": "not_finite",
                  "ingest_id": "test:0"}]
    landed = lake.read("trajectories", columns=["trajectory_id", "ingest_id", "oldest_version"])
    assert sorted(landed.column("trajectory_id").to_pylist()) == sorted(
        raw.column("trajectory_id").take([0, 2, 3]).to_pylist())
    assert set(landed.column("ingest_id").to_pylist()) == {"test:0"}          # stamped
    # quarantine committed before trajectories, each under the batch's transaction
    assert lake.transaction_version("quarantine", "w") == lake.transaction_version("trajectories", "w") == 0
    versions = (lake.version("quarantine"), lake.version("trajectories"))
    again = land_rows(lake, {"trajectories": raw}, **kw)
    assert again.landed == {"trajectories": 0} and again.quarantined == 0 and again.offered_quarantine == 1
    assert (lake.version("quarantine"), lake.version("trajectories")) == versions


def test_land_rows_strict_table_with_a_reject_raises_before_anything_is_written(lake, make_traj):
    from pipeline.errors import PipelineError
    from pipeline.landing.rows import land_rows

    with pytest.raises(PipelineError, match="rows of trajectories violate schemas/trajectories.yaml"):
        land_rows(lake, {"trajectories": _with_one_nan_reward(make_traj)}, command="test", ingest_id="s:0",
                  source="sim", fingerprint="s:0", app_id="s", txn_version=0, strict=("trajectories",))
    assert not lake.exists("trajectories") and not lake.exists("quarantine")


def test_old_ingest_path_warns_and_resolves_to_the_landing_door():
    import pipeline.lake.ingest as old
    from pipeline.lake import derived
    from pipeline.landing import ingest

    with pytest.warns(DeprecationWarning, match="pipeline.landing.ingest.land_files"):
        assert old.land_files is ingest.land_files
    with pytest.warns(DeprecationWarning, match="pipeline.landing.ingest.stamp_derived"):
        from pipeline.lake.ingest import stamp_derived
    assert stamp_derived is ingest.stamp_derived
    with pytest.warns(DeprecationWarning, match="check_source"):
        assert old._check_source is ingest.check_source
    with pytest.warns(DeprecationWarning, match="pipeline.lake.derived.prompt_hashes"):
        assert old.prompt_hashes is derived.prompt_hashes
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        old.no_such_name  # noqa: B018
