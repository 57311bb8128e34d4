"""The committer's core without the network (the messages are real wire
payloads): fencing by the table's transaction version, resume by sequence, bad
batches quarantined with one reason; on a local lake and on moto S3."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from pipeline.lake.delta import Lake
from pipeline.landing import wire
from pipeline.landing.committer import FencedError, TableCommitter, LogMessage
from pipeline.testing.trajectories import make_trajectories


def _msg(seq: int, rows, *, producer: str = "p", headers: dict | None = None, payload: bytes | None = None) -> LogMessage:
    mid = wire.msg_id(producer, seq)
    h = {wire.HEADER_ID: mid, wire.HEADER_TABLE: "trajectories", wire.HEADER_WIRE: "1", **(headers or {})}
    return LogMessage(seq, mid, h, payload if payload is not None else wire.encode(rows), None)


def _rows(i: int, n: int = 10):
    return make_trajectories(n, seed=i, id_prefix=f"c{i}-", median_len=8, prompt_len=4)


def _ids(lake):
    return lake.read("trajectories", columns=["trajectory_id"]).column("trajectory_id").to_pylist()


@pytest.fixture(params=["local", "s3"])
def any_lake(request, tmp_path):
    if request.param == "local":
        return Lake(tmp_path / "lake")
    return request.getfixturevalue("s3_lake")


def test_a_stale_committer_cannot_commit(any_lake):
    lake = any_lake
    a = TableCommitter(lake, "trajectories", stream="s")
    b = TableCommitter(lake, "trajectories", stream="s")   # took over: both read fence version 0
    rep = b.land([_msg(1, _rows(1)), _msg(2, _rows(2))])[0]
    assert rep.landed == 20 and rep.txn_version == 2
    version = lake.version("trajectories")
    with pytest.raises(FencedError):
        a.land([_msg(3, _rows(3))])                        # a's read is stale: refused, nothing written
    assert lake.version("trajectories") == version
    assert sorted(_ids(lake)) == sorted(_rows(1).column("trajectory_id").to_pylist()
                                        + _rows(2).column("trajectory_id").to_pylist())
    # the live committer goes on; a restarted one resumes from the transaction (1, 2 acked without landing)
    b.land([_msg(3, _rows(3))])
    c = TableCommitter(lake, "trajectories", stream="s")
    rep = c.land([_msg(2, _rows(2)), _msg(3, _rows(3)), _msg(4, _rows(4))])[0]
    assert rep.skipped == 2 and rep.landed == 10 and rep.txn_version == 4
    ids = _ids(lake)
    assert len(ids) == len(set(ids)) == 40


def test_two_committers_at_the_same_moment_one_commits(tmp_path):
    lake = Lake(tmp_path / "lake")
    twins = [TableCommitter(lake, "trajectories", stream="s") for _ in range(2)]
    gate = threading.Barrier(2)
    out: list = [None, None]

    def run(k: int) -> None:
        gate.wait()
        try:
            out[k] = twins[k].land([_msg(10 + k, _rows(10 + k), producer=f"p{k}")])[0]
        except FencedError as exc:
            out[k] = exc
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fenced = [o for o in out if isinstance(o, FencedError)]
    won = [o for o in out if not isinstance(o, FencedError)]
    assert len(fenced) == 1 and len(won) == 1, out
    assert len(_ids(lake)) == 10
    assert lake.transaction_version("trajectories", wire.app_id("s", "trajectories") + "#fence") == 1


def test_bad_batches_get_one_clear_reason_each(tmp_path):
    lake = Lake(tmp_path / "lake")
    c = TableCommitter(lake, "trajectories", stream="s")
    wrong = _rows(5).drop_columns(["prompt_ids"])      # the wrong schema: a required column missing
    rep = c.land([_msg(1, None, payload=b"not arrow at all"),
                  _msg(2, _rows(6), headers={wire.HEADER_WIRE: "9"}),
                  _msg(3, wrong),
                  _msg(4, _rows(7))])[0]
    assert rep.landed == 10 and rep.txn_version == 4
    q = lake.read("quarantine", columns=["source_fingerprint", "source_row", "reason_code", "reason"]).to_pylist()
    by_msg: dict = {}
    for r in q:
        by_msg.setdefault(r["source_fingerprint"], []).append(r)
    assert sorted(by_msg) == ["p:1", "p:2", "p:3"]
    for mid, entries in by_msg.items():      # one entry for the whole message, with a reason to act on
        assert len(entries) == 1 and entries[0]["source_row"] == -1, entries
    assert by_msg["p:1"][0]["reason_code"] == "bad_payload" and "Arrow IPC" in by_msg["p:1"][0]["reason"]
    assert "wire version" in by_msg["p:2"][0]["reason"]
    assert by_msg["p:3"][0]["reason_code"] == "missing_column" and "prompt_ids" in by_msg["p:3"][0]["reason"]
    # a replay of the same messages (acks lost) quarantines nothing twice and lands nothing twice
    again = TableCommitter(lake, "trajectories", stream="s").land([_msg(3, wrong), _msg(4, _rows(7))])[0]
    assert again.skipped == 2 and len(lake.read("quarantine", columns=["reason_code"])) == 3
    assert len(_ids(lake)) == 10


def test_resent_rows_under_a_new_id_are_duplicates(tmp_path):
    """Past the duplicate window a producer's resend gets a new message id: the row keys catch it."""
    lake = Lake(tmp_path / "lake")
    c = TableCommitter(lake, "trajectories", stream="s")
    c.land([_msg(1, _rows(1))])
    rep = c.land([_msg(2, _rows(1), producer="q"), _msg(3, _rows(2))])[0]
    assert rep.duplicates == 10 and rep.landed == 10
    assert len(_ids(lake)) == 20


def test_a_flush_with_nothing_to_land_still_records_its_sequence(tmp_path):
    lake = Lake(tmp_path / "lake")
    c = TableCommitter(lake, "trajectories", stream="s")
    c.land([_msg(1, _rows(1))])
    rep = c.land([_msg(2, _rows(1), producer="q"), _msg(3, None, payload=b"junk")])[0]
    assert rep.landed == 0 and rep.duplicates == 10 and rep.quarantined == 1 and rep.txn_version == 3
    assert lake.transaction_version("trajectories", wire.app_id("s", "trajectories")) == 3
    assert len(_ids(lake)) == 10


def test_a_flush_validated_as_one_table_attributes_rows_to_their_messages(tmp_path):
    """Messages of one schema are checked together; landed rows and quarantine entries still name their message."""
    lake = Lake(tmp_path / "lake")
    c = TableCommitter(lake, "trajectories", stream="s")
    bad = _rows(2)
    pv = bad.column("policy_version").to_pylist()
    pv[3] = -5                                                                        # row 3: out of range
    bad = bad.set_column(bad.schema.get_field_index("policy_version"), "policy_version", pa.array(pv, pa.int64()))
    rep = c.land([_msg(1, _rows(1)), _msg(2, bad), _msg(3, _rows(3)), _msg(4, _rows(1))])[0]   # 4 resends 1
    assert rep.landed == 29 and rep.quarantined == 1 and rep.duplicates == 10
    got = lake.read("trajectories", columns=["trajectory_id", "ingest_id"]).to_pylist()
    owner = {r["trajectory_id"]: r["ingest_id"] for r in got}
    for k in (1, 2, 3):
        mine = [t for t in _rows(k).column("trajectory_id").to_pylist() if t in owner]
        assert mine and all(owner[t] == f"serve:p:{k}" for t in mine)
    q = lake.read("quarantine", columns=["source_fingerprint", "source_row", "trajectory_id"]).to_pylist()
    assert q == [{"source_fingerprint": "p:2", "source_row": 3,
                  "trajectory_id": bad.column("trajectory_id")[3].as_py()}]



def test_rows_another_writer_lands_meanwhile_are_not_landed_again(tmp_path):
    """pipeline ingest writes the table between two flushes: its keys join the committer's memory."""
    from pipeline.ingest import ingest_table

    lake = Lake(tmp_path / "lake")
    c = TableCommitter(lake, "trajectories", stream="s")
    c.land([_msg(1, _rows(1))])
    ingest_table(lake, _rows(2))                       # another writer
    c.land([_msg(2, _rows(3))])                        # commits after it (no key in common)
    rep = c.land([_msg(3, _rows(2))])[0]               # the other writer's rows, published too
    assert rep.landed == 0 and rep.duplicates == 10
    ids = _ids(lake)
    assert len(ids) == len(set(ids)) == 30
