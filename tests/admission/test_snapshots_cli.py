"""Snapshot immutability through lake maintenance and copies; the CLI; bucket rates."""

from __future__ import annotations

import json
import shutil

import pytest

from admission_rows import NOW, land, traj
from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit
from pipeline.snapshots.format import read_snapshot_table, verify_snapshot
from pipeline.cli import main
from pipeline.errors import IntegrityError
from pipeline.lake.delta import Lake
from pipeline.lake.ingest import stamp_derived

CFG = AdmissionConfig(quality=False)


def test_snapshot_survives_append_compact_vacuum_and_copy(tmp_path, make_traj, capsys):
    lake = Lake(tmp_path / "lake")
    lake.append("trajectories", stamp_derived(make_traj(60, seed=1), "i1"), command="test")
    first = admit(lake, CFG)
    sid = first.snapshot_id
    before = read_snapshot_table(lake, sid)
    for seed in (2, 3):  # more data, more snapshots, more files to compact
        lake.append("trajectories", stamp_derived(make_traj(60, seed=seed), f"i{seed}"), command="test")
        admit(lake, CFG)
    for t in ("trajectories", "receipts", "snapshots", "snapshot_members"):
        lake.compact(t)
        lake.checkpoint(t)
        lake.vacuum(t, retention_hours=0, keep_versions=None, dry_run=False)
    assert verify_snapshot(lake, sid)["registered"]
    copy = tmp_path / "elsewhere" / "lake"
    shutil.copytree(tmp_path / "lake", copy)
    moved = Lake(copy)
    assert main(["snapshots", "verify", sid, "--lake", str(copy), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ok"] and out["snapshot_id"] == sid and out["members"] == first.admitted_members
    assert read_snapshot_table(moved, sid).equals(before)
    # the same members and config still hash to the same id
    from pipeline.snapshots.format import compute_snapshot_id

    assert compute_snapshot_id(zip(before.column("trajectory_id").to_pylist(),
                                   before.column("content_hash").to_pylist()),
                               first.config_hash, "grpo") == sid


def test_verify_detects_tampering(lake, make_traj):
    lake.append("trajectories", stamp_derived(make_traj(40, seed=1), "i1"), command="test")
    sid = admit(lake, CFG).snapshot_id
    path = lake.uri + f"/_snapshots/{sid}/members.parquet"
    data = bytearray(open(path, "rb").read())
    data[100] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(IntegrityError, match="sha256"):
        verify_snapshot(lake, sid)
    assert main(["snapshots", "verify", sid, "--lake", lake.uri]) != 0


def test_payload_matches_source_rows_and_advantages(lake, make_traj):
    src = make_traj(40, seed=4)
    lake.append("trajectories", stamp_derived(src, "i1"), command="test")
    res = admit(lake, CFG)
    snap = read_snapshot_table(lake, res.snapshot_id)
    assert snap.num_rows == res.admitted_members
    keys = list(zip(snap.column("group_id").to_pylist(), snap.column("trajectory_id").to_pylist()))
    assert keys == sorted(keys)
    by_id = {r["trajectory_id"]: r for r in src.to_pylist()}
    adv = dict(zip(res.members.column("trajectory_id").to_pylist(), res.members.column("advantage").to_pylist()))
    for row in snap.to_pylist():
        s = by_id[row["trajectory_id"]]
        for c in ("response_ids", "prompt_ids", "loss_mask", "token_policy_versions", "content_hash"):
            assert row[c] == s[c]
        assert row["response_logprobs"] == pytest.approx(s["response_logprobs"])
        assert row["advantage"] == adv[row["trajectory_id"]]
        assert row["snapshot_id"] == res.snapshot_id
    reg = lake.read("snapshots").to_pylist()[0]
    assert reg["num_tokens"] == sum(len(r["response_ids"]) for r in snap.to_pylist())
    assert dict(reg["source_versions"]) == {"trajectories": 1, "receipts": -1}


def test_cli_admit_dry_run_then_admit_then_list_and_show(tmp_path, make_traj, capsys):
    uri = str(tmp_path / "lake")
    Lake(uri).append("trajectories", stamp_derived(make_traj(40, seed=1), "i1"), command="test")
    assert main(["admit", "--lake", uri, "--dry-run", "--json", "--set", "quality=false"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["dry_run"] and len(dry["receipts"]) == 10 and not Lake(uri).exists("receipts")
    assert main(["admit", "--lake", uri, "--set", "quality=false", "--target-groups", "20"]) == 0
    text = capsys.readouterr().out.strip().splitlines()
    assert text[-1] == dry["snapshot_id"]  # the id is the last line
    assert any("missing" in ln for ln in text)
    assert main(["snapshots", "list", "--lake", uri, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["snapshots"]
    assert [s["snapshot_id"] for s in listed] == [dry["snapshot_id"]]
    assert main(["snapshots", "show", dry["snapshot_id"], "--lake", uri, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["registered"] and shown["receipted_groups"] == dry["counts"]["admit"]
    # as a person reads it: the receipts table that did not exist yet is not "receipts@v-1", and a
    # quality line has values or is left out
    assert shown["row"]["source_versions"]["receipts"] == -1
    assert main(["snapshots", "show", dry["snapshot_id"], "--lake", uri]) == 0
    text = capsys.readouterr().out
    assert "@v-1" not in text and "receipts (not yet created)" in text
    assert f"trajectories@v{shown['row']['source_versions']['trajectories']}" in text
    assert all(ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.strip().startswith("quality:"))
    assert main(["admit", "--lake", uri, "--set", "nope=1"]) == 2  # unknown config keys are errors


def test_bucket_rates_sql(lake):
    from pipeline.query.duck import query
    from pipeline.resources import sql_path

    rows = ([traj(f"a{k}", "easy1", reward=float(k % 2), difficulty="easy") for k in range(4)]
            + [traj(f"b{k}", "easy2", reward=1.0, difficulty="easy") for k in range(4)]
            + [traj(f"c{k}", "hard1", reward=float(k % 2), difficulty="hard", response_len=2000,
                    policy_version=2, tpv=[2] * 2000) for k in range(4)])
    land(lake, rows)
    admit(lake, CFG, current_policy_version=5, now=NOW)  # hard1 is stale: insufficient_valid
    t = query(lake, sql_path("bucket_rates").read_text())
    got = {(r["bucket"], r["label"]): (r["groups"], r["admitted"], r["admit_rate"], r["zero_variance"],
                                       r["insufficient_valid"], r["excluded_members"]) for r in t.to_pylist()}
    assert got[("difficulty", "easy")] == (2, 1, 0.5, 1, 0, 0)
    assert got[("difficulty", "hard")] == (1, 0, 0.0, 0, 1, 4)
    assert got[("length", "1024-4096")] == (1, 0, 0.0, 0, 1, 4)
    assert got[("length", "<256")] == (2, 1, 0.5, 1, 0, 0)
    t2 = query(lake, sql_path("bucket_rates").read_text(), params={"run_id": "other"})
    assert t2.num_rows == 0


def test_short_ids_and_readable_show(lake, make_traj, capsys):
    """The 12-character ids reports and progress lines print are accepted; `show` prints text, not raw JSON."""
    lake.append("trajectories", stamp_derived(make_traj(40, seed=1), "i1"), command="test")
    sid = admit(lake, CFG).snapshot_id
    capsys.readouterr()
    assert main(["snapshots", "show", sid[:12], "--lake", lake.uri]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"snapshot {sid}\n") and "members:" in text and "{" not in text.splitlines()[1]
    assert main(["snapshots", "show", sid[:12], "--lake", lake.uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["snapshot_id"] == sid
    assert main(["snapshots", "verify", sid[:8], "--lake", lake.uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["snapshot_id"] == sid
    assert main(["snapshots", "show", sid[:3], "--lake", lake.uri]) == 2
    assert "too short" in capsys.readouterr().err
    other = "0" * 12 if not sid.startswith("0" * 12) else "f" * 12
    assert main(["snapshots", "show", other, "--lake", lake.uri]) == 2
    assert "not found" in capsys.readouterr().err


def test_ambiguous_prefix_is_refused(lake, make_traj):
    import pyarrow as pa

    from pipeline.errors import NotFoundError
    from pipeline.snapshots import format as fmt

    lake.append("trajectories", stamp_derived(make_traj(40, seed=1), "i1"), command="test")
    sid = admit(lake, CFG).snapshot_id
    twin = sid[:8] + ("0" if sid[8] != "0" else "1") + sid[9:]   # shares 8 characters with sid
    row = lake.read("snapshots").slice(0, 1)
    row = row.set_column(row.schema.get_field_index("snapshot_id"), "snapshot_id", pa.array([twin]))
    lake.append("snapshots", row, command="test")
    with pytest.raises(NotFoundError, match="matches 2 snapshots"):
        fmt.resolve_snapshot_id(lake, sid[:8])
    assert fmt.resolve_snapshot_id(lake, sid[:9]) == sid
    assert fmt.resolve_snapshot_id(lake, twin[:9]) == twin
