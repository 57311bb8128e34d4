"""The layout rules the README states: the layers of docs/architecture.md (as
import-linter contracts in pyproject.toml, run here with `lint-imports`), one
module per CLI verb, test data outside the runtime import graph, no references
to files outside the repository."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from pipeline.cli import build_parser
from pipeline.commands import VERBS

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "pipeline"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the package under ``root`` with ``root``/pyproject.toml's contracts."""
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
           "sys.exit(lint_imports_command())", "--no-cache", "--no-logo", "pyproject.toml"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def contracts() -> dict[str, dict]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in cfg["contracts"]}


def test_import_contracts_hold_with_no_exceptions():
    cs = contracts()
    assert set(cs) == {"layers", "testing", "acyclic"}
    assert not [c["id"] for c in cs.values() if "ignore_imports" in c], "an import that breaks a contract is moved"
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"Contracts: 3 kept, 0 broken", r.stdout), r.stdout


def _top_level() -> set[str]:
    return {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"} | {
        p.parent.name for p in PKG.glob("*/__init__.py")}


def test_every_top_level_module_has_exactly_one_layer():
    layers = contracts()["layers"]["layers"]
    named = [n.strip() for layer in layers for n in re.split(r"[|:]", layer)]
    assert sorted(named) == sorted(set(named)), "a module is named in two layers"
    assert set(named) == _top_level()
    runtime = {m.removeprefix("pipeline.") for m in contracts()["testing"]["source_modules"]}
    assert runtime == _top_level() - {"testing"}
    ancestors = {m.removeprefix("pipeline.") for m in contracts()["acyclic"]["ancestors"]}
    assert ancestors == {p.parent.name for p in PKG.glob("*/__init__.py")}   # every sub-package, recursively


def test_the_contracts_fail_on_an_import_up_a_layer_across_stages_in_a_circle_or_into_testing(tmp_path):
    """The same contracts over a copy of the package with one offending import
    per contract: each is reported broken (the tool is not vacuously green)."""
    shutil.copytree(PKG, tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")

    def add(rel: str, line: str) -> None:
        f = tmp_path / "pipeline" / rel
        f.write_text(f.read_text() + f"\n\ndef _offending():\n    {line}\n")

    add("lake/ref.py", "from pipeline import lineage  # storage reaching up")
    add("admission/rules.py", "from pipeline.rollout import envs  # one stage importing another")
    add("train/packing.py", "from pipeline.train import run  # run imports packing: a circle")
    add("report/html.py", "from pipeline.testing import trajectories  # runtime importing test data")
    r = lint_imports(tmp_path)
    assert r.returncode != 0
    for name in ("Each layer imports only from the layers below it BROKEN",
                 "Runtime code never imports the test-data package (pipeline.testing) BROKEN",
                 "No import circles between the modules of one sub-package BROKEN"):
        assert name in r.stdout, r.stdout
    for offence in ("pipeline.lake.ref -> pipeline.lineage", "pipeline.admission.rules -> pipeline.rollout.envs",
                    "pipeline.report.html -> pipeline.testing.trajectories"):
        assert offence in r.stdout, (offence, r.stdout)


def test_every_verb_is_one_module_named_after_it():
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert sorted(sub.choices) == sorted(VERBS)
    modules = sorted(p.stem for p in (PKG / "commands").glob("*.py") if p.stem != "__init__")
    assert modules == sorted(VERBS)
    for verb in VERBS:   # each module registers exactly its own verb
        tree = ast.parse((PKG / "commands" / f"{verb}.py").read_text())
        top = [n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
               and getattr(n.func, "attr", "") == "add_parser" and getattr(n.func.value, "id", "") == "sub"]
        assert top == [verb], (verb, top)


def test_no_stage_keeps_a_command_module():
    assert not list(PKG.glob("*/command.py")) and not list(PKG.glob("*_command.py"))


def test_no_tracked_file_cites_files_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    # the team's documents outside the repository, spelled apart so this file does not cite them itself
    outside = "".join(("sha", "red", "/"))
    needles = ["." + "./" + outside] + [outside + "".join(parts) for parts in (("DES", "IGN"), ("VERI", "FIED"),
                                                                                ("STY", "LE"))]
    hits = [f for f in files if (ROOT / f).is_file() and f.endswith((".py", ".md", ".toml", ".yaml", ".yml", ".sh",
                                                                      ".sql", ".cfg", ".txt", ".json", ".ini"))
            and any(n in line for line in (ROOT / f).read_text(errors="replace").splitlines() for n in needles)]
    assert hits == [], "restate what the code relies on in docs/ instead"


def test_no_module_is_over_700_lines():
    """Every module stays small enough to know: one over 700 lines is split along its seams (CONTRIBUTING.md)."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert len(sizes) > 50, "the package's modules were not found"
    assert {f: n for f, n in sizes.items() if n > 700} == {}
