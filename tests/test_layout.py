"""The layout rules the README states: the layers of docs/architecture.md (as
import-linter contracts in pyproject.toml, run here with `lint-imports`), no
import circle at any depth, one module per CLI verb, test data outside the
runtime import graph, no private name imported across modules, no module over
700 lines and no function over 100, no references to files outside the
repository."""

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
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert cfg.get("exclude_type_checking_imports") is False, "a TYPE_CHECKING import counts (docs/architecture.md)"
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
    acyclic = contracts()["acyclic"]
    assert acyclic["ancestors"] == ["pipeline"]   # the top level and every package below it
    deepest = max(len(p.relative_to(PKG).parts) for p in PKG.rglob("__init__.py"))
    assert acyclic.get("depth", 10) > deepest, "the acyclic contract stops above the deepest sub-package"


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
    base = tmp_path / "pipeline" / "rollout" / "envs" / "base.py"   # a circle two levels down, type-only
    base.write_text(base.read_text() + "\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                    "    from pipeline.rollout.envs.arithmetic import ArithmeticTool  # noqa: F401\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0
    for name in ("Each layer imports only from the layers below it BROKEN",
                 "Runtime code never imports the test-data package (pipeline.testing) BROKEN",
                 "No import circles between the modules of any package, at any depth BROKEN",
                 "No cycles are allowed in pipeline.train.", "No cycles are allowed in pipeline.rollout.envs."):
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


# -- no import circle at any depth -----------------------------------------------------------------------------
def import_circles(graph) -> list[tuple[str, list[str]]]:
    """Every circle among the children of one package, for every package of ``graph``: (package, a shortest
    circle through the modules that import each other, in import order, the first repeated at the end; then,
    after "|", every module of that tangle when it is more than the circle). An import of a child's descendant counts as
    an import of the child (``lake.delta.store -> lake.objects`` makes ``delta -> objects`` in ``lake``)."""
    found = []
    for package in sorted(m for m in graph.modules if graph.find_children(m)):
        depth = package.count(".") + 1

        def child(module: str) -> str | None:
            return ".".join(module.split(".")[:depth + 1]) if module.startswith(package + ".") else None

        edges: dict[str, set[str]] = {}
        for module in graph.find_descendants(package):
            a = child(module)
            for imported in graph.find_modules_directly_imported_by(module):
                b = child(imported)
                if a and b and a != b:
                    edges.setdefault(a, set()).add(b)
        for component in _strongly_connected(edges):
            circle = _one_circle(edges, component)
            rest = sorted(component - set(circle))
            found.append((package, circle + (["|", *sorted(component)] if rest else [])))
    return found


def _strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for nxt in children:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        component.add(m)
                        if m == node:
                            break
                    if len(component) > 1:
                        out.append(component)
    return out


def _one_circle(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest circle through the first member of ``component`` (breadth first), to print."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(edges.get(node, set()) & component):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return sorted(component)


def test_no_import_circle_at_any_depth_type_only_imports_included():
    """What the acyclic contract checks, with each circle spelled out: between the children of every package
    (the top level, lake, lake.delta, rollout.envs, ...) no import chain returns to where it started, counting
    imports inside functions and under TYPE_CHECKING."""
    import grimp

    circles = import_circles(grimp.build_graph("pipeline", exclude_type_checking_imports=False, cache_dir=None))
    def say(package: str, circle: list[str]) -> str:
        short = [m.removeprefix(package + ".") for m in circle]
        loop, tangle = (short[:short.index("|")], short[short.index("|") + 1:]) if "|" in short else (short, [])
        return f"  in {package}: {' -> '.join(loop)}" + (f"  (one tangle of {', '.join(tangle)})" if tangle else "")

    assert circles == [], "import circles (move the shared piece into a module below both):\n" + "\n".join(
        say(package, circle) for package, circle in circles)


def test_the_circle_finder_finds_deep_and_long_circles():
    import grimp

    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.s", "p.s.x", "p.s.y", "p.s.z"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.s.x")          # p.b -> p.s
    g.add_import(importer="p.s.y", imported="p.c")          # p.s -> p.c: no circle at the top yet
    g.add_import(importer="p.s.x", imported="p.s.y")
    g.add_import(importer="p.s.y", imported="p.s.z")
    g.add_import(importer="p.s.z", imported="p.s.x")        # x -> y -> z -> x, one level down
    assert import_circles(g) == [("p.s", ["p.s.x", "p.s.y", "p.s.z", "p.s.x"])]
    g.add_import(importer="p.c", imported="p.a")            # a -> b -> s -> c -> a at the top
    assert ("p", ["p.a", "p.b", "p.s", "p.c", "p.a"]) in import_circles(g)


# -- private means private ------------------------------------------------------------------------------------
def _private_imports(paths) -> list[str]:
    hits = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline"):
                hits += [f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}"
                         for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return hits


def test_no_private_name_is_imported_across_modules():
    """A name with a leading underscore is its module's own: what another module (or a test, a benchmark) needs
    gets a public name in the module that owns it."""
    paths = [p for d in ("pipeline", "tests", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]
    hits = _private_imports(paths)
    assert hits == [], "private names imported across modules:\n" + "\n".join(hits)


# -- function size ----------------------------------------------------------------------------------------------
def test_no_function_is_over_100_lines():
    """A function over 100 lines (from its ``def`` to its last line) is split into named steps."""
    long = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 100:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert long == {}
