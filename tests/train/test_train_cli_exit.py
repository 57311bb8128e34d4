"""`pipeline train` as an operator meets it (issue 15): with --json, stdout is
exactly one JSON document (DeepSpeed's accelerator warning and other library
output never reach it), and a multi-process run whose processes die after the
checkpoint was published does not exit 0 silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_train_json_stdout_is_one_json_document(tlake):
    lake, sid = tlake
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--lake", lake.uri, "--batch-snapshot", sid,
                           "--set", "max_steps=1", "--set", "micro_batch_tokens=256", "--json"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)            # the whole of stdout, not its last line
    assert doc["policy_version"] == 1 and doc["worker_exit_codes"] is None
    assert "Setting accelerator" not in proc.stdout + proc.stderr, "DeepSpeed noise without --verbose"


@pytest.mark.slow
def test_nproc_teardown_abort_is_reported_not_silent(tlake, capsys, monkeypatch):
    from pipeline.cli import main

    lake, sid = tlake
    # failure drill: rank 0 aborts (SIGABRT) after writing its result, as seen at interpreter teardown
    monkeypatch.setenv("PIPELINE_DRILL_ABORT_AT_EXIT", "1")
    code = main(["train", "--lake", lake.uri, "--batch-snapshot", sid, "--nproc", "2", "--set", "max_steps=1",
                 "--set", "micro_batch_tokens=256", "--no-progress", "--json"])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["policy_version"] == 1 and doc["worker_exit_codes"] and doc["worker_exit_codes"][0] != 0
    assert code == 3, captured.err[-2000:]
    assert "was published, but the training processes exited with" in captured.err
    monkeypatch.delenv("PIPELINE_DRILL_ABORT_AT_EXIT")
    # rerunning is a no-op that exits 0
    assert main(["train", "--lake", lake.uri, "--batch-snapshot", sid, "--nproc", "2", "--set", "max_steps=1",
                 "--set", "micro_batch_tokens=256", "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["already_published"]
