"""The first hour (issue 43): what a newcomer reads in hints, errors and the demo's output names
things that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# `docs/how-to/land-rollouts.md, Ingest contract` / `docs/reference/cli.md "Output and exit codes"` (or a README
# section) in a message, hint or docstring
_REF = re.compile(r"""(README|docs/[\w/.-]+?\.md)(?:'s)?,?\s+(?:"([^"]+)"|([A-Z][A-Za-z' ]+?)(?=[)\].:;]))""")


def _headings(doc: str) -> list[str]:
    """The page's headings and its paragraphs' bold titles (`**Damaged intents** (...)`)."""
    path = ROOT / ("README.md" if doc == "README" else doc)
    if not path.is_file():
        return []
    return [m.group(1) or m.group(2) for m in re.finditer(r"^(?:#{1,6}\s+(.+)|\*\*([^*]+)\*\*)", path.read_text(), re.M)]


def _has_section(doc: str, section: str) -> bool:
    """``section`` is a heading of ``doc`` or the start of one ("Cleanup": "Cleanup of what crashed writers leave")."""
    return any(h.strip().rstrip(".:") == section or h.startswith(section + " ") for h in _headings(doc))


def _sources() -> list[Path]:
    return sorted((ROOT / "pipeline").rglob("*.py")) + sorted((ROOT / "scripts").glob("*"))


def test_every_section_a_message_names_exists():
    """A message that sends the reader to "README, X" or "docs/PAGE.md, X" names a page that exists and a
    heading that page has."""
    named: dict[tuple[str, str], list[str]] = {}
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in _REF.finditer(line):
                section = (m.group(2) or m.group(3)).strip()
                named.setdefault((m.group(1), section), []).append(f"{path.relative_to(ROOT)}:{n}")
    assert named, "the pattern finds no section reference at all: it is broken"
    assert any(doc.startswith("docs/") for doc, _ in named), "no message names a docs page: the pattern is broken"
    missing = {f"{doc}: {s}": where for (doc, s), where in named.items() if not _has_section(doc, s)}
    assert not missing, f"sections named but absent: {missing}"


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


def _next_steps(env_path: str, cwd: Path) -> str:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PATH": env_path, "PYTHONPATH": str(ROOT)}
    code = "from pipeline.demo import next_steps; print(next_steps('lake/demo-x', 'ckpt-1'))"
    return subprocess.run([sys.executable, "-P", "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True).stdout


def test_demo_next_steps_run_in_a_shell_without_the_venv_activated(tmp_path):
    """Bare `pipeline` is "command not found" until the venv is activated: the demo's
    closing hints name the venv's script, and how to activate it."""
    import shutil
    import sys

    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "pipeline").exists():
        pytest.skip("not run from a virtual environment with the pipeline script installed")
    bare_path = "/usr/bin:/bin"
    assert shutil.which("pipeline", path=bare_path) is None
    text = _next_steps(bare_path, venv_bin.parent.parent)     # the checkout: `.venv/bin/pipeline`
    head, *cmds = text.strip().splitlines()
    assert f"`. {venv_bin.parent.name}/{venv_bin.name}/activate`" in head
    for line in cmds:
        exe = line.split()[0]
        assert exe != "pipeline" and (venv_bin.parent.parent / exe).resolve() == (venv_bin / "pipeline").resolve()
    # elsewhere: the absolute path
    exe = _next_steps(bare_path, tmp_path).strip().splitlines()[1].split()[0]
    assert Path(exe).is_absolute() and Path(exe).resolve() == (venv_bin / "pipeline").resolve()
    # activated (the venv's bin first on PATH): plain `pipeline`
    text = _next_steps(f"{venv_bin}:{bare_path}", tmp_path)
    assert text.startswith("next, try:\n") and all(ln.split()[0] == "pipeline" for ln in text.strip().splitlines()[1:])


def _run_cli(args: list[str], *, cwd: Path, extra_path: Path | None = None, timeout: float = 300):
    import os
    import subprocess
    import sys

    pp = ([str(extra_path)] if extra_path else []) + [str(ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pp)}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def no_vllm(tmp_path) -> Path:
    """A PYTHONPATH entry whose `vllm` raises ImportError on import: vLLM as a default setup has it (missing)."""
    shim = tmp_path / "shim" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError(\"No module named 'vllm' (simulated by the test)\")\n")
    return shim.parent


@pytest.mark.parametrize("argv", [["rollout", "--engine", "vllm", "--workers", "2", "--groups", "2"],
                                  ["demo", "--engine", "vllm", "--iterations", "1"]], ids=["rollout", "demo"])
def test_missing_vllm_is_one_line_before_any_work(tmp_path, no_vllm, argv):
    lake = tmp_path / "lk"
    r = _run_cli([*argv, "--lake", str(lake)], cwd=tmp_path, extra_path=no_vllm)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: vllm") and "is not installed" in lines[0], r.stderr
    assert len(lines) == 2 and "setup-env.sh --vllm" in lines[1], "the error and its hint, nothing else: " + r.stderr
    assert "died" not in r.stderr and "warm start" not in r.stderr + r.stdout
    assert not lake.exists(), "no lake is created before the missing engine is reported"


def test_the_demo_prints_the_alerts_its_report_raised(tmp_path):
    """The default demo's report raises off-policy alerts (ESS/n, ratio p99): the demo's own
    output names each alert and why, not only the HTML."""
    import pyarrow as pa

    from pipeline.demo import write_demo_report
    from pipeline.lake.delta import Lake
    from pipeline.schema import table_spec
    from pipeline.testing.health_lake import HealthLakeSpec, build_health_lake

    lake = Lake(tmp_path / "lake")
    build_health_lake(lake, HealthLakeSpec(trajectories_per_version=20, versions=2, event_episodes=4))
    lines: list[str] = []
    clean = write_demo_report(lake, lines.append)
    assert (tmp_path / "lake" / "report.html").exists() and clean["report"].endswith("report.html")
    assert not {"ess_seq_frac", "behav_ratio_p99"} & {a["check"] for a in clean["alerts"]}
    m = max(lake.read("metrics").to_pylist(), key=lambda r: r["global_step"])
    lake.append("metrics", pa.Table.from_pylist([dict(m, global_step=500, ess_seq_frac=0.483, behav_ratio_p99=2.31)],
                                                 schema=table_spec("metrics").arrow_schema()), command="t")
    lines.clear()
    res = write_demo_report(lake, lines.append)
    text = "\n".join(lines)
    assert lines[0].startswith("health report: ") and "alert" in lines[1]
    assert {"ess_seq_frac", "behav_ratio_p99"} <= {a["check"] for a in res["alerts"]}
    assert "ess_seq_frac: Training data is far off-policy" in text and "fell to 0.483 (bound 0.5)" in text
    assert "behav_ratio_p99: " in text and "p99 of pi/mu reached 2.31 (bound 2)" in text
    assert len([ln for ln in lines if ln.startswith("  ")]) == len(res["alerts"]), "one line per alert"


def test_admit_target_line_never_prints_none():
    from pipeline.admission.run import target_report
    from pipeline.commands.admit import target_text

    none_decided = target_text(target_report(8, 0, 0))
    assert "None" not in none_decided and "admit rate unknown (no group decided" in none_decided
    nothing_admitted = target_text(target_report(8, 0, 5))
    assert "None" not in nothing_admitted and "admit rate 0.0%" in nothing_admitted
    assert target_text(target_report(8, 2, 4)) == "target 8 groups: 6 missing, admit rate 50.0%, sample ~12 more groups"
    assert target_text(target_report(2, 3, 4)).endswith("target met")


def test_rollout_with_a_mistyped_lake_refuses_before_creating_it(tmp_path, capsys):
    from pipeline.cli import main

    (tmp_path / "lake").mkdir()
    typo = tmp_path / "lkae"
    assert main(["rollout", "--lake", str(typo), "--groups", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: lake {typo} does not exist") and f"did you mean --lake {tmp_path / 'lake'}?" in err
    assert not typo.exists(), "nothing is created under a mistyped --lake"
    # an existing lake without a published policy: refused before any spool, lock or lineage file
    assert main(["rollout", "--lake", str(tmp_path / "lake"), "--groups", "1"]) == 2
    assert "no published policy" in capsys.readouterr().err and list((tmp_path / "lake").iterdir()) == []


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(capsys, monkeypatch):
    """The warm start under CI or a job's log (stderr piped) says where it is, without a tqdm bar."""
    import pipeline.console as console

    clock = iter([0.0, 4.0, 11.0, 12.0, 22.0, 24.0, 30.0])   # start, 5 steps, end
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    with console.progress_bar(5, "policy v0 warm start", enabled=False) as bar:
        assert bar is not None
        for _ in range(5):
            bar(1)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "policy v0 warm start: 0/5 steps"
    assert err[1] == "policy v0 warm start: 2/5 steps (40%, 11s)"     # at most one line per 10 s
    assert err[2] == "policy v0 warm start: 4/5 steps (80%, 22s)"
    assert err[3] == "policy v0 warm start: 5/5 steps in 30.0s" and len(err) == 4
    with console.progress_bar(5, "quiet", enabled=False, lines_every_s=None) as bar:
        assert bar is None
    assert capsys.readouterr().err == ""


def test_hydra_style_positional_overrides_are_set_overrides(tmp_path, capsys):
    """verl/Hydra users type `pipeline train train.lr=5e-5`: the same as `--set train.lr=5e-5`."""
    import json

    from pipeline.cli import main

    lake = str(tmp_path / "lake")
    assert main(["train", "train.lr=5e-5", "--follow", "epochs=3", "--lake", lake, "--print-config", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["train"]
    assert doc["lr"] == 5e-5 and doc["epochs"] == 3
    # later wins, as with --set; a typo is the config's own error, with did-you-mean
    assert main(["admit", "--set", "max_policy_lag=2", "admission.max_policy_lag=4", "--lake", lake,
                 "--print-config", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["admission"]["max_policy_lag"] == 4
    assert main(["train", "--follow", "train.lrr=1", "--lake", lake, "--print-config"]) == 2
    assert "did you mean `lr`?" in capsys.readouterr().err
    # a command without config options still refuses a stray argument
    with pytest.raises(SystemExit) as e:
        main(["snapshots", "list", "a=b", "--lake", lake])
    assert e.value.code == 2 and "unrecognized arguments: a=b" in capsys.readouterr().err


def test_demo_refuses_experiment_sections_it_would_ignore_and_accepts_trackers(tmp_path, capsys):
    import json

    from pipeline.cli import main

    exp = tmp_path / "exp.yaml"
    exp.write_text("demo:\n  iterations: 2\ntrain:\n  lr: 1.0e-4\nrollout:\n  groups: 4\n")
    lake = tmp_path / "lake"
    assert main(["demo", "--config", str(exp), "--lake", str(lake)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: config file {exp}: pipeline demo reads only its `demo:` section and would "
                          "ignore `rollout:`, `train:`") and len(err.strip().splitlines()) == 2
    assert not lake.exists()
    exp.write_text("demo:\n  iterations: 2\n  lr: 1.0e-4\n")
    assert main(["demo", "--config", str(exp), "--set", "trackers=tensorboard,mlflow", "--print-config", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["demo"]
    assert doc["trackers"] == "tensorboard,mlflow" and doc["lr"] == 1e-4 and doc["iterations"] == 2
    assert main(["demo", "--set", "trackers=tensorbord", "--print-config"]) == 2
    assert "unknown tracker(s) ['tensorbord']" in capsys.readouterr().err
    # the demo's training runs mirror to the trackers it was given (sync: each run; async: the resident trainer)
    from pipeline.demo import DemoConfig, resident_train_sets, train_cfg

    cfg = DemoConfig(trackers="tensorboard")
    assert train_cfg(cfg, 1).trackers == "tensorboard" and resident_train_sets(cfg)["trackers"] == "tensorboard"
    assert "trackers" not in resident_train_sets(DemoConfig())
