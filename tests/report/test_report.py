"""`pipeline report`: one self-contained HTML file of interactive plots, checked
in a real browser (headless Chromium: screenshot not blank, every plot drawn by
the inlined plotly.js, no console errors, no network), readable on lakes that
lack some tables and on lakes of many runs."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pipeline.report.build import ReportOptions, write_report

# headless Chromium: the `chromium` marker and the `chromium_bin` fixture (tests/conftest.py) skip
# these tests where it is not installed, and fail them under CI=true

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]


def chromium(binary: str, page: Path, tmp: Path, *mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary, *FLAGS, f"--user-data-dir={tmp / 'profile'}", *mode, page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=180)


def console_errors(stderr: str) -> list[str]:
    """Lines where the page itself complained (JS errors, console.error, failed loads)."""
    return [ln for ln in stderr.splitlines()
            if "Uncaught" in ln or "ERROR:CONSOLE" in ln or ("CONSOLE" in ln and "error" in ln.lower())
            or "net::ERR_" in ln]


PLOTS = 35        # plots the full synthetic lake gives (see test_report_has_every_section_and_plot)
BLANK_STD = 20.0  # grey-level std of a screenshot below which it counts as blank


def pixel_std(png: Path) -> float:
    from PIL import Image

    return float(np.asarray(Image.open(png).convert("L"), dtype=np.float64).std())


@pytest.fixture(scope="module")
def full_lake(tmp_path_factory):
    from pipeline.lake.delta import Lake
    from pipeline.testing.health_lake import HealthLakeSpec, build_health_lake

    lake = Lake(tmp_path_factory.mktemp("report") / "lake")
    build_health_lake(lake, HealthLakeSpec(trajectories_per_version=120, versions=3, event_episodes=150))
    return lake


def test_report_has_every_section_and_plot(full_lake, tmp_path):
    out = tmp_path / "report.html"
    res = write_report(full_lake, out)
    text = out.read_text()
    assert res["errors"] == []
    # quality 4, comparability 2, efficiency 5, freshness 4, lineage 1, training 12, rollout 4, evaluation 1
    assert res["plots"] == PLOTS and text.count('<div class="plot"') == PLOTS
    assert res["no_data"] == []
    for title in ("Quality", "Comparability", "Efficiency", "Freshness", "Latest receipts",
                  "Lineage of the newest checkpoint", "Training metrics", "Held-out evaluation", "Alerts",
                  "Rollout health"):
        assert f"<h2>{title}</h2>" in text
    assert text.index("<h2>Alerts</h2>") < text.index("<h2>Lake</h2>")   # alerts come first
    assert res["bucket"] == "hour"                 # chosen from the data's span (the lake spans days of hours)
    for title in ("Gradient norm", "Learning rate", "Importance ratio quantiles", "Engine/trainer mismatch",
                  "Clip high vs clip low", "Advantage distribution", "Response length", "Truncation rate",
                  "Rollout throughput", "Success by difficulty", "Eval curve"):
        assert title in text, title
    assert "ck-0003" in text                       # the newest checkpoint's lineage
    assert "stale_policy x1" in text               # receipts show reasons


def _without_library(text: str) -> str:
    """The page without its one inlined library (checked to be plotly's own, byte for byte)."""
    from pipeline.report.plots import library_js

    start = text.index('<script id="plotly-js">') + len('<script id="plotly-js">')
    end = text.index("</script>", start)
    assert text[start:end] == library_js() and text.count('<script id="plotly-js">') == 1
    return text[:start] + text[end:]


def test_report_is_self_contained(full_lake, tmp_path):
    out = tmp_path / "r.html"
    write_report(full_lake, out)
    page = _without_library(out.read_text())
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the report must not load anything"
    assert "url(" not in page and "@import" not in page and "<img" not in page and " src=" not in page


@pytest.mark.slow
@pytest.mark.chromium
def test_report_renders_in_headless_chromium(full_lake, tmp_path, chromium_bin):
    out = tmp_path / "report.html"
    write_report(full_lake, out, ReportOptions(bucket="hour"))
    shot = tmp_path / "shot.png"
    r = chromium(chromium_bin, out, tmp_path, f"--screenshot={shot}", "--window-size=1400,2400")
    assert shot.exists(), r.stderr[-2000:]
    assert console_errors(r.stderr) == []
    assert pixel_std(shot) > BLANK_STD, "the screenshot is (nearly) blank"
    # the DOM after the load event: the page's own check marked every plot as decoded
    d = chromium(chromium_bin, out, tmp_path, "--dump-dom", "--virtual-time-budget=20000")
    assert console_errors(d.stderr) == []
    assert 'data-plots-checked="yes"' in d.stdout
    rendered = re.findall(r'data-rendered="(\w+)"', d.stdout)
    assert len(rendered) == PLOTS and set(rendered) == {"yes"}
    assert d.stdout.count('class="main-svg"') >= PLOTS          # plotly drew an SVG for every figure


@pytest.mark.slow
@pytest.mark.chromium
def test_browser_checks_can_fail(tmp_path, chromium_bin):
    """The same checks catch a JS error, a figure that cannot be drawn and a blank page."""
    from pipeline.report.html import SCRIPT, Plot, Section, render

    bad = tmp_path / "bad.html"
    bad.write_text('<html><body style="background:#fff"><script>window.addEventListener("load", function () {'
                   'undefinedFunction(); });</script></body></html>')
    shot = tmp_path / "bad.png"
    r = chromium(chromium_bin, bad, tmp_path, f"--screenshot={shot}", "--window-size=400,300")
    assert console_errors(r.stderr), r.stderr[-2000:]
    assert pixel_std(shot) < BLANK_STD   # a white page counts as blank
    # the report's own check: a figure whose JSON is broken is replaced by a visible error, marked "no"
    page = render("t", [], [Section("s", "S", "", [Plot("broken", '{"data": [')])])
    assert SCRIPT in page
    (tmp_path / "broken.html").write_text(page)
    d = chromium(chromium_bin, tmp_path / "broken.html", tmp_path, "--dump-dom", "--virtual-time-budget=5000")
    assert 'data-plots-checked="yes"' in d.stdout and "plot failed to draw: broken" in d.stdout


def test_report_on_an_empty_lake_says_no_data_yet(lake, tmp_path):
    res = write_report(lake, tmp_path / "empty.html")
    text = (tmp_path / "empty.html").read_text()
    assert res["errors"] == [] and res["plots"] == 0
    assert "no data yet" in text
    assert {"trajectories: no data yet.", "receipts: no data yet.", "checkpoints: no data yet.",
            "metrics: no data yet.", "evaluations: no data yet."} <= set(res["no_data"])


def test_report_with_trajectories_only(lake, tmp_path):
    """Rollouts landed, admission and training have not run yet."""
    from pipeline.lake.ingest import stamp_derived
    from pipeline.testing.health_lake import HealthLakeSpec, make_version_batch

    spec = HealthLakeSpec()
    for v in range(2):
        lake.append("trajectories", stamp_derived(make_version_batch(spec, "run-0", v, 0, 80), f"i{v}"),
                    command="test", app_id="t", txn_version=v)
    res = write_report(lake, tmp_path / "partial.html")
    assert res["errors"] == []
    assert res["plots"] >= 8                                # quality, comparability, efficiency, queue wait
    assert "receipts: no data yet." in res["no_data"] and "checkpoints: no data yet." in res["no_data"]
    assert "events (latency): no data yet." in res["no_data"]


def test_report_cli_and_run_filter(full_lake, tmp_path, capsys):
    from pipeline.cli import main

    out = tmp_path / "cli.html"
    assert main(["report", "--lake", full_lake.uri, "--out", str(out), "--run-id", "run-0", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["out"] == str(out.resolve()) and res["plots"] == PLOTS and out.exists()
    # a mistyped --run-id is an error (not an empty report and exit 0), naming the close one
    assert main(["report", "--lake", full_lake.uri, "--out", str(tmp_path / "none.html"), "--run-id", "run-O"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run run-O has no trajectories in ") and "did you mean `run-0`" in err
    assert not (tmp_path / "none.html").exists()
    assert main(["report", "--lake", full_lake.uri, "--out", str(tmp_path / "none.html"), "--run-id", "zzz"]) == 2
    assert "the lake's runs: run-0" in capsys.readouterr().err


def test_alerts_say_in_words_what_is_wrong(tmp_path):
    """A lake with engine drift, a falling eval curve and truncated answers raises
    those alerts (and only on a lake that has them)."""
    import pyarrow as pa

    from pipeline.lake.delta import Lake
    from pipeline.report.build import build_report
    from pipeline.testing.health_lake import HealthLakeSpec, build_health_lake
    from pipeline.schema import table_spec

    lake = Lake(tmp_path / "lake")
    build_health_lake(lake, HealthLakeSpec(trajectories_per_version=40, versions=2, event_episodes=10))
    _, clean = build_report(lake)
    assert not any("mismatch_kl" in a or "Held-out success fell" in a for a in clean["alerts"])
    m = sorted(lake.read("metrics").to_pylist(), key=lambda r: (r["checkpoint_id"], r["global_step"]))[-1]
    lake.append("metrics", pa.Table.from_pylist([dict(m, global_step=99, mismatch_kl=0.05)],
                                                 schema=table_spec("metrics").arrow_schema()), command="t")
    _, one_step = build_report(lake)
    assert not any("clipped" in a for a in one_step["alerts"])     # the synthetic runs clip little
    hot = [dict(m, global_step=100 + i, clip_fraction=0.9) for i in range(16)]   # a run that keeps clipping
    lake.append("metrics", pa.Table.from_pylist(hot, schema=table_spec("metrics").arrow_schema()), command="t")
    ev = lake.read("evaluations").to_pylist()
    last = max((r for r in ev if r["samples"] == 1), key=lambda r: r["policy_version"])
    drop = dict(last, eval_id="drop", policy_version=last["policy_version"] + 1, checkpoint_id=None, success=0.0)
    schema = pa.schema([f for f in table_spec("evaluations").arrow_schema() if f.name != "row_key"])
    lake.append("evaluations", pa.Table.from_pylist([drop], schema=schema), command="t")
    _, res = build_report(lake)
    text = " ".join(res["alerts"])
    assert "mismatch_kl reached 0.05" in text and "step 99" in text
    assert "Held-out success fell" in text and f"policy version {last['policy_version'] + 1}" in text
    assert res["errors"] == []
    checks = {a["check"] for a in res["alert_checks"]}
    assert {"mismatch_kl", "eval_drop", "clip_fraction"} <= checks and len(res["alert_checks"]) == len(res["alerts"])
    assert f"on average over the steps of checkpoint {m['checkpoint_id']}" in text
    assert not {"ess_seq_frac", "behav_ratio_p99"} & checks          # the health lake's steps are near on-policy
    # a step far off-policy: low ESS against the behaviour policy, a heavy ratio tail
    lake.append("metrics", pa.Table.from_pylist([dict(m, global_step=200, ess_seq_frac=0.12, behav_ratio_p99=6.5)],
                                                 schema=table_spec("metrics").arrow_schema()), command="t")
    _, res = build_report(lake)
    text = " ".join(res["alerts"])
    assert "ESS/n of the policy against the rollout's sampling log-probs fell to 0.12 (bound 0.5)" in text
    assert "p99 of pi/mu reached 6.5 (bound 2)" in text and "step 200" in text
    assert {"ess_seq_frac", "behav_ratio_p99"} <= {a["check"] for a in res["alert_checks"]}
    # --check: the report is written and the exit code says an alert fired (for cron or CI)

    from pipeline.cli import main
    from pipeline.commands.report import EXIT_ALERT

    out = tmp_path / "checked.html"
    assert main(["report", "--lake", lake.uri, "--out", str(out), "--check", "--json"]) == EXIT_ALERT
    assert out.exists()


def test_bucket_follows_the_span_of_the_data(lake):
    from datetime import datetime, timedelta, timezone

    from pipeline.ingest import ingest_table
    from pipeline.report.build import choose_bucket
    from pipeline.testing.trajectories import make_trajectories

    assert choose_bucket(lake) == "hour"                                 # no data: the old default
    t = make_trajectories(8, seed=1)
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for col, off in (("created_at", 0), ("finished_at", 30)):            # a run of a few minutes
        times = [t0 + timedelta(seconds=40 * i + off) for i in range(t.num_rows)]
        t = t.set_column(t.schema.get_field_index(col), col, pa_array(times, t.schema.field(col).type))
    assert ingest_table(lake, t.drop_columns(["content_hash"])).landed == 8   # the hash is recomputed
    assert choose_bucket(lake) == "minute"


def test_a_short_run_is_not_drawn_in_buckets_of_a_few_trajectories(lake):
    """90 s of trajectories, one every 1.5 s: per-second buckets of one trajectory each would draw
    success rates jumping between 0 and 1; the bucket is the minute (2 points of 40), and a run
    whose seconds hold enough trajectories keeps per-second buckets."""
    from datetime import datetime, timedelta, timezone

    from pipeline.ingest import ingest_table
    from pipeline.report.build import MIN_PER_BUCKET, choose_bucket
    from pipeline.testing.trajectories import make_trajectories

    t = make_trajectories(60, seed=5).drop_columns(["content_hash"])
    t0 = datetime(2026, 1, 1, 0, 0, 15, tzinfo=timezone.utc)
    when = [t0 + timedelta(seconds=1.5 * i) for i in range(60)]
    for col in ("created_at", "finished_at"):
        t = t.set_column(t.schema.get_field_index(col), col, pa_array(when, t.schema.field(col).type))
    assert ingest_table(lake, t).landed == 60
    assert choose_bucket(lake) == "minute"
    # waves of MIN_PER_BUCKET trajectories finishing in the same second, 20 s apart: per second
    from pipeline.lake.delta import Lake

    waves = Lake(lake.uri + "-waves")
    burst = make_trajectories(3 * MIN_PER_BUCKET, seed=6).drop_columns(["content_hash"])
    when = [t0 + timedelta(seconds=20 * (i // MIN_PER_BUCKET)) for i in range(burst.num_rows)]
    for col in ("created_at", "finished_at"):
        burst = burst.set_column(burst.schema.get_field_index(col), col, pa_array(when, burst.schema.field(col).type))
    assert ingest_table(waves, burst).landed == burst.num_rows
    assert choose_bucket(waves) == "second"


def pa_array(values, typ):
    import pyarrow as pa

    return pa.array(values, typ)


def test_time_breakdown_comes_from_the_jobs_lineage_events(lake):
    from pipeline.maintain import maintain
    from pipeline.report.build import time_breakdown

    maintain(lake)
    maintain(lake)
    tb = time_breakdown(lake)
    assert tb["lake.maintain"]["runs"] == 2 and tb["lake.maintain"]["failed"] == 0
    assert tb["lake.maintain"]["seconds"] >= 0


@pytest.mark.parametrize("train_x", ["time", "samples"])
def test_training_plots_over_wall_time_or_samples(full_lake, tmp_path, train_x):
    from pipeline.report.build import build_report

    page, res = build_report(full_lake, ReportOptions(train_x=train_x))
    assert res["errors"] == [] and res["plots"] == PLOTS
    assert ("over wall time" if train_x == "time" else "over samples") in page


def test_health_lake_receipts_are_real_admission_decisions(full_lake):
    """The synthetic lake's receipts are what the real admission core decides for
    its landed rows (one run per policy version, the next version current)."""
    import dataclasses
    from datetime import timedelta

    import pyarrow.dataset as ds

    from pipeline.admission.candidates import scan
    from pipeline.admission.config import admission_config_hash
    from pipeline.admission.engine_duckdb import decide_candidates
    from pipeline.testing.health_lake import ADMISSION, START

    lake = full_lake
    written = {r["group_id"]: r for r in lake.read("receipts").to_pylist()}
    dataset = lake.arrow_dataset("trajectories", lake.table("trajectories"))
    reasons = set()
    for v in range(3):
        cfg = dataclasses.replace(ADMISSION, current_policy_version=v + 1)
        cands = scan(dataset, cfg, filter=ds.field("policy_version") == v)
        dec = decide_candidates(cands, cfg, current_policy_version=v + 1, now=START + timedelta(days=30, hours=v),
                                config_hash=admission_config_hash(cfg))
        assert dec.receipts.num_rows > 0
        for r in dec.receipts.to_pylist():
            w = written[r["group_id"]]
            assert (w["decision"], dict(w["excluded_members"]), w["valid_members"], w["checks"]) == \
                (r["decision"], dict(r["excluded_members"]), r["valid_members"], r["checks"])
            reasons |= set(dict(r["excluded_members"]).values())
    assert {"stale_policy", "infra_failed", "expired"} <= reasons
    assert any(x.endswith("_mismatch") for x in reasons)


@pytest.fixture(scope="module")
def many_runs_lake(tmp_path_factory):
    from pipeline.lake.delta import Lake
    from pipeline.testing.health_lake import HealthLakeSpec, build_health_lake

    lake = Lake(tmp_path_factory.mktemp("runs") / "lake")
    build_health_lake(lake, HealthLakeSpec(trajectories_per_version=40, versions=2, event_episodes=40,
                                           runs=tuple(f"run-{i}" for i in range(9))))
    return lake


def _figures(page: str) -> dict[str, dict]:
    """title -> the plotly figure of every plot of a page."""
    found = re.findall(r'<div class="plot" data-title="([^"]+)"></div><script type="application/json">(.*?)</script>',
                       page, re.S)
    return {title: json.loads(spec.replace("<\\/", "</")) for title, spec in found}


def test_many_runs_the_legend_is_the_run_selector(many_runs_lake):
    from pipeline.report.build import build_report
    from pipeline.report.plots import VISIBLE_RUNS

    page, res = build_report(many_runs_lake)
    assert res["errors"] == []
    fig = _figures(page)["Success over policy versions"]
    traces = fig["data"]
    runs = sorted({t["legendgroup"] for t in traces})
    assert runs == [f"run-{i}" for i in range(9)]
    # one colour per run, shared by its series; metrics told apart by line style
    colour = {}
    for t in traces:
        colour.setdefault(t["legendgroup"], set()).add(t["line"]["color"])
    assert all(len(c) == 1 for c in colour.values()) and len({next(iter(c)) for c in colour.values()}) == 9
    # the newest runs are drawn, the others one legend click away; clicking a run toggles all its series
    drawn = {t["legendgroup"] for t in traces if t.get("visible", True) is True}
    assert drawn == set(runs[-VISIBLE_RUNS:])
    assert {t["legendgroup"] for t in traces if t.get("visible") == "legendonly"} == set(runs[:-VISIBLE_RUNS])
    assert fig["layout"]["legend"]["groupclick"] == "togglegroup"


def test_training_plots_mark_where_each_checkpoint_begins(full_lake):
    from pipeline.report.build import build_report

    page, _ = build_report(full_lake)
    fig = _figures(page)["Loss"]
    marks = [a["text"] for a in fig["layout"]["annotations"]]
    assert marks == ["v1", "v2", "v3"] and len(fig["layout"]["shapes"]) == 3


def test_a_nearly_empty_time_bucket_is_not_drawn_as_a_collapse(lake):
    """One hour of 40 good trajectories and, the next hour, 3 fast failures: the second hour's
    success rate (0.0 from three rows) is not drawn, and the plot says why."""
    from datetime import datetime, timedelta, timezone

    from pipeline.ingest import ingest_table
    from pipeline.report.build import build_report
    from pipeline.testing.trajectories import make_trajectories

    t = make_trajectories(43, seed=3, group_size=1).drop_columns(["content_hash"])
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    when = [t0 + timedelta(minutes=i) for i in range(40)] + [t0 + timedelta(hours=1, minutes=i) for i in range(3)]
    for col in ("created_at", "finished_at"):
        t = t.set_column(t.schema.get_field_index(col), col, pa_array(when, t.schema.field(col).type))
    verdict = t.column("verdict").to_pylist()[:40] + ["FAIL"] * 3
    reward = t.column("reward").to_pylist()[:40] + [0.0] * 3
    t = t.set_column(t.schema.get_field_index("verdict"), "verdict", pa_array(verdict, t.schema.field("verdict").type))
    t = t.set_column(t.schema.get_field_index("reward"), "reward", pa_array(reward, t.schema.field("reward").type))
    assert ingest_table(lake, t).landed == 43
    page, _ = build_report(lake, ReportOptions(bucket="hour"))
    fig = _figures(page)["Success and reward over time"]
    success = next(tr for tr in fig["data"] if tr["name"] == "success rate")
    assert len(success["y"]) == 2 and success["y"][0] is not None and success["y"][1] is None
    assert "(1 sparse bucket not drawn)" in fig["layout"]["title"]["text"]


@pytest.mark.slow
@pytest.mark.chromium
def test_many_runs_report_renders_in_headless_chromium(many_runs_lake, tmp_path, chromium_bin):
    out = tmp_path / "runs.html"
    res = write_report(many_runs_lake, out)
    shot = tmp_path / "runs.png"
    r = chromium(chromium_bin, out, tmp_path, f"--screenshot={shot}", "--window-size=1400,2400",
                 "--virtual-time-budget=20000")
    assert shot.exists(), r.stderr[-2000:]
    assert console_errors(r.stderr) == []
    assert pixel_std(shot) > BLANK_STD, "the screenshot is (nearly) blank"
    d = chromium(chromium_bin, out, tmp_path, "--dump-dom", "--virtual-time-budget=20000")
    assert console_errors(d.stderr) == [] and 'data-plots-checked="yes"' in d.stdout
    rendered = re.findall(r'data-rendered="(\w+)"', d.stdout)
    assert len(rendered) == res["plots"] and set(rendered) == {"yes"}
    # the legend lists every run (the run selector), drawn by plotly in the page
    for i in range(9):
        assert f">run-{i}<" in d.stdout, f"run-{i} is missing from the rendered legends"
