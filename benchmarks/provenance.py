"""Where a results file came from, and the check that it did (issue 39).

``benchmarks/run.py`` is the only writer of ``benchmarks/results/NAME.json``.
Each file it writes (format 2) records the exact command, the sha256 of every
benchmark source file the run loaded (the ``bench_*.py`` module, ``run.py``,
this module and any other helper under ``benchmarks/``), the git commit and
whether the tree was clean, start and end times, the load average sampled in
the background during the run, the raw measurements, the figures derived from
them by the benchmark's ``derive(raw)`` and a sha256 digest of all of it.

``verify`` (called by tests/test_benchmarks_table.py) refuses a file when:

- a top-level field is missing or one was added, or the digest does not match
  (a number edited by hand without re-hashing);
- the tree was dirty, the run was a ``--quick`` smoke run, or the commit is
  newer than the run's start;
- a recorded source hash differs from that file at the recorded commit
  (``git show COMMIT:PATH``), or the commit is not in this clone;
- the figures are not what the commit's own ``derive(raw)`` makes of the raw
  measurements (every ratio, text and "met"), or a ratio lies outside the
  range a real measurement can fall in.

A determined forger can still re-run the hashing by hand: the digest catches
edits, not intent. What it guarantees is that every figure follows, by code
committed before the run, from raw numbers that were not touched afterwards.

Files written before this existed are accepted only as listed in ``LEGACY``,
pinned by the sha256 of their bytes (an edit to one is refused too); the
README table marks their rows unverified. Nothing here imports the project.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

FORMAT = 2
FIELDS = frozenset({"format", "benchmark", "file", "quick", "command", "cwd", "scale", "started_utc", "ended_utc",
                    "wall_s", "sources", "machine", "load", "raw", "results", "digest"})
RESULT_FIELDS = frozenset({"name", "ratio", "target", "measured", "baseline", "higher_is_better", "note",
                           "possible", "ok"})

_BEFORE = "unverified (written before provenance; re-run pending)"
_BY_HAND = "unverified (assembled or rewritten by hand after its run, issue 39; re-run pending)"
_OWN = "unverified (written by bench_gates.py itself, not run.py; re-run pending)"
# name -> (sha256 of the file's bytes, why it is unverified). Remove a name when its re-run lands.
LEGACY: dict[str, tuple[str, str]] = {
    "admission.json": ("ba932059e4f6ea004ec853ad3b72ebd3a15945629d0cd20e4b698285f44c6a3a", _BEFORE),
    "dask.json": ("4afdbddae2f0a5af7fdd0401b9eb30f96b5109e23ed458214cc92c26485331a1", _BEFORE),
    "demo.json": ("429b7d025ea04cb0859ff72bcddfe2273343e9e232a56006d2a5275a27a954ea", _BEFORE),
    "gates-20261130T215848.json": ("248f63356b89a1290cd2c268ee8c25f85577582cc823f4807fff189a6c4b60ed", _OWN),
    "gates-20261130T215922.json": ("b8bc9b9531f78196e879b9d5b99cc0f2362837bccd63fd20d55b23766a46fec6", _OWN),
    "gates-async-lag4-seeds5-9.json": ("9a7dd49e11b9583dd0483fcfecb8e1b1fd117d12ab9389d1a4f4625078bc88aa", _OWN),
    "gates-async-lag4.json": ("b1f739ce6f71de29aa671d51b0b376f397b2a071ae10b22b50f8dc5d25fe25fe", _OWN),
    "gates-flaky-tool-p02.json": ("2fb68fb5112941137b9213ac1b60ac8db200625d136bc801dcbfe44866b567aa", _OWN),
    "gates-flaky-tool.json": ("a174050b406508d5d8284d014addb6a5f2f4b77fde0a69aac27f5c9c2a7a7322", _OWN),
    "generation.json": ("6ccce1cd4d91f9f1dd4ae43196ce9a26eb8f83d4cbe64b7ee8038ba9484107de", _BEFORE),
    "history.json": ("85e76ea6f9fc94ca4e240928f4423a19ec16e11bb543f3a33c89207a40763359", _BEFORE),
    "ingest.json": ("8c8c45314a3e74b88dca9f360b5fe79cbc23f477170d6c3f248ef8d9db0ab4cb", _BEFORE),
    "queries.json": ("f855eb4fda3b3323de8ec1fa5f0f82d263a0d120b91bd1e1a56f5b1f017b53de", _BEFORE),
    "step_order.json": ("8cc4956e18588a4df9ced01d63a1409e271291b404036f870f60bf5e16a6a63c", _BEFORE),
    "train.json": ("fbc5a55fe43905adb85479c0aa4166a168ebc5cc2ba8a51c9863e0781e791b35", _BEFORE),
    "writers.json": ("2de493405c28b48da0853fe0f9b4d5a5a10e3848cc1e60470e8801be067e1783", _BEFORE),
    "zero_memory.json": ("e60ee371b45ce3645c06413d9897a83653b8a54ce7a40b6c66fe7bb090b0df77", _BEFORE),
}


class Refused(Exception):
    """A results file the table must not show as verified; the message says why and what to do."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    return sha256_bytes(Path(path).read_bytes())


def digest(doc: dict[str, Any]) -> str:
    """sha256 of the document without its digest, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    return sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode())


def utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


class LoadSampler:
    """The 1/5/15-minute load averages every ``interval_s`` in a background thread,
    from the start of the run to its end (both ends sampled)."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._t0 = 0.0
        self._thread = threading.Thread(target=self._loop, name="load-sampler", daemon=True)

    def _sample(self) -> None:
        self.samples.append([round(time.monotonic() - self._t0, 1), *(round(x, 2) for x in os.getloadavg())])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> LoadSampler:
        self._t0 = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def summary(self) -> dict[str, Any]:
        one = [s[1] for s in self.samples]
        return {"interval_s": self.interval_s, "samples": self.samples, "min_1m": min(one), "max_1m": max(one),
                "mean_1m": round(sum(one) / len(one), 2)}


def ok(r: dict[str, Any]) -> bool | None:
    """Whether a figure met its target, from its ratio (the rule of run.Result.ok)."""
    if r.get("target") is None:
        return None
    return r["ratio"] >= r["target"] if r.get("higher_is_better") else r["ratio"] <= r["target"]


def outside_possible(name: str, ratio: float, possible: Any) -> str | None:
    """Why a ratio cannot be a real measurement, or None."""
    if not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
        return f"{name}: ratio {ratio!r} is not a finite number"
    lo, hi = possible if possible else (None, None)
    if (lo is not None and ratio < lo) or (hi is not None and ratio > hi):
        return (f"{name}: ratio {ratio:.4g} is outside the range a real measurement can fall in "
                f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]")
    return None


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=60)


def _sources_at(root: Path, commit: str, sources: dict[str, str], name: str) -> dict[str, bytes]:
    if _git(root, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        shallow = _git(root, "rev-parse", "--is-shallow-repository").stdout.decode().strip() == "true"
        raise Refused(f"{name}: its commit {commit} is not in this clone"
                      + (" (a shallow clone: run `git fetch --unshallow`, the check needs the history)" if shallow
                         else " (was the branch rebased or squashed after the run? results must be merged as "
                              "committed, or re-run)"))
    out = {}
    for rel, recorded in sorted(sources.items()):
        got = _git(root, "show", f"{commit}:{rel}")
        if got.returncode != 0:
            raise Refused(f"{name}: source {rel} is not in commit {commit[:10]}: it ran uncommitted code; re-run "
                          "from a clean, committed tree")
        if sha256_bytes(got.stdout) != recorded:
            raise Refused(f"{name}: source {rel} recorded with sha256 {recorded[:12]}…, but the file at commit "
                          f"{commit[:10]} hashes {sha256_bytes(got.stdout)[:12]}…: the results do not come from "
                          "that commit's benchmark; re-run it")
        out[rel] = got.stdout
    return out


_DERIVE = """
import dataclasses, importlib, json, sys
sys.path.insert(0, sys.argv[1])
mod = importlib.import_module(sys.argv[2])
raw = json.loads(open(sys.argv[3]).read())
figs = mod.derive(raw)
print(json.dumps([{k: v for k, v in dataclasses.asdict(f).items() if k != "raw"} | {"ok": f.ok} for f in figs],
                 default=str))
"""


def rederive(root: Path, module: str, raw: Any, files: dict[str, bytes]) -> list[dict[str, Any]]:
    """The figures that the recorded sources' ``derive(raw)`` makes, in a fresh interpreter
    (the commit's ``run.py`` and helpers, never the working tree's)."""
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        bench = Path(tmp) / "benchmarks"
        bench.mkdir()
        for rel, data in files.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_bytes(data)
        (Path(tmp) / "raw.json").write_text(json.dumps(raw))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        p = subprocess.run([sys.executable, "-c", _DERIVE, str(bench), module, str(Path(tmp) / "raw.json")],
                           capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        raise Refused(f"{module}.derive(raw) failed on the recorded raw measurements: {p.stderr[-1500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def verify(path: Path, root: Path) -> dict[str, Any]:
    """The document of a format-2 results file, or ``Refused`` with the reason."""
    name = Path(path).name
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise Refused(f"{name}: not a format-{FORMAT} results file (no provenance) and not listed in "
                      "benchmarks/provenance.py LEGACY: re-run it through benchmarks/run.py")
    if set(doc) != FIELDS:
        raise Refused(f"{name}: fields added {sorted(set(doc) - FIELDS)} / missing {sorted(FIELDS - set(doc))}: "
                      "only benchmarks/run.py writes results files")
    if doc["digest"] != digest(doc):
        raise Refused(f"{name}: digest mismatch: the file was changed after benchmarks/run.py wrote it; re-run it")
    if doc["quick"]:
        raise Refused(f"{name}: a --quick smoke run, not a result")
    if doc["benchmark"] != Path(path).stem or doc["file"] not in doc["sources"]:
        raise Refused(f"{name}: names benchmark {doc['benchmark']!r} / file {doc['file']!r}")
    m = doc["machine"]
    if m.get("git_dirty") is not False:
        raise Refused(f"{name}: run from a tree with uncommitted changes (git_dirty={m.get('git_dirty')}): "
                      "re-run from a clean checkout")
    if not doc["load"].get("samples") or not doc["started_utc"] <= doc["ended_utc"]:
        raise Refused(f"{name}: no load samples, or it ended before it started")
    files = _sources_at(root, m["git_commit"], doc["sources"], name)
    when = _git(root, "show", "-s", "--format=%ct", m["git_commit"]).stdout.decode().strip()
    if utc(int(when)) > doc["started_utc"]:
        raise Refused(f"{name}: commit {m['git_commit'][:10]} ({utc(int(when))}) is newer than the run's start "
                      f"({doc['started_utc']})")
    module = Path(doc["file"]).stem
    for r in doc["results"]:
        if set(r) != RESULT_FIELDS:
            raise Refused(f"{name}: figure {r.get('name')!r} has fields {sorted(r)}")
        if r["ok"] != ok(r):
            raise Refused(f"{name}: figure {r['name']!r} says ok={r['ok']} but its ratio {r['ratio']} against "
                          f"target {r['target']} says {ok(r)}")
        why = outside_possible(r["name"], r["ratio"], r["possible"])
        if why:
            raise Refused(f"{name}: {why}")
    again = rederive(root, module, doc["raw"], files)
    if again != doc["results"]:
        diff = [(a.get("name"), {k: (a.get(k), b.get(k)) for k in RESULT_FIELDS if a.get(k) != b.get(k)})
                for a, b in zip(doc["results"], again) if a != b] or [("figure count", (len(doc["results"]),
                                                                                     len(again)))]
        raise Refused(f"{name}: the figures are not what {module}.derive makes of the raw measurements: "
                      f"{diff[:3]}")
    return doc


def check_legacy(path: Path) -> str:
    """The reason a listed legacy file is unverified, or ``Refused`` when its bytes changed."""
    name = Path(path).name
    pinned, why = LEGACY[name]
    if sha256_file(path) != pinned:
        raise Refused(f"{name}: a legacy results file (no provenance) whose bytes changed since it was listed: "
                      "legacy files are never edited; re-run it through benchmarks/run.py and remove it from LEGACY")
    return why
