"""The first hour (issue 43): what a newcomer reads in hints, errors and the demo's output names
things that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# `README, Ingest contract` / `README "Output and exit codes"` in a message, hint or docstring
_REF = re.compile(r"""README(?:'s)?,?\s+(?:"([^"]+)"|([A-Z][A-Za-z' ]+?)(?=[)\].:;]))""")


def _readme_headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+)$", (ROOT / "README.md").read_text(), re.M)}


def _sources() -> list[Path]:
    return sorted((ROOT / "pipeline").rglob("*.py")) + sorted((ROOT / "scripts").glob("*"))


def test_every_readme_section_a_message_names_exists():
    headings = _readme_headings()
    named: dict[str, list[str]] = {}
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in _REF.finditer(line):
                section = (m.group(1) or m.group(2)).strip()
                named.setdefault(section, []).append(f"{path.relative_to(ROOT)}:{n}")
    assert named, "the pattern finds no README reference at all: it is broken"
    missing = {s: where for s, where in named.items() if s not in headings}
    assert not missing, f"README sections named but absent (headings: {sorted(headings)}): {missing}"


def test_no_message_names_the_unpublished_package():
    """No index has trajectory-lakehouse: `pip install 'trajectory-lakehouse[...]'` cannot work."""
    pat = re.compile(r"pip install[^\n]*trajectory-lakehouse")
    offenders = [str(p.relative_to(ROOT)) for p in [*_sources(), ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
                 if p.is_file() and (pat.search(p.read_text()) or "trajectory-lakehouse[" in p.read_text())]
    assert not offenders


@pytest.mark.parametrize("extra", ["vllm", "gpu", "gguf", "verl", "quality"])
def test_missing_extra_hint_is_a_command_that_exists(extra):
    from pipeline.errors import MissingExtraError

    err = MissingExtraError("somepkg", extra)
    assert "trajectory-lakehouse" not in str(err) and "README, Setup" not in str(err)
    script = (ROOT / "scripts/setup-env.sh").read_text()
    flags = re.findall(r"setup-env\.sh(?: (--[a-z]+))?", err.hint or "")
    extras = re.findall(r"-e '\.\[([a-z]+)\]'", err.hint or "")
    assert flags or extras, err.hint
    for flag in filter(None, flags):
        assert f"    {flag})" in script, f"setup-env.sh has no {flag}"
    declared = (ROOT / "pyproject.toml").read_text()
    for e in extras:
        assert re.search(rf"^{e} = \[", declared, re.M), f"pyproject.toml declares no [{e}] extra"
