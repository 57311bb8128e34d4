"""`pipeline simulate` end to end (pure mode): one run, sweeps, files, JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline.cli import main


def test_single_run_prints_summary_and_writes_json(tmp_path, capsys):
    rc = main(["simulate", "--config", "slow_tasks", "--set", "duration_h=1", "--seed", "7", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "rejection rate: slow" in text and "trainer idle" in text
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["config"]["seed"] == 7 and s["sim_hours"] == 1


def test_sweep_writes_table_and_plot(tmp_path, capsys):
    rc = main(["simulate", "--config", "slow_tasks", "--set", "duration_h=2", "--set", "workers=64",
               "--set", "batch_groups=8", "--sweep", "mode=sync,async", "--sweep", "max_policy_lag=0,2,8",
               "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["mode", "max_policy_lag"]
    assert len([ln for ln in out if ln.strip().startswith(("sync", "async"))]) == 6
    png = (tmp_path / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = (tmp_path / "sweep.md").read_text().splitlines()
    assert len(md) == 2 + 6
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    async_rows = [r for r in rows if r["point"]["mode"] == "async"]
    # the slow class's rejection rate falls as the gate loosens
    rates = [r["rejection_rate_slow"] for r in async_rows]
    assert rates[0] > rates[-1]


def test_sweep_json_and_bad_key(tmp_path, capsys):
    rc = main(["simulate", "--set", "duration_h=0.5", "--sweep", "workers=16,32", "--out", str(tmp_path), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["workers"] for r in res["rows"]] == [16, 32]
    rc = main(["simulate", "--sweep", "max_lag=1,2", "--out", str(tmp_path), "--json"])
    assert rc == 2
    err = json.loads(capsys.readouterr().out)
    assert "max_lag" in err["error"] and "max_policy_lag" in err["hint"]


def test_cli_import_stays_light():
    code = ("import sys, pipeline.cli as c; c.build_parser(); "
            "bad = [m for m in ('matplotlib', 'numpy', 'deltalake', 'duckdb', 'torch') if m in sys.modules]; "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "matplotlib" not in out
