"""The README's benchmark table, generated from the committed results.

    python benchmarks/run.py --readme          # or: python benchmarks/readme_table.py

Reads ``benchmarks/results/NAME.json`` (written by a full-size
``benchmarks/run.py`` run of ``bench_NAME.py``; smoke runs' ``NAME.quick.json``
are never read) and rewrites the section of README.md between the
``<!-- bench:begin -->`` and ``<!-- bench:end -->`` markers: one row per
figure (what was measured, the baseline, the ratio, the target and whether it
was met), then one row per results file (when, on what machine, at what load
and scale). A benchmark without a results file gets a "not run here" row, so
the table never hides one. A file without run.py's provenance (format 2,
benchmarks/provenance.py) is marked unverified on every row it gives, with the
reason ``provenance.LEGACY`` lists for it. Nothing here imports the project or
a heavy library: tests/test_benchmarks_table.py checks that the README section
is what this script makes of the committed files, and that every file is
verified (provenance.verify) or a pinned legacy file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import provenance  # noqa: E402
BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def load(results_dir: Path) -> dict[str, dict]:
    """The canonical results files by benchmark name (NAME.json only)."""
    out = {}
    for p in sorted(results_dir.glob("*.json")):
        if p.name.endswith(".quick.json"):
            continue
        doc = json.loads(p.read_text())
        if isinstance(doc, dict) and doc.get("benchmark") == p.stem and "results" in doc:
            out[p.stem] = doc
    return out


def _target(r: dict) -> str:
    if r.get("target") is None:
        return "—"
    return ("≥ " if r.get("higher_is_better") else "≤ ") + f"{r['target']:g}"


def _met(r: dict, unverified: str) -> str:
    met = {True: "met", False: "**MISSED**", None: "—"}[r.get("ok")]
    return f"{met}, {unverified}" if unverified else met


def _unverified(name: str, doc: dict) -> str:
    """Why a results file's figures are not verified ('' for a format-2 file: the table test verifies those)."""
    if doc.get("format") == provenance.FORMAT:
        return ""
    listed = provenance.LEGACY.get(f"{name}.json")
    return listed[1] if listed else "unverified (no provenance)"


def _load(doc: dict) -> str:
    load = doc.get("load")
    if load:
        return (f"{load['samples'][0][1]:g} at start, {load['mean_1m']:g} mean, {load['max_1m']:g} max "
                f"({len(load['samples'])} samples)")
    return " / ".join(f"{x:g}" for x in doc.get("machine", {}).get("loadavg_at_start") or [])


def _ratio(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"


def _machine(m: dict) -> str:
    mem = f", {m['memory_gib']:g} GiB" if m.get("memory_gib") else ""
    return f"{m.get('cpu_model', '?')}, {m.get('cores_usable') or m.get('cores')} cores{mem}"


def _scale(doc: dict) -> str:
    s = doc.get("scale") or {}
    return ", ".join(f"`{k}={v}`" for k, v in s.items()) or "default"


def markdown(results_dir: Path = HERE / "results", bench_dir: Path = HERE) -> str:
    docs = load(results_dir)
    names = sorted({p.stem.removeprefix("bench_") for p in bench_dir.glob("bench_*.py")} | set(docs))
    rows = ["| benchmark: measured / baseline | measured | baseline | ratio | target | met? | run |",
            "|---|---|---|---:|---|---|---|"]
    runs = ["| results file | started (UTC) | machine | load (1 min) | scale | wall | git commit | provenance |",
            "|---|---|---|---|---|---:|---|---|"]
    for name in names:
        doc = docs.get(name)
        if doc is None:
            earlier = sorted(p.name for p in results_dir.glob(f"{name}-*.json"))
            extra = f" (its own raw runs: {', '.join(f'`{e}`' for e in earlier)})" if earlier else ""
            rows.append(f"| `bench_{name}.py` | not run here{extra} | | | | | — |")
            continue
        unverified = _unverified(name, doc)
        for r in doc["results"]:
            note = f" ({_cell(r['note'])})" if r.get("note") else ""
            rows.append(f"| {_cell(r['name'])}{note} | {_cell(r['measured'])} | {_cell(r['baseline'])} | "
                        f"{_ratio(r['ratio'])} | {_target(r)} | {_met(r, unverified)} | `{name}` |")
        m = doc.get("machine", {})
        commit = (m.get("git_commit") or "")[:10] + (" (dirty)" if m.get("git_dirty") else "")
        runs.append(f"| [`{name}.json`](benchmarks/results/{name}.json) | {_cell(doc.get('started_utc', ''))} | "
                    f"{_cell(_machine(m))} | {_load(doc)} | {_scale(doc)} | "
                    f"{doc.get('wall_s', 0):.0f} s | {commit} | {unverified or 'run.py, verified by the table test'} |")
    return "\n".join(rows) + "\n\n" + "\n".join(runs) + "\n"


def update_readme(path: Path, results_dir: Path = HERE / "results", bench_dir: Path = HERE) -> bool:
    """Rewrite the generated benchmark section of ``path``; True if it changed."""
    text = path.read_text()
    a, b = text.index(BEGIN), text.index(END)
    new = text[: a + len(BEGIN)] + "\n\n" + markdown(results_dir, bench_dir) + "\n" + text[b:]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = update_readme(HERE.parent / "README.md")
    print("README.md updated" if changed else "README.md already up to date")
    sys.exit(0)
