"""The README is short, its commands are the ones that work, and its five-minute tour shows what
`pipeline demo` prints.

The demo is deterministic (seeded sampling, tool faults and evaluation) except for wall times, the
trainer's idle share, ids that hash a time and paths: ``normalize`` masks exactly those. The tour's
sample output (README.md and docs/getting-started.md) is checked against tests/demo_transcript.txt, the
normalized stdout of one demo run; the slow test runs the demo and compares its whole output with that
transcript. After a change to what the demo prints:

    python tests/test_readme.py        # rerun the demo, rewrite tests/demo_transcript.txt; then update the tour
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRANSCRIPT = ROOT / "tests" / "demo_transcript.txt"
TOUR = "## A five-minute tour"

_MASKS = [
    (re.compile(r"\S*lake/demo-\d{8}-\d{6}(?:-[0-9a-f]{6})?"), "./lake/demo-<time>"),   # the demo's fresh lake
    (re.compile(r"\bck-[0-9a-f]{20}\b"), "ck-<id>"),                       # checkpoint ids hash a time
    (re.compile(r"\bin \d+(?:\.\d+)?s\b"), "in <t>s"),                     # wall times
    (re.compile(r"trainer idle \d+%"), "trainer idle <n>%"),
]
_ROW = re.compile(r"^(\s+\d+\s+\d+\s.*?)\s+\d+(?:\.\d+)?$")   # an iteration row: its last column is secs (right-aligned)


def normalize(text: str) -> list[str]:
    """The demo's stdout without what varies between runs, up to its closing "next, try" hints (those name
    the caller's shell and virtual environment)."""
    out = []
    for line in text.splitlines():
        if line.startswith("next, try"):
            break
        for pat, repl in _MASKS:
            line = pat.sub(repl, line)
        out.append(_ROW.sub(r"\1    <t>", line).rstrip())
    return out


def _tour_output(page: Path) -> list[str]:
    """The sample output of the tour: the ```text block of the page's tour section that starts with `lake:`."""
    section = page.read_text().split(TOUR, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```text\n(.*?)```", section, re.S)
    sample = [b for b in blocks if b.startswith("lake: ")]
    assert sample, f"{page.name}: no ```text block starting with 'lake: ' under '{TOUR}'"
    return normalize(sample[0])


def run_demo(cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PIPELINE_LAKE", None)   # the demo makes its fresh lake under cwd
    return subprocess.run([sys.executable, "-m", "pipeline", "demo"], cwd=cwd, env=env, capture_output=True,
                          text=True, check=True, timeout=1200).stdout


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_tour_sample_output_is_the_demo_transcript(page):
    """Every line the tour shows is the demo's, in order, and the tour shows the whole table and its
    closing figures (a tour that drops the rows would pass the line check)."""
    sample, transcript = _tour_output(ROOT / page), TRANSCRIPT.read_text().splitlines()
    assert sample == transcript, (f"{page}: the tour's sample output is not what the demo prints "
                                  f"(tests/demo_transcript.txt); first difference: "
                                  f"{next((a, b) for a, b in zip(sample + [''] * 99, transcript + [''] * 99) if a != b)}")


def test_normalize_masks_only_what_varies():
    a = ("lake: /x/lake/demo-20261205-090235-4f0c2a   mode: sync\npolicy version 0 (warm start) in 88.2s: held-out 0.000\n"
         "   1    1    256    31     1     0     1  0.388    1.000 0.00    5.1\n"
         "held-out success 0.000 (v0) -> 0.985 (v6): +98.5 points in 103s; trainer idle 70%; lag {0: 1253}\n"
         "  in checkpoint ck-99680789477542ba705b, step 1.\nnext, try:\n  pipeline sql\n")
    b = a.replace("88.2s", "32.7s").replace("   5.1\n", " 117.0\n").replace("103s", "64s").replace("70%", "64%")
    assert normalize(a) == normalize(b) and len(normalize(a)) == 5
    assert normalize(a) != normalize(a.replace("0.388", "0.389")), "a changed figure must show"
    assert normalize(a) != normalize(a.replace("    31 ", "    30 ")), "a changed count must show"


def test_readme_is_short_and_its_local_links_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move the detail into a docs/ page"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [u for u in links if not re.match(r"[a-z]+://", u)]
    assert local, "the README links into the docs site"
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen-docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    generated = {f"docs/{g}" for g in gen.GENERATED}   # not committed: a clone has no such file until gen-docs runs
    missing = [u for u in local if not (ROOT / u).exists() or u in generated]
    assert not missing, f"README.md links to files that do not exist in a clone: {missing}"


def test_readme_commands_activate_the_venv():
    """A bare `pipeline` works only in an activated venv: the README says how before it uses one."""
    text = (ROOT / "README.md").read_text()
    first_bare = re.search(r"^pipeline ", text, re.M)
    activate = text.find(". .venv/bin/activate")
    assert activate != -1 and (first_bare is None or activate < first_bare.start())
    assert "bash scripts/setup-env.sh && .venv/bin/pipeline demo" in text
    assert "bash scripts/setup-env.sh --test && .venv/bin/python -m pytest -q" in text
    assert "bash scripts/setup-env.sh --test && .venv/bin/python -m pytest -q" in (ROOT / ".ci/run").read_text()


@pytest.mark.slow
def test_demo_prints_the_committed_transcript(tmp_path):
    """The demo run end to end (about a minute on 2 cores): its output is the committed transcript."""
    got = normalize(run_demo(tmp_path))
    want = TRANSCRIPT.read_text().splitlines()
    assert got == want, ("pipeline demo no longer prints tests/demo_transcript.txt: if the change is meant, "
                         "run python tests/test_readme.py and update the tour (README.md, docs/getting-started.md)\n"
                         + "\n".join(got))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        TRANSCRIPT.write_text("\n".join(normalize(run_demo(Path(d)))) + "\n")
    print(f"wrote {TRANSCRIPT.relative_to(ROOT)}")
