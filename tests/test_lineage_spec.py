"""Every OpenLineage event of a small full loop (ingest -> admit -> train -> lake
maintain, plus a scheduled job) validates against the official spec 2-0-2 JSON
schemas vendored in tests/lineage_spec/ (Apache-2.0, see its LICENSE), every
facet against the schema its ``_schemaURL`` names, and the datasets join by
(namespace, name): trajectories -> snapshot -> checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

SPEC = Path(__file__).parent / "lineage_spec"


@pytest.fixture(scope="module")
def validator():
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    resources = []
    for f in sorted(SPEC.glob("*.json")):
        doc = json.loads(f.read_text())
        resources.append((doc["$id"], Resource.from_contents(doc)))
    registry = Registry().with_resources(resources)
    root = json.loads((SPEC / "OpenLineage.json").read_text())

    def validate(event: dict) -> list[str]:
        errors = [f"event: {e.message}" for e in Draft202012Validator(root, registry=registry).iter_errors(event)]
        for where, facet in _facets(event):
            url = facet.get("_schemaURL", "")
            base, _, frag = url.partition("#")
            try:
                registry.get_or_retrieve(base)
            except Exception:
                errors.append(f"{where}: _schemaURL {url} is not a spec 2-0-2 schema")
                continue
            sub = {"$ref": url}
            errors += [f"{where}: {e.message}" for e in Draft202012Validator(sub, registry=registry).iter_errors(facet)]
        return errors

    return validate


def _facets(event: dict):
    for k, f in (event.get("run", {}).get("facets") or {}).items():
        yield f"run.{k}", f
    for k, f in (event.get("job", {}).get("facets") or {}).items():
        yield f"job.{k}", f
    for side in ("inputs", "outputs"):
        for d in event.get(side) or []:
            for k, f in (d.get("facets") or {}).items():
                yield f"{side}[{d['name']}].{k}", f


def test_full_loop_events_validate_and_join(lake, tmp_path, validator):
    from pipeline.admission.run import admit
    from pipeline.jobs import JobSpec, run_job
    from pipeline.ingest import ingest_files
    from pipeline.maintain import maintain
    from pipeline.lineage import read_events
    from pipeline.testing.trajectories import make_trajectories
    from pipeline.train.config import TrainConfig
    from pipeline.testing.train_fixtures import publish_tiny_policy
    from pipeline.train.run import train_snapshot

    publish_tiny_policy(lake, vocab_size=30000, hidden_size=16, intermediate_size=32)
    src = tmp_path / "t.parquet"
    pq.write_table(make_trajectories(24, seed=3, median_len=12, prompt_len=4), src)
    ing = ingest_files(lake, [src])
    adm = admit(lake)
    assert adm.snapshot_id
    res = train_snapshot(lake, adm.snapshot_id, TrainConfig(lr=1e-3, max_steps=1), progress=False)
    maintain(lake, dry_run=True)
    job = run_job(lake, JobSpec(name="maint", schedule="* * * * *", args=("lake", "maintain", "--dry-run")))
    assert job["status"] == "ok", job

    events = read_events(lake)
    assert events
    for ev in events:
        assert validator(ev) == [], (ev["job"]["name"], ev["eventType"], validator(ev))

    by_job: dict[str, list[dict]] = {}
    for ev in events:
        by_job.setdefault(ev["job"]["name"], []).append(ev)
    for name in ("pipeline.ingest", "pipeline.admit", "pipeline.train", "pipeline.lake.maintain",
                 "pipeline.jobs.maint"):
        assert [e["eventType"] for e in by_job[name]][:2] == ["START", "COMPLETE"], name
        assert len({e["run"]["runId"] for e in by_job[name][:2]}) == 1
    # every run: job type, processing engine (not for the scheduler's wrapper), resolved config
    for ev in events:
        assert ev["job"]["facets"]["jobType"]["processingType"] == "BATCH"
        assert "executionParameters" in ev["run"]["facets"]
    done = {n: [e for e in evs if e["eventType"] == "COMPLETE"][0] for n, evs in by_job.items()}
    assert done["pipeline.train"]["run"]["facets"]["processing_engine"]["name"] == "deepspeed"
    params = {p["key"]: p["value"] for p in done["pipeline.train"]["run"]["facets"]["executionParameters"]["parameters"]}
    assert params["lr"] == "0.001" and params["max_steps"] == "1"
    # the scheduled job's command names it as parent
    child = [e for e in by_job["pipeline.lake.maintain"] if "parent" in e["run"]["facets"]]
    assert child and child[0]["run"]["facets"]["parent"]["run"]["runId"] == done["pipeline.jobs.maint"]["run"]["runId"]

    # naming spec: local files are namespace "file", the absolute path as name
    root = Path(lake.uri).absolute()
    traj = ("file", str(root / "trajectories"))
    snap = ("file", str(root / "_snapshots" / adm.snapshot_id))
    # a checkpoint is the directory its row names: the publishing run's own (_checkpoints/<id>.<run tag>)
    from pipeline.policy_store import published_rel

    ckpt_rel = published_rel(lake, res.checkpoint_id)
    assert ckpt_rel.startswith(f"_checkpoints/{res.checkpoint_id}.")
    ckpt = ("file", str(root / ckpt_rel))
    outs = lambda e: {(d["namespace"], d["name"]): d for d in e["outputs"]}   # noqa: E731
    ins = lambda e: {(d["namespace"], d["name"]): d for d in e["inputs"]}     # noqa: E731
    assert ins(done["pipeline.ingest"])[("file", str(src.absolute()))]
    t_out = outs(done["pipeline.ingest"])[traj]
    assert t_out["facets"]["version"]["datasetVersion"] == str(ing.trajectories_version)
    assert [f["name"] for f in t_out["facets"]["schema"]["fields"]][:2] == ["trajectory_id", "group_id"]
    # trajectories -> snapshot -> checkpoint
    t_in = ins(done["pipeline.admit"])[traj]
    assert t_in["facets"]["version"]["datasetVersion"] == str(adm.source_versions["trajectories"])
    assert outs(done["pipeline.admit"])[snap]["facets"]["version"]["datasetVersion"] == adm.snapshot_id
    assert snap in ins(done["pipeline.train"])
    assert outs(done["pipeline.train"])[ckpt]["facets"]["version"]["datasetVersion"] == str(res.policy_version)
    assert Path(snap[1]).is_dir() and Path(ckpt[1]).is_dir() and Path(traj[1], "_delta_log").is_dir()


def test_failed_job_emits_fail(lake, tmp_path, validator):
    from pipeline.errors import PipelineError
    from pipeline.ingest import ingest_files
    from pipeline.lineage import read_events

    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(PipelineError):
        ingest_files(lake, [bad])
    ev = read_events(lake)
    assert [e["eventType"] for e in ev] == ["START", "FAIL"]
    assert "errorMessage" in ev[1]["run"]["facets"]
    assert all(validator(e) == [] for e in ev)


def test_s3_names_follow_the_naming_spec():
    from pipeline.lineage import location

    assert location("s3://bucket/some/lake/trajectories") == ("s3://bucket", "some/lake/trajectories")
    assert location("/tmp/x/../lake/t")[0] == "file"
    assert location("file:///data/lake/t") == ("file", "/data/lake/t")


def test_user_transport_from_standard_config(lake, tmp_path, monkeypatch):
    """OPENLINEAGE__TRANSPORT__* (the client's own configuration) replaces the lake's file."""
    from pipeline.maintain import maintain
    from pipeline.lineage import lineage_file

    target = tmp_path / "user.jsonl"
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "file")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__LOG_FILE_PATH", str(target))
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__APPEND", "true")
    maintain(lake)
    lines = [json.loads(x) for x in target.read_text().splitlines()]
    assert [e["eventType"] for e in lines] == ["START", "COMPLETE"]
    assert not lineage_file(lake).exists()


def test_the_validator_rejects_a_broken_event(validator):
    """The check is live: a bad event type, a facet missing a required field and
    an unknown facet version are all reported."""
    ev = {"eventType": "BOGUS", "eventTime": "2026-01-01T00:00:00+00:00", "producer": "https://x",
          "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
          "run": {"runId": "0190a1b2-0000-7000-8000-000000000000", "facets": {
              "processing_engine": {"_producer": "https://x", "name": "x",
                                    "_schemaURL": "https://openlineage.io/spec/facets/1-1-1/"
                                                  "ProcessingEngineRunFacet.json#/$defs/ProcessingEngineRunFacet"},
              "old": {"_producer": "https://x",
                      "_schemaURL": "https://openlineage.io/spec/facets/0-0-1/Nope.json#/$defs/Nope"}}},
          "job": {"namespace": "n", "name": "j"}}
    errors = validator(ev)
    assert any(e.startswith("event:") for e in errors)
    assert any(e.startswith("run.processing_engine") and "version" in e for e in errors)
    assert any(e.startswith("run.old") for e in errors)
