"""One lake-argument convention: every public function that takes a lake
accepts a Lake, a path (str or os.PathLike, file:// included) or an
object-store URI, converted in one place (pipeline.lake.ref.as_lake).

Each function of docs/architecture.md "The lake argument" is called with every
form on the same lake and must give what it gives for the Lake itself (or, for
the ones that need a trained policy, the same error naming the same lake)."""

from __future__ import annotations

import inspect
import importlib
import re
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.admission.config import AdmissionConfig
from pipeline.errors import InputFileError, NotFoundError
from pipeline.lake.delta import Lake
from pipeline.lake.ref import as_lake
from pipeline.testing.trajectories import make_trajectories

ROOT = Path(__file__).resolve().parents[2]
FORMS = {
    "Lake": lambda root: Lake(root),
    "str": lambda root: str(root),
    "PathLike": lambda root: Path(root),
    "file-uri": lambda root: f"file://{root}",
}
CFG = AdmissionConfig(quality=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A lake with 16 landed trajectories, one admitted snapshot and a Parquet file of the same rows."""
    from pipeline.admission.run import admit
    from pipeline.ingest import ingest_table

    base = tmp_path_factory.mktemp("lakearg")
    root = base / "lake"
    rows = make_trajectories(16, seed=3, group_size=4, median_len=12, prompt_len=4)
    assert ingest_table(Lake(root), rows).landed == 16
    sid = admit(Lake(root), CFG, current_policy_version=0).snapshot_id
    assert sid
    import pyarrow.parquet as pq

    pq.write_table(rows, base / "rows.parquet")
    return root, sid, rows, base


def _calls(world):
    """name -> f(lake) returning a comparable value, for every public lake-taking function."""
    root, sid, rows, base = world
    import pipeline.snapshots
    from pipeline import lineage
    from pipeline.admission.run import admit
    from pipeline.ingest import ingest_files, ingest_table
    from pipeline.lake import lease
    from pipeline.maintain import maintain
    from pipeline.policy_store import import_policy, latest_policy_version, list_policies, resolve_policy
    from pipeline.query.duck import connect, query
    from pipeline.report.build import build_report, write_report
    from pipeline.rollout.run import run_rollout
    from pipeline.snapshots.format import open_snapshot, read_snapshot_table, verify_snapshot
    from pipeline.train.run import train_snapshot

    def err(f):
        try:
            f()
        except (NotFoundError, InputFileError) as exc:
            return type(exc).__name__, str(exc)
        raise AssertionError("expected an error")

    def lease_round(lk):
        got = lease.acquire(lk, "arg-lease", owner="t", ttl=60)
        held, rec = lease.try_acquire(lk, "arg-lease", owner="u", ttl=60)
        assert got is not None and held is None
        with pytest.raises(lease.LeaseHeldError):
            lease.require(lk, "arg-lease", owner="u", ttl=60)
        owner = (lease.holder(lk, "arg-lease") or {}).get("owner")
        got.release()
        return owner, (rec or {}).get("owner"), lease.holder(lk, "arg-lease")

    return {
        "pipeline.ingest.ingest_table": lambda lk: {k: v for k, v in ingest_table(lk, rows).as_dict().items()
                                                    if k not in ("ingest_id", "timings")},
        "pipeline.ingest.ingest_files": lambda lk: ingest_files(lk, [base / "rows.parquet"]).duplicates,
        "pipeline.snapshots.open": lambda lk: pipeline.snapshots.open(lk, sid).table().to_pylist(),
        "pipeline.snapshots.format.open_snapshot": lambda lk: open_snapshot(lk, sid).manifest,
        "pipeline.snapshots.format.read_snapshot_table": lambda lk: read_snapshot_table(lk, sid).to_pylist(),
        "pipeline.snapshots.format.verify_snapshot": lambda lk: verify_snapshot(lk, sid),
        "pipeline.admission.run.admit": lambda lk: admit(lk, CFG, current_policy_version=0, dry_run=True).counts,
        "pipeline.maintain.maintain": lambda lk: maintain(lk, dry_run=True, tables=["receipts"])["tables"],
        "pipeline.query.duck.query": lambda lk: query(lk, "SELECT count(*) AS n, sum(reward) AS r FROM trajectories"
                                                      ).to_pylist(),
        "pipeline.query.duck.connect": lambda lk: connect(lk, tables={"receipts"}).execute(
            "SELECT count(*) FROM receipts").fetchall(),
        "pipeline.lineage.walk": lambda lk: err(lambda: lineage.walk(lk, "no-such-checkpoint")),
        "pipeline.lineage.read_events": lambda lk: lineage.read_events(lk),
        "pipeline.lake.lease.holder": lambda lk: lease.holder(lk, "nobody-holds-this"),
        "pipeline.lake.lease.try_acquire": lease_round,
        "pipeline.lake.lease.acquire": lease_round,
        "pipeline.lake.lease.require": lease_round,
        "pipeline.policy_store.latest_policy_version": lambda lk: latest_policy_version(lk),
        "pipeline.policy_store.list_policies": lambda lk: list_policies(lk),
        "pipeline.policy_store.resolve_policy": lambda lk: err(lambda: resolve_policy(lk)),
        "pipeline.policy_store.import_policy": lambda lk: err(lambda: import_policy(lk, base / "no-model-here")),
        # the report of the full lake takes ~20 s on a loaded box: an empty lake's is ~4 s and names its lake too
        "pipeline.report.build.build_report": lambda lk: _report(build_report(_empty(lk, base))),
        "pipeline.report.build.write_report": lambda lk: write_report(_empty(lk, base), base / "report.html"),
        "pipeline.rollout.run.run_rollout": lambda lk: err(lambda: run_rollout(lk, groups=1, group_size=2)),
        "pipeline.train.run.train_snapshot": lambda lk: err(lambda: train_snapshot(lk, sid)),
    }


def _empty(lk, base: Path):
    """The same form of the argument, for the empty lake beside ``world``'s."""
    if isinstance(lk, Lake):
        return Lake(base / "empty")
    return type(lk)(str(lk).replace(str(base / "lake"), str(base / "empty")))


def _report(out: tuple[str, dict]) -> dict:
    page, summary = out
    lake_line = re.search(r"lake: ([^<]+)", page)
    return {**summary, "lake": lake_line.group(1) if lake_line else None}


def _documented() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The lake argument", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `([\w.]+)`", section, re.M)


def test_the_documented_list_is_what_is_called_and_each_is_typed_for_every_form(world):
    documented = _documented()
    assert sorted(documented) == sorted(_calls(world))
    for name in documented:
        mod, fn = name.rsplit(".", 1)
        f = getattr(importlib.import_module(mod), fn)
        ann = inspect.signature(f).parameters["lake"].annotation
        assert ann == "Lake | str | os.PathLike[str]", (name, ann)


@pytest.mark.slow   # ~1 min on a loaded box: two reports and two trainer start-ups per form
def test_every_public_function_takes_each_form(world):
    root = world[0]
    for name, call in _calls(world).items():
        for form in FORMS:
            if form == "Lake":
                continue
            want = call(FORMS["Lake"](root))   # again each time: ingest, admit and maintain add lineage events
            got = call(FORMS[form](root))
            assert got == want, (name, form)
            if isinstance(want, tuple) and want[0] == "NotFoundError" and "lake" in want[1]:
                assert str(root) in want[1], want   # the error names the very lake the URI resolved to


def test_an_object_store_uri(s3_env, tmp_path):
    """``s3://bucket/lake`` (credentials from the AWS_* environment) works like a Lake."""
    import pipeline.snapshots
    from pipeline.admission.run import admit
    from pipeline.ingest import ingest_table
    from pipeline.query.duck import query

    _, bucket = s3_env
    uri = f"s3://{bucket}/lake"
    rows = make_trajectories(8, seed=5, group_size=4, median_len=8, prompt_len=4)
    assert ingest_table(uri, rows).landed == 8
    assert ingest_table(Lake(uri), rows).duplicates == 8
    assert query(uri, "SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": 8}]
    sid = admit(uri, CFG, current_policy_version=0).snapshot_id
    assert pipeline.snapshots.open(uri, sid).table().num_rows == pipeline.snapshots.open(Lake(uri), sid).table().num_rows


def test_anything_else_is_refused_with_what_to_pass():
    lk = Lake.__new__(Lake)
    assert as_lake(lk) is lk
    for bad in (None, 3, pa.table({"a": [1]})):
        with pytest.raises(TypeError, match="a path or a URI"):
            as_lake(bad)  # type: ignore[arg-type]
