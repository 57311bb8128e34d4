"""The layout rules the README states: one module per CLI verb, test data
outside the runtime import graph, no references to files outside the repository."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from pipeline.cli import build_parser
from pipeline.commands import VERBS

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "pipeline"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


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


def test_runtime_code_never_imports_the_testing_package():
    offenders = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
                 if "testing" not in p.relative_to(PKG).parts[:1]
                 and any(n == "pipeline.testing" or n.startswith("pipeline.testing.") for n in _imports(p))]
    assert offenders == []


def test_no_tracked_file_cites_files_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    needle = "shared" + "/"      # spelled apart so this file does not match itself
    hits = [f for f in files if (ROOT / f).is_file() and f.endswith((".py", ".md", ".toml", ".yaml", ".yml", ".sh",
                                                                      ".sql", ".cfg", ".txt"))
            and any(f"../{needle}" in line or f" {needle}DESIGN" in line or f"{needle}VERIFIED" in line
                    for line in (ROOT / f).read_text(errors="replace").splitlines())]
    assert hits == []
