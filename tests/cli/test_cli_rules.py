"""Operator-facing rules of the CLI (issue 15): a missing lake is an error for
read commands and is never created by them; results alone on stdout; exit codes;
no traceback for user errors; no Python reprs in text output; complete --help."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.cli import build_parser, main


def _lake_with_trajectories(tmp_path, make_traj, n=24, seed=0, batches=1):
    from pipeline.lake.delta import Lake
    from pipeline.lake.ingest import stamp_derived

    lake = Lake(tmp_path / "lake")
    for k in range(batches):
        lake.append("trajectories", stamp_derived(make_traj(n, seed=seed + k, median_len=8), "t"), command="test")
    return lake


# -- a lake that does not exist -------------------------------------------------------------------
READ_COMMANDS = [
    ["snapshots", "list"], ["snapshots", "show", "a" * 64], ["snapshots", "verify", "a" * 64], ["admit"],
    ["lake", "info"], ["lake", "maintain"], ["report"], ["sql", "SELECT 1"], ["lineage", "0"],
    ["train", "--batch-snapshot", "a" * 64], ["policy", "eval"], ["policy", "repair"],
]


@pytest.mark.parametrize("cmd", READ_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_read_commands_refuse_a_missing_lake_and_create_nothing(tmp_path, capsys, cmd):
    missing = tmp_path / "typo" / "lake"
    code = main(cmd + ["--lake", str(missing)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"lake {missing} does not exist" in err and "Traceback" not in err
    assert not missing.exists() and not missing.parent.exists()


def test_write_command_creates_the_lake_and_says_so(tmp_path, make_traj, capsys):
    f = tmp_path / "in.parquet"
    pq.write_table(make_traj(8, seed=1, median_len=8), f)
    lake = tmp_path / "new" / "lake"
    assert main(["ingest", str(f), "--lake", str(lake)]) == 0
    captured = capsys.readouterr()
    assert f"created lake {lake}" in captured.err and "created lake" not in captured.out
    assert (lake / "trajectories").is_dir()


def test_ingest_of_a_missing_file_creates_no_lake(tmp_path, capsys):
    lake = tmp_path / "lake"
    assert main(["ingest", str(tmp_path / "nope.parquet"), "--lake", str(lake)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not lake.exists()


def test_ingest_exits_1_when_every_row_was_quarantined(tmp_path, make_traj, capsys):
    import pyarrow as pa

    t = make_traj(6, seed=2, median_len=8)
    t = t.set_column(t.schema.get_field_index("status"), "status", pa.array(["BOGUS"] * t.num_rows))
    f = tmp_path / "bad.parquet"
    pq.write_table(t, f)
    code = main(["ingest", str(f), "--lake", str(tmp_path / "lake"), "--json"])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["quarantined"] == 6 and report["landed"] == 0
    assert code == 1 and "nothing landed" in captured.err
    # re-ingesting an already landed file is a no-op, not a failure
    good = tmp_path / "good.parquet"
    pq.write_table(make_traj(4, seed=3, median_len=8), good)
    assert main(["ingest", str(good), "--lake", str(tmp_path / "lake")]) == 0
    assert main(["ingest", str(good), "--lake", str(tmp_path / "lake")]) == 0


# -- stdout carries only the result -------------------------------------------------------------------
def test_stdout_carries_only_results_even_from_child_processes(capfd):
    from pipeline.cli import out, stdout_for_results

    with stdout_for_results():
        print("library chatter")                      # Python-level print
        os.write(1, b"native chatter\n")              # a C library writing to fd 1
        subprocess.run([sys.executable, "-c", "print('child chatter')"], check=True)   # a worker process
        out("RESULT")
    captured = capfd.readouterr()
    assert captured.out == "RESULT\n"
    for noise in ("library chatter", "native chatter", "child chatter"):
        assert noise in captured.err


def test_third_party_noise_is_silenced_unless_verbose(capsys, monkeypatch):
    import logging

    from pipeline.console import QUIET_ENV, quiet_third_party

    for key in QUIET_ENV:  # a setting the user (or an earlier vLLM test) made is respected: start from none
        monkeypatch.delenv(key, raising=False)

    ds = logging.getLogger("DeepSpeed")
    dist = logging.getLogger("distributed")
    shuffle = logging.getLogger("distributed.shuffle._scheduler_plugin")
    handler = logging.StreamHandler(sys.stderr)
    ds.addHandler(handler)
    dist.addHandler(handler)
    # importing distributed earlier in the session (a Dask test) sets its loggers' levels from
    # dask's config: start from levels that let a warning through, as in a fresh process
    chain = [ds, dist, logging.getLogger("distributed.shuffle"), shuffle]
    for lg in chain:  # dask's logging config may also have disabled them or cut propagation
        monkeypatch.setattr(lg, "level", logging.WARNING if lg is dist else logging.NOTSET)
        monkeypatch.setattr(lg, "disabled", False)
        monkeypatch.setattr(lg, "propagate", True)
        monkeypatch.setattr(lg, "filters", [])
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with quiet_third_party(verbose=False):
                assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"   # inherited by workers
                assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
                ds.warning("Setting accelerator to CPU")
                shuffle.warning("Shuffle 512bb initialized by task")
                warnings.warn("dask shuffle chatter", UserWarning)
            err = capsys.readouterr().err
            assert not seen and "Setting accelerator" not in err and "Shuffle" not in err
            with quiet_third_party(verbose=True):
                ds.warning("Setting accelerator to CPU")
                shuffle.warning("Shuffle 512bb initialized by task")
                warnings.warn("dask shuffle chatter", UserWarning)
            err = capsys.readouterr().err
            assert seen and "Setting accelerator" in err and "Shuffle" in err
    finally:
        ds.removeHandler(handler)
        dist.removeHandler(handler)


# -- sql ------------------------------------------------------------------------------------------
def test_sql_csv_uses_lf(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj)
    assert main(["sql", "--lake", lake.uri, "--csv", "SELECT 1 AS a, 'x' AS b UNION ALL SELECT 2, 'y'"]) == 0
    out = capsys.readouterr().out
    assert out == "a,b\n1,x\n2,y\n"


def test_sql_file_unknown_is_a_clear_error(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj)
    assert main(["sql", "--lake", lake.uri, "--file", "no_such_query"]) == 2
    err = capsys.readouterr().err
    assert "no named query 'no_such_query'" in err and "Traceback" not in err and "freshness" in err


def test_sql_params_strings_stay_strings_unknown_refused(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj)
    assert main(["sql", "--lake", lake.uri, "--json", "--param", "v=007", "SELECT $v AS v"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == [{"v": "007"}]
    assert main(["sql", "--lake", lake.uri, "--json", "--param", "v:int=007", "SELECT $v AS v"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == [{"v": 7}]
    assert main(["sql", "--lake", lake.uri, "--param", "run=x", "SELECT $run_id AS v"]) == 2
    err = capsys.readouterr().err
    assert "--param run: the query has no such parameter" in err and "run_id" in err


def test_sql_as_of_unknown_table_refused(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj)
    assert main(["sql", "--lake", lake.uri, "--as-of", "trajectorys=0", "SELECT count(*) FROM trajectories"]) == 2
    assert "trajectorys: no such table" in capsys.readouterr().err


def test_sql_admission_groups_not_listed_and_refused_clearly(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj)
    assert main(["sql", "--list", "--lake", lake.uri]) == 0
    listed = capsys.readouterr().out
    assert "admission_members" in listed and "admission_groups" not in listed
    assert main(["sql", "--lake", lake.uri, "--file", "admission_groups"]) == 2
    assert "not runnable on its own" in capsys.readouterr().err


def test_sql_as_of_a_vacuumed_version_has_no_escape_codes(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj, batches=3)
    assert main(["lake", "maintain", "--lake", lake.uri, "--retention-hours", "0"]) == 0
    capsys.readouterr()
    assert main(["sql", "--lake", lake.uri, "--as-of", "1", "SELECT count(*) FROM trajectories"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "removed by vacuum" in err


def test_clean_message_strips_ansi():
    from pipeline.cli import clean_message

    assert clean_message("\x1b[31mboom\x1b[0m at \x1b[1mhere\x1b[0m") == "boom at here"


def test_sql_into_a_closed_pipe_is_not_a_traceback(tmp_path):
    tmp_path.joinpath("lake").mkdir()
    r, w = os.pipe()
    os.close(r)          # the reader (`| head`) is already gone
    try:
        proc = subprocess.run([sys.executable, "-m", "pipeline", "sql", "--lake", str(tmp_path / "lake"),
                               "SELECT * FROM range(20000)"], stdout=w, stderr=subprocess.PIPE, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    finally:
        os.close(w)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


# -- snapshots --------------------------------------------------------------------------------------
def test_snapshots_show_refuses_path_traversal(tmp_path, capsys):
    from pipeline.lake.delta import Lake

    lake = Lake(tmp_path / "lake")
    planted = Path(lake.uri) / "x"
    planted.mkdir()
    (planted / "manifest.json").write_text(json.dumps({"files": {"members.parquet": {"sha256": "0"}}}))
    assert main(["snapshots", "show", "../x", "--lake", lake.uri]) == 2
    err = capsys.readouterr().err
    assert "'../x' is not a snapshot id" in err


def test_deleted_or_unparseable_manifest_is_a_clear_error(tmp_path, capsys):
    from pipeline.lake.delta import Lake
    from pipeline.testing.train_fixtures import publish_synthetic_snapshot

    lake = Lake(tmp_path / "lake")
    sid = publish_synthetic_snapshot(lake, 8, median_len=6, prompt_len=4)
    manifest = Path(lake.uri) / "_snapshots" / sid / "manifest.json"
    manifest.write_text("{not json")
    for cmd in (["snapshots", "verify", sid], ["snapshots", "show", sid]):
        assert main(cmd + ["--lake", lake.uri]) == 2
        err = capsys.readouterr().err
        assert "manifest.json is not a valid manifest" in err and "Traceback" not in err
    manifest.unlink()
    assert main(["snapshots", "verify", sid, "--lake", lake.uri]) == 2
    err = capsys.readouterr().err
    assert "is registered but its manifest.json is missing" in err


# -- lake maintain / info ---------------------------------------------------------------------------
def test_maintain_dry_run_reports_what_a_real_run_does(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj, batches=4)
    log = Path(lake.table_uri("trajectories")) / "_delta_log"
    assert main(["lake", "maintain", "--lake", lake.uri, "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["tables"]["trajectories"]
    assert not list(log.glob("*.checkpoint.parquet")), "a dry run writes no checkpoint"
    assert main(["lake", "maintain", "--lake", lake.uri, "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "dry run: nothing was changed" in text and "checkpoint at version" not in text
    assert main(["lake", "maintain", "--lake", lake.uri, "--json"]) == 0
    done = json.loads(capsys.readouterr().out)["tables"]["trajectories"]
    assert plan["files_before"] == done["files_before"] > done["files_after"]
    assert plan["files_after_estimate"] == done["files_after"]
    assert plan["would_compact_files"] >= done["files_before"] - done["files_after"] > 0


def test_lake_info_shows_sizes(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj)
    assert main(["lake", "info", "--lake", lake.uri, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    on_disk = sum(p.stat().st_size for p in Path(lake.table_uri("trajectories")).rglob("*.parquet"))
    assert info["tables"]["trajectories"]["bytes"] == on_disk > 0
    assert main(["lake", "info", "--lake", lake.uri]) == 0
    assert "KiB" in capsys.readouterr().out


# -- text output: no Python reprs ---------------------------------------------------------------------
def test_admit_text_has_no_dict_reprs(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj, n=16)
    assert main(["admit", "--lake", lake.uri, "--set", "quality=false", "--set", "group_timeout_s=0",
                 "--set", "max_policy_lag=100"]) == 0
    out = capsys.readouterr().out
    assert "decided" in out and "{" not in out and "'" not in out


def test_simulate_and_lineage_text_have_no_dict_reprs(capsys):
    from pipeline.lineage import format_walk

    assert main(["simulate", "--set", "duration_h=0.05", "--set", "workers=8"]) == 0
    out = capsys.readouterr().out
    assert "group decisions" in out and "{" not in out
    walk = {"checkpoint_id": "c", "policy_version": 1, "parent_checkpoint_id": None, "global_step": 1, "seed": 0,
            "world_size": 1, "code_version": "x", "ancestors": [], "events": [],
            "snapshots": [{"snapshot_id": "s", "source_versions": {"trajectories": 3, "receipts": -1}}]}
    text = format_walk(walk)
    assert "trajectories version 3" in text and "{" not in text


# -- --help -------------------------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from _subparsers(sub, path + (name,))


def test_every_command_explains_every_option_and_config_key():
    from pipeline.admission.config import AdmissionConfig
    from pipeline.demo import DemoConfig
    from pipeline.rollout.policy import PolicyInitConfig
    from pipeline.rollout.run import RolloutConfig
    from pipeline.sim.config import SimConfig
    from pipeline.train.config import TrainConfig

    configs = {("rollout",): RolloutConfig, ("policy", "init"): PolicyInitConfig, ("admit",): AdmissionConfig,
               ("train",): TrainConfig, ("simulate",): SimConfig, ("demo",): DemoConfig}
    import dataclasses

    for path, sub in _subparsers(build_parser()):
        has_actions = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
        if not has_actions:
            assert sub.description, f"pipeline {' '.join(path)} has no description"
            # a module docstring as description leaks its first line ("CLI: `pipeline report` — ...")
            assert not sub.description.lstrip().startswith(("CLI:", "`pipeline")), \
                f"pipeline {' '.join(path)} --help starts with a docstring line: {sub.description.splitlines()[0]!r}"
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"pipeline {' '.join(path)}: {action.option_strings or action.dest} has no help"
        if path in configs:
            text = sub.format_help()
            for f in dataclasses.fields(configs[path]):
                assert f.name in text, f"pipeline {' '.join(path)} --help does not list key {f.name}"
                first_words = " ".join(f.metadata.get("help", "").split()[:3])
                assert first_words and first_words in " ".join(text.split()), \
                    f"pipeline {' '.join(path)} --help does not explain key {f.name}"


# -- progress -----------------------------------------------------------------------------------------
def test_policy_init_shows_progress_on_a_terminal(tmp_path, monkeypatch):
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    code = main(["policy", "init", "--lake", str(tmp_path / "lake"), "--warm-start-steps", "3",
                 "--set", "demonstrations=40", "--set", "batch_size=4", "--set", "hidden_size=32",
                 "--set", "num_heads=1", "--set", "intermediate_size=32", "--json"])
    assert code == 0, err.getvalue()
    assert "warm start" in err.getvalue() and "/3 [" in err.getvalue()
    # the bootstrap flavour is a no-op once a policy exists
    assert main(["policy", "init", "--if-missing", "--lake", str(tmp_path / "lake"), "--set", "seed=5"]) == 0


def test_an_unwritable_output_path_is_a_user_error_not_a_traceback(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    code = main(["simulate", "--set", "duration_h=0.05", "--set", "workers=8", "--out", str(blocker / "sub")])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {blocker}" in err and "Traceback" not in err


def test_sql_param_takes_the_type_a_named_query_declares(tmp_path, make_traj, capsys):
    lake = _lake_with_trajectories(tmp_path, make_traj)
    q = tmp_path / "q.sql"
    q.write_text("-- @param lag = 1\n-- @param tag = 'x'\nSELECT $lag * 2 AS twice, $tag AS tag\n")
    assert main(["sql", "--lake", lake.uri, "--json", "--file", str(q), "--param", "lag=3", "--param", "tag=007"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == [{"twice": 6, "tag": "007"}]
    assert main(["sql", "--lake", lake.uri, "--file", str(q), "--param", "lag=abc"]) == 2
    assert "expects an integer" in capsys.readouterr().err


def test_jobs_render_k8s_is_a_verb(tmp_path, monkeypatch, capsys):
    from pipeline.jobs import load_jobs, render_cronjobs

    monkeypatch.chdir(tmp_path)
    assert main(["jobs", "render-k8s"]) == 2, "outside a checkout it must ask for --out"
    assert "--out" in capsys.readouterr().err
    assert main(["jobs", "render-k8s", "--out", str(tmp_path / "k8s"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["cronjobs"] >= 1
    assert (tmp_path / "k8s" / "cronjobs.yaml").read_text() == render_cronjobs(load_jobs())


def test_jobs_render_k8s_writes_services_too(tmp_path, capsys):
    """`pipeline jobs render-k8s` writes the same two files as `python -m pipeline.jobs --render-k8s`
    (the resident trainer runs as a Deployment in services.yaml)."""
    from pipeline.jobs import load_jobs, render_main, render_services

    assert main(["jobs", "render-k8s", "--out", str(tmp_path / "cli"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["deployments"] >= 1 and len(res["paths"]) == 2
    assert (tmp_path / "cli" / "services.yaml").read_text() == render_services(load_jobs())
    assert render_main(["--render-k8s", "--out", str(tmp_path / "module")]) == 0
    for name in ("cronjobs.yaml", "services.yaml"):
        assert (tmp_path / "cli" / name).read_text() == (tmp_path / "module" / name).read_text()


def test_hints_carry_the_lake_the_operator_gave(tmp_path, capsys):
    from pipeline.cli import with_lake

    assert with_lake("see pipeline snapshots list", "/x y") == "see pipeline snapshots list --lake '/x y'"
    assert with_lake("run `pipeline admit` then `pipeline train --batch-snapshot ID`", "s3://b/l") == \
        "run `pipeline admit --lake s3://b/l` then `pipeline train --lake s3://b/l --batch-snapshot ID`"
    assert with_lake("pipeline sql --lake a \"SELECT 1\"", "b") == "pipeline sql --lake a \"SELECT 1\""
    assert with_lake("from pipeline import lineage", "b") == "from pipeline import lineage"
    assert with_lake("pipeline snapshots list", None) == "pipeline snapshots list"
    # end to end: a read command on a lake without that snapshot points at the same lake
    lake = tmp_path / "my lake"
    lake.mkdir()
    assert main(["snapshots", "show", "a" * 64, "--lake", str(lake)]) == 2
    err = capsys.readouterr().err
    assert f"pipeline snapshots list --lake '{lake}'" in err


def test_counts_are_singular_when_one_and_local_policies_have_no_fake_version():
    from pipeline.commands.policy import policy_label
    from pipeline.commands.train import result_text

    r = {"already_published": False, "checkpoint_id": "c", "policy_version": 1, "global_step": 1, "samples_seen": 8,
         "seconds": 1.0, "resumed_from_step": None, "metrics": {}, "path": "p"}
    assert "(1 step, 8 samples" in result_text(r)
    assert "(2 steps," in result_text({**r, "global_step": 2})
    assert policy_label({"policy_version": -1}, "./dir") == "policy ./dir (a local directory, not a lake version)"
    assert policy_label({"policy_version": 3}, "latest") == "policy v3"


def test_ingest_reports_the_version_its_rows_landed_in(tmp_path, make_traj, capsys):
    import pyarrow.parquet as pq

    from pipeline.lake.delta import Lake

    lake = tmp_path / "lake"
    for i in range(2):
        f = tmp_path / f"b{i}.parquet"
        pq.write_table(make_traj(6, seed=i, id_prefix=f"v{i}-"), f)
        assert main(["ingest", str(f), "--lake", str(lake), "--json"]) == 0
        reported = json.loads(capsys.readouterr().out)["trajectories_version"]
        dt = Lake(lake).table("trajectories", reported)
        assert dt.to_pyarrow_table(columns=["trajectory_id"]).num_rows == 6 * (i + 1), \
            "the reported version holds the rows this ingest landed"
        assert reported == Lake(lake).version("trajectories")
