"""The benchmark runner: one command, a table of ratios.

    .venv/bin/python benchmarks/run.py                 # every benchmark, full size
    .venv/bin/python benchmarks/run.py --quick         # small sizes (smoke)
    .venv/bin/python benchmarks/run.py --only ingest   # by name prefix

Every figure is a ratio against a baseline measured in the same run (these
machines are shared and noisy; absolute times are printed for context only).
Each ``benchmarks/bench_*.py`` defines ``run(quick: bool) -> list[Result]``.
Results are also written to benchmarks/results/<timestamp>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


@dataclass
class Result:
    name: str                 # e.g. "ingest 100k: pipeline ingest / pq.write_table"
    ratio: float              # measured / baseline (lower is better unless higher_is_better)
    target: float | None      # e.g. 1.5 (ratio must be <= target)
    measured: str             # human text, e.g. "41.2 s (2,427 traj/s)"
    baseline: str             # human text
    higher_is_better: bool = False
    note: str = ""

    @property
    def ok(self) -> bool | None:
        if self.target is None:
            return None
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target


def best_of(fn, repeat: int = 3) -> float:
    """Minimum wall time of ``repeat`` calls (the least-disturbed run)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not the reported figures")
    ap.add_argument("--only", action="append", default=[], help="run benchmarks whose file name contains this")
    args = ap.parse_args(argv)
    results: list[Result] = []
    for path in sorted(HERE.glob("bench_*.py")):
        if args.only and not any(o in path.stem for o in args.only):
            continue
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        print(f"== {path.stem} ...", flush=True)
        t0 = time.perf_counter()
        got = mod.run(quick=args.quick)
        print(f"   done in {time.perf_counter() - t0:.1f}s", flush=True)
        results.extend(got)
    print()
    w = max([len(r.name) for r in results] + [9])
    print(f"{'benchmark'.ljust(w)}  {'ratio':>7}  {'target':>8}  ok    measured | baseline")
    for r in results:
        tgt = "" if r.target is None else (">= " if r.higher_is_better else "<= ") + f"{r.target:g}"
        ok = {None: "-", True: "yes", False: "NO"}[r.ok]
        print(f"{r.name.ljust(w)}  {r.ratio:7.2f}  {tgt:>8}  {ok:4}  {r.measured} | {r.baseline}"
              + (f"  ({r.note})" if r.note else ""))
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (out / f"{stamp}.json").write_text(json.dumps([asdict(r) | {"ok": r.ok} for r in results], indent=1))
    missed = [r.name for r in results if r.ok is False]
    if missed:
        print(f"\n{len(missed)} target(s) missed: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
