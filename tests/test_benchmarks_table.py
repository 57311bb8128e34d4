"""The README's benchmark table is generated from the committed results files
(benchmarks/readme_table.py), and the generator shows what it is given: a
missed target as missed, a benchmark without results as not run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _table():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "benchmarks" / "readme_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_benchmark_section_is_generated_from_committed_results(tmp_path):
    copy = tmp_path / "README.md"
    copy.write_text((ROOT / "README.md").read_text())
    assert not _table().update_readme(copy), \
        "README.md benchmark table is stale: run python benchmarks/run.py --readme"


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
    assert "| a: x / y | 2 s | 1 s | 2 | ≤ 1.5 | **MISSED** | `a` |" in md
    assert "| `bench_b.py` | not run here |" in md  # a smoke run is not a result
    assert "CPU X, 2 cores, 4 GiB | 1.5 / 1 / 1 | `BENCH_A_N=10`" in md
