"""The docs site's benchmark tables (docs/benchmarks.md) and the README's headline figures are generated
from the committed results files (benchmarks/readme_table.py), and the generator shows what it is given: a
missed target as missed, a benchmark without results as not run. Every
committed results file is either verified (benchmarks/provenance.py: its
sources at its commit, its digest, every figure recomputed from its raw
measurements by the benchmark's own derive) or a pinned, listed legacy file the
table marks unverified; a hand-edited file is refused."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _table():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_page_and_readme_headlines_are_generated_from_committed_results(tmp_path):
    page, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    page.write_text((ROOT / "docs" / "benchmarks.md").read_text())
    readme.write_text((ROOT / "README.md").read_text())
    assert not _table().update_page(page), "docs/benchmarks.md is stale: run python benchmarks/run.py --readme"
    assert not _table().update_readme(readme), "README.md's headlines are stale: run python benchmarks/run.py --readme"


def test_readme_headlines_are_rows_of_the_full_table():
    """Each headline shows its full-table row's measured figure, baseline, ratio and mark (met, MISSED,
    unverified) and nothing else."""
    t = _table()
    lines = t.headlines().splitlines()
    assert len(lines) == len(t.HEADLINES)
    rows = t.markdown().splitlines()
    for line, (bench, start) in zip(lines, t.HEADLINES):
        row = next(r for r in rows if r.startswith(f"| {start}") and r.endswith(f"| `{bench}` |"))
        _, measured, baseline, ratio, target, met, _ = (c.strip() for c in row.strip("|").split(" | "))
        for cell in (measured, baseline, f"ratio {ratio}", target, met):
            assert cell in line, (cell, line)


def test_every_benchmark_has_a_row_and_every_committed_file_is_complete():
    t = _table()
    section = t.markdown()
    docs = t.load(ROOT / "benchmarks" / "results")
    for p in (ROOT / "benchmarks").glob("bench_*.py"):
        name = p.stem.removeprefix("bench_")
        assert (f"`{name}` |" in section) or (f"`bench_{name}.py` | not run here" in section), name
    for name, doc in docs.items():
        assert doc["machine"]["cpu_model"] and doc["machine"]["loadavg_at_start"], name
        assert doc["machine"]["git_commit"] and doc["started_utc"], name
        assert not doc["quick"], f"{name}.json holds a --quick smoke run"
        for r in doc["results"]:
            assert r["measured"] and r["baseline"] and isinstance(r["ratio"], (int, float)), (name, r["name"])


def test_generator_marks_missed_targets_and_benchmarks_without_results(tmp_path):
    t = _table()
    (tmp_path / "bench_a.py").write_text("")
    (tmp_path / "bench_b.py").write_text("")
    res = tmp_path / "results"
    res.mkdir()
    doc = {"benchmark": "a", "quick": False, "scale": {"BENCH_A_N": "10"}, "started_utc": "2026-01-01T00:00:00Z",
           "wall_s": 3.0, "machine": {"cpu_model": "CPU X", "cores_usable": 2, "memory_gib": 4,
                                      "loadavg_at_start": [1.5, 1, 1], "git_commit": "abc"},
           "results": [{"name": "a: x / y", "ratio": 2.0, "target": 1.5, "higher_is_better": False, "ok": False,
                        "measured": "2 s", "baseline": "1 s", "note": ""}]}
    (res / "a.json").write_text(json.dumps(doc))
    (res / "b.quick.json").write_text(json.dumps(doc | {"benchmark": "b", "quick": True}))
    md = t.markdown(res, tmp_path)
    assert "| a: x / y | 2 s | 1 s | 2 | ≤ 1.5 | **MISSED**, unverified (no provenance) | `a` |" in md
    assert "| `bench_b.py` | not run here |" in md  # a smoke run is not a result
    assert "CPU X, 2 cores, 4 GiB | 1.5 / 1 / 1 | `BENCH_A_N=10`" in md


def _provenance():
    spec = importlib.util.spec_from_file_location("provenance", ROOT / "benchmarks" / "provenance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_committed_results_file_is_verified_or_a_pinned_legacy_file():
    """Format-2 files: sources at their commit, digest, figures re-derived from the raw measurements.
    Older files: only the ones listed in provenance.LEGACY, byte for byte, and the table says unverified."""
    prov = _provenance()
    section = _table().markdown()
    files = sorted(p for p in (ROOT / "benchmarks" / "results").glob("*.json") if not p.name.endswith(".quick.json"))
    assert set(prov.LEGACY) <= {p.name for p in files}, "LEGACY lists a file that is gone: remove it from the list"
    for p in files:
        if p.name in prov.LEGACY:
            why = prov.check_legacy(p)
            assert json.loads(p.read_text()).get("format") != prov.FORMAT, f"{p.name} was re-run: unlist it"
            if p.name.startswith("gates-"):
                continue   # bench_gates's own raw runs: the table lists them as not run here
            assert why in section and f"| `benchmarks/results/{p.name}` |" in section, p.name
        else:
            try:
                prov.verify(p, ROOT)
            except prov.Refused as exc:
                pytest.fail(str(exc), pytrace=False)
    for hand in ("real_model.json", "loop.json"):   # issue 39: assembled or rewritten by hand after their runs
        if hand in prov.LEGACY:                       # until its re-run through run.py lands (then verified above)
            assert "by hand" in prov.LEGACY[hand][1]


# -- a real run.py run in a scratch repository, then hand edits ----------------------------------------------

TINY = """
import time

from run import Result


def run(quick):
    time.sleep(0.3)
    return {"fast_s": 0.5, "slow_s": 2.0, "latency_s": float(__import__("os").environ.get("TINY_LATENCY_S", "3.0"))}


def derive(raw):
    return [Result(name="tiny: slow / fast", ratio=raw["slow_s"] / raw["fast_s"], target=5.0,
                   measured=f"{raw['slow_s']:.2f} s", baseline=f"{raw['fast_s']:.2f} s"),
            Result(name="tiny: with latency / without, runs/s", ratio=(1 / raw["latency_s"]) / (1 / raw["slow_s"]),
                   target=0.5, higher_is_better=True, measured="x", baseline="y", possible=(0.0, 1.0))]
"""


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory):
    """A git repository holding run.py, provenance.py and a tiny benchmark, committed, and one
    results file that run.py wrote from the clean tree."""
    repo = tmp_path_factory.mktemp("benchrepo")
    (repo / "benchmarks" / "results").mkdir(parents=True)
    for f in ("run.py", "provenance.py"):
        shutil.copy(ROOT / "benchmarks" / f, repo / "benchmarks" / f)
    (repo / "benchmarks" / "bench_tiny.py").write_text(TINY)
    _git(repo, "init", "-q")
    _git(repo, "add", "benchmarks")
    _git(repo, "commit", "-q", "-m", "tiny benchmark")
    p = _run_tiny(repo)
    assert p.returncode == 0, p.stderr
    return repo


def _run_tiny(repo, **env):
    return subprocess.run([sys.executable, "benchmarks/run.py", "--only", "tiny"], cwd=repo, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, BENCH_LOAD_INTERVAL_S="0.1", **env))


def _edited(repo, tmp_path, edit, *, rehash=True):
    prov = _provenance()
    doc = json.loads((repo / "benchmarks" / "results" / "tiny.json").read_text())
    edit(doc)
    if rehash:   # the forger re-hashes: the figures must still follow from the raw measurements
        doc["digest"] = prov.digest(doc)
    out = tmp_path / "tiny.json"
    out.write_text(json.dumps(doc, indent=1))
    with pytest.raises(prov.Refused) as exc:
        prov.verify(out, repo)
    return str(exc.value)


def test_run_py_writes_a_file_that_verifies_with_its_provenance(tiny_repo):
    prov = _provenance()
    path = tiny_repo / "benchmarks" / "results" / "tiny.json"
    doc = prov.verify(path, tiny_repo)
    assert doc["command"].endswith("benchmarks/run.py --only tiny") and doc["machine"]["git_dirty"] is False
    assert set(doc["sources"]) == {"benchmarks/bench_tiny.py", "benchmarks/run.py", "benchmarks/provenance.py"}
    assert doc["sources"]["benchmarks/bench_tiny.py"] == hashlib.sha256(TINY.encode()).hexdigest()
    assert len(doc["load"]["samples"]) >= 2 and doc["started_utc"] <= doc["ended_utc"]
    assert doc["raw"] == {"fast_s": 0.5, "slow_s": 2.0, "latency_s": 3.0}
    assert [(r["ratio"], r["ok"]) for r in doc["results"]] == [(4.0, True), (2.0 / 3.0, True)]


def test_a_hand_edited_results_file_is_refused(tiny_repo, tmp_path):
    def ratio(d):
        d["results"][0]["ratio"] = 2.5

    def raw_number(d):
        d["raw"]["slow_s"] = 1.0

    assert "digest mismatch" in _edited(tiny_repo, tmp_path, ratio, rehash=False)
    assert "digest mismatch" in _edited(tiny_repo, tmp_path, raw_number, rehash=False)
    assert "derive makes" in _edited(tiny_repo, tmp_path, ratio)             # re-hashed: the ratio is recomputed
    assert "derive makes" in _edited(tiny_repo, tmp_path, raw_number)        # raw changed, figures not
    assert "says ok=False" in _edited(tiny_repo, tmp_path, lambda d: d["results"][0].update(ok=False))
    assert "fields added ['note']" in _edited(tiny_repo, tmp_path, lambda d: d.update(note="load ~25"))
    assert "has fields" in _edited(tiny_repo, tmp_path, lambda d: d["results"][0].update(statuses={}))
    assert "uncommitted changes" in _edited(tiny_repo, tmp_path, lambda d: d["machine"].update(git_dirty=True))
    assert "newer than the run's start" in _edited(tiny_repo, tmp_path, lambda d: d.update(
        started_utc="2000-01-01T00:00:00Z"))
    # a source hash that is not the file at the recorded commit; a commit this clone does not have
    assert "do not come from" in _edited(tiny_repo, tmp_path, lambda d: d["sources"].update(
        {"benchmarks/bench_tiny.py": "0" * 64}))
    assert "is not in this clone" in _edited(tiny_repo, tmp_path, lambda d: d["machine"].update(
        git_commit="1" * 40))


def test_a_legacy_file_edited_by_hand_is_refused(tmp_path):
    prov = _provenance()
    name = sorted(prov.LEGACY)[0]
    src = ROOT / "benchmarks" / "results" / name
    copy = tmp_path / name
    copy.write_bytes(src.read_bytes())
    assert prov.check_legacy(copy)
    copy.write_text(src.read_text().replace('"', '"', 1) + " ")
    with pytest.raises(prov.Refused, match="legacy files are never edited"):
        prov.check_legacy(copy)


def test_a_physically_impossible_ratio_fails_the_run_and_writes_nothing(tiny_repo):
    """With latency 1.0 s the slower arm would be 2x faster than without: run.py exits 3, nothing written."""
    before = (tiny_repo / "benchmarks" / "results" / "tiny.json").read_bytes()
    p = _run_tiny(tiny_repo, TINY_LATENCY_S="1.0")
    assert p.returncode == 3 and "outside the range a real measurement can fall in" in p.stderr
    assert (tiny_repo / "benchmarks" / "results" / "tiny.json").read_bytes() == before


def test_a_benchmark_without_derive_makes_no_full_size_results_file(tiny_repo):
    (tiny_repo / "benchmarks" / "bench_noderive.py").write_text(
        "from run import Result\n\n\ndef run(quick):\n    return [Result('n: a / b', 1.0, None, 'a', 'b')]\n")
    p = subprocess.run([sys.executable, "benchmarks/run.py", "--only", "noderive"], cwd=tiny_repo,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "has no derive(raw)" in p.stderr, p.stderr
    assert not (tiny_repo / "benchmarks" / "results" / "noderive.json").exists()


def _bench(name):
    """benchmarks/bench_NAME.py as a module (benchmarks/run.py on the path only while it loads)."""
    had = set(sys.modules)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}_t", ROOT / "benchmarks" / f"bench_{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        for n in {"run", "provenance"} - had:   # benchmarks/run.py is no module of the project
            sys.modules.pop(n, None)
    return mod


def test_loop_figures_count_every_version_and_show_the_prepass_apart():
    """bench_loop.derive on hand-made raw measurements: version 1 (with the trainer's start-up in its
    train wait) counts, the steady state is beside it, the pre-pass is neither useful nor overhead."""
    loop = _bench("loop")

    def version(rollout, admit, train, full=False):   # (wall, useful) pairs; train: (wall, steps, prepass)
        return {"load_1m": 2.0, "rollout": {"wall": rollout[0], "useful": rollout[1]},
                "admit": {"wall": admit[0], "useful": admit[1]},
                "train": {"wall": train[0], "steps_s": train[1], "prepass_s": train[2], "bytes": 300 if full else 110,
                          "full_state": full}}

    # resident v1: wall 10+4+20 = 34, useful 6+1+5 = 12, pre-pass 2, overhead 4+3+13 = 20
    # resident v2: wall 8+2+10 = 20,  useful 12, pre-pass 2, overhead 2+1+3 = 6
    resident = [version((10, 6), (4, 1), (20, 5, 2)), version((8, 6), (2, 1), (10, 5, 2), full=True)]
    old = [version((20, 6), (10, 1), (24, 5, 2), full=True)] * 2                     # 54 s each
    raw = {"models": {"smollm2": {"spec": {"kind": "smollm2", "weights_bytes": 100}, "k": 2,
                                  "order": ["resident-v1", "old-v1", "old-v2", "resident-v2"], "old": old,
                                  "resident": resident, "resident_info": {"startup_s": 9.0},
                                  "full_checkpoint_every": 2}}}
    wall, overhead, prepass, bytes_ = loop.derive(raw)
    assert wall.ratio == pytest.approx(27 / 54)
    assert overhead.ratio == pytest.approx(13 / 27) and overhead.target == 0.15 and overhead.ok is False
    assert "steady state (versions 2..2): 30%" in overhead.measured          # 6 / 20
    assert "pre-pass counted as overhead: 56%" in overhead.measured          # (13 + 2) / 27
    assert prepass.ratio == pytest.approx(2 / 27)
    assert bytes_.ratio == pytest.approx((110 + 300) / 2 / 100)             # one weights-only, one full, every 2


def test_loop_delta_figures_follow_from_each_versions_bytes_changes_and_switches():
    """The weight-delta figures (issue 42): bytes over versions 2..K (every byte but the full state), the
    same amortized with one anchor every anchor_every, the changed share, switch by delta / full load;
    a changed share above 1 is no measurement."""
    loop = _bench("loop")
    prov = _provenance()

    def version(k, kind, written, changed=None, state=0):
        return {"version": k, "kind": kind, "why": None, "chain": k - 1, "delta_file_bytes": written - 10 if
                kind == "delta" else None, "full_bytes": 1000, "dtype": "torch.bfloat16", "changed": changed,
                "elements": 500 if changed is not None else None, "bytes": written, "state_bytes": state,
                "files": 3}

    versions = [version(1, "anchor", 1100), version(2, "delta", 50, 10), version(3, "delta", 70, 20),
                version(4, "anchor", 1020, 400, state=6_000_000)]
    switches = [{"version": 2, "delta_s": 0.1, "read_s": 0.02, "full_s": 0.5, "first": "delta"},
                {"version": 3, "delta_s": 0.3, "read_s": 0.02, "full_s": 0.3, "first": "full"}]
    publish = {"versions": versions, "switches": switches, "anchor_every": 4, "lr": 3e-4, "dtype": "bfloat16"}
    per, amortized, share, switch = loop._publish_results("demo policy", "the resident loop's versions", publish)
    assert per.ratio == pytest.approx((50 + 70 + 1020) / 3 / 1000) and per.target == 0.10 and per.ok is False
    assert "2 deltas, 1 anchors" in per.measured and "full state apart: v4 6.0 MB" in per.measured
    assert amortized.ratio == pytest.approx(((1100 + 1020) / 2 + 3 * 60) / 4 / 1000) and amortized.target is None
    assert share.ratio == pytest.approx((10 / 500 + 20 / 500 + 400 / 500) / 3)
    assert switch.ratio == pytest.approx(0.2 / 0.4) and switch.ok is True
    fp32 = loop._publish_results("demo policy", "publish-only", publish | {"dtype": "float32", "switches": []})
    assert len(fp32) == 3 and all(r.target is None for r in fp32)
    versions[2]["changed"] = 2000                                       # 4x the elements: an artifact
    _, _, bad, _ = loop._publish_results("demo policy", "x", publish)
    assert prov.outside_possible(bad.name, bad.ratio, bad.possible)


def _rollout_raw(lat_s=12.0):
    """Hand-made raw measurements of bench_rollout: every arm 10 s at zero latency (engine busy 9.5 s),
    ``lat_s`` with latency (busy 9.9 s); demo 1 s at zero latency, 20 episodes with 1..20 s of tools."""
    def runs(zero, lat, busy_zero, busy_lat, tools):
        return [{"arm": a, "latency": lat_, "rep": 0, "rollout_s": t, "engine_busy_s": b, "engine_steps": 8,
                 "trajectories": 48,
                 "cancelled": 0, "min_tool_calls": 3, "episode_tool_s": tools if lat_ else [0.0] * 20,
                 "load_1m_at_start": 3.0}
                for a in ("waves", "streaming", "spare", "continuous")
                for lat_, t, b in ((False, zero, busy_zero), (True, lat, busy_lat))]

    def policy(rs):
        return {"groups": 6, "inflight_groups": 3, "runs": rs,
                "trajectory_checks": [{"run": f"{r['arm']}-{r['latency']}", "compared": 48, "mismatched": 0}
                                      for r in rs]}

    tools = [float(k) for k in range(1, 21)]      # p95 of 20 values: the 19th, 19 s
    return {"sizes": {"group_size": 8, "tool_turns": 3, "repeats": 1}, "engine_bound_params": 113e6,
            "load_1m_per_run": [3.0, 4.0],
            "policies": {"engine_bound": policy(runs(10.0, lat_s, 9.5, 9.9, tools)),
                         "demo": policy(runs(1.0, 22.0, 0.5, 0.6, tools))},
            "weight_switch": [{"engine": "hf", "label": "x", "in_place_s": [0.02, 0.01], "new_engine_s": [0.5]}]}


def test_rollout_figures_are_recomputed_from_the_runs_and_a_mismatch_or_an_impossible_ratio_fails():
    roll = _bench("rollout")
    prov = _provenance()
    figs = {f.name: f for f in roll.derive(_rollout_raw())}
    by = lambda part: next(f for n, f in figs.items() if part in n)   # noqa: E731
    share = by("streaming, zero tool latency: engine busy share")
    assert share.ratio == pytest.approx(0.95) and share.target is None
    tps = by("engine-bound 6x8 streaming: trajectories/s with tool latency / zero latency")
    assert tps.ratio == pytest.approx((48 / 12) / (48 / 10)) and tps.target == 0.8 and tps.ok is True
    assert "identical batches (waves) with / without latency: 1.04" in tps.note         # 9.9 / 9.5
    busy = by("engine-bound 6x8 continuous with tool latency: engine busy share")
    assert busy.ratio == pytest.approx(9.9 / 12) and busy.target == 0.9 and busy.ok is False
    assert by("engine-bound 6x8 waves: trajectories/s").target is None        # the baseline
    demo = by("demo policy 6x8 spare")
    assert demo.ratio == pytest.approx(22 / (1 + 19)) and demo.target == 1.0 and demo.ok is False
    assert by("weight switch hf").ratio == pytest.approx(0.01 / 0.5)
    assert all(prov.outside_possible(f.name, f.ratio, f.possible) is None for f in figs.values())
    # with latency 20% faster than without: beyond the stated noise, the figure is impossible
    fast = next(f for f in roll.derive(_rollout_raw(lat_s=8.0)) if "streaming: trajectories/s" in f.name)
    assert "outside the range a real measurement can fall in" in prov.outside_possible(fast.name, fast.ratio,
                                                                                       fast.possible)
    raw = _rollout_raw()
    raw["policies"]["engine_bound"]["trajectory_checks"][3]["mismatched"] = 1
    with pytest.raises(RuntimeError, match="trajectories differ"):
        roll.derive(raw)
    raw = _rollout_raw()
    raw["policies"]["demo"]["runs"][0]["min_tool_calls"] = 2
    with pytest.raises(RuntimeError, match="fewer than 3 tool calls"):
        roll.derive(raw)


def test_real_model_figures_count_correctness_apart_from_format():
    """bench_real_model.derive on hand-made per-task outcomes: the gain is correctness from version 0
    to each seed's last version, its interval a bootstrap over tasks (a big mean gain from two tasks
    is not an interval above 0), the base format rate is checked against the 0.9 precondition, and the
    learning curve names every version of every seed."""
    real = _bench("real_model")

    def ev(seed, version, passes, formats=None):
        formats = formats or [True] * len(passes)
        return {"seed": seed, "policy_version": version, "seconds": 1.0,
                "episodes": [{"task_id": f"t{i}", "pass": bool(p), "format": f} for i, (p, f) in
                             enumerate(zip(passes, formats))]}

    raw = {"scale": {"seeds": 2, "groups": 4, "group_size": 4, "temperature": 0.7, "lr": 3e-5, "eval_n": 4,
                     "env": "arithmetic-words"},
           "model": {"gguf": "m.gguf", "file_type": "MOSTLY_Q4_1", "tensor_types": {"Q4_1": 2},
                     "dequantized_to": "float32"},
           "evals": [ev(None, 0, [1, 0, 0, 0], [True, True, True, False]),
                     ev(0, 1, [1, 1, 0, 0]), ev(1, 1, [1, 0, 0, 0]), ev(0, 2, [1, 1, 1, 0]), ev(1, 2, [1, 1, 0, 0])],
           "rounds": [{"seed": s, "iteration": k, "train": {"seconds": 10.0 * (k + 1)}} for k in (0, 1) for s in (0, 1)]}
    gain, lower, fmt, step = real.derive(raw)
    assert gain.ratio == pytest.approx(37.5 / 10) and gain.ok                     # seeds +50 and +25 points
    assert "0.250 -> 0.625" in gain.measured and "+50.0, +25.0" in gain.measured and "format 0.75 -> 1.00" in gain.note
    assert lower.ratio == 0.0 and lower.ok is False            # 1 resample in 16 draws only the two zero-gain tasks
    assert fmt.ratio == 0.75 and fmt.ok is False
    assert "seed 0: v0 0.25/0.75 v1 0.50/1.00 v2 0.75/1.00; seed 1: v0 0.25/0.75 v1 0.25/1.00 v2 0.50/1.00" in fmt.note
    assert step.ratio == 15.0
    # every task gains on every seed: the interval is the gain itself
    raw["evals"] = [ev(None, 0, [0] * 20), ev(0, 1, [1] * 20), ev(1, 1, [1] * 20)]
    gain, lower, fmt, _ = real.derive(raw)
    assert gain.ratio == 10.0 and lower.ratio == 100.0 and lower.ok and fmt.ok
