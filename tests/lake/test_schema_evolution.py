"""A table created before a column was added to schemas/*.yaml gains it on the
next append (nullable: older rows read null), so new derived columns such as
prompt_hash reach existing lakes."""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from pipeline.lake.delta import Lake
from pipeline.lake.ingest import stamp_derived
from pipeline.schema import table_spec
from pipeline.testing.trajectories import make_trajectories

NEW = ("prompt_hash", "tool_schema_version", "env_state_hash")


def test_existing_table_gains_new_columns(tmp_path):
    lake = Lake(tmp_path / "lake")
    spec = table_spec("trajectories")
    old = stamp_derived(make_trajectories(8, seed=1, group_size=4), "old")
    old_schema = pa.schema([f for f in spec.arrow_schema() if f.name not in NEW])
    write_deltalake(lake.table_uri("trajectories"), old.select(old_schema.names).cast(old_schema),
                    partition_by=list(spec.partition_by))
    assert not set(NEW) & {f.name for f in DeltaTable(lake.table_uri("trajectories")).schema().fields}
    new = stamp_derived(make_trajectories(8, seed=2, group_size=4, id_prefix="n"), "new")
    assert lake.append("trajectories", new, command="test").landed
    t = lake.read("trajectories", columns=["trajectory_id", "prompt_hash"]).to_pylist()
    by_id = {r["trajectory_id"]: r["prompt_hash"] for r in t}
    assert all(by_id[i] is None for i in old.column("trajectory_id").to_pylist())
    ids = new.column("trajectory_id").to_pylist()
    assert by_id[ids[0]] is not None and by_id[ids[0]] == by_id[ids[3]] != by_id[ids[4]]  # one prompt per group
    from pipeline.query.duck import query   # SQL reads the files written before the column existed too

    via_sql = {r["trajectory_id"]: r["prompt_hash"] for r in
               query(lake, "SELECT trajectory_id, prompt_hash FROM trajectories").to_pylist()}
    assert via_sql == by_id
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit

    res = admit(lake, AdmissionConfig(quality=False), now=datetime(2027, 1, 1, tzinfo=timezone.utc))
    assert res.receipts.num_rows == 4
    assert Lake(lake.uri).evolve("trajectories") == []  # nothing left to add
