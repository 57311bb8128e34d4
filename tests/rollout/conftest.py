"""Fixtures for the rollout tests: one small warm-started policy per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory) -> Path:
    """An HF policy directory (published as version 0 in a session lake).

    Weak on purpose (few warm-start steps): mixed rewards, tool calls on some
    samples, a few seconds to build."""
    from pipeline.lake.delta import Lake
    from pipeline.rollout.policy import init_policy

    lake = Lake(tmp_path_factory.mktemp("policy") / "lake")
    ref = init_policy(lake, warm_start_steps=120, demonstrations=1500, tool_fraction=0.5)
    return ref.hf_dir


@pytest.fixture
def published(lake, policy_dir):
    """Publish a copy of the session policy in the test's lake as version ``v``."""
    from pipeline.policy_store import local_checkpoint_dir, publish_checkpoint

    def _publish(version: int = 0, checkpoint_id: str | None = None):
        cid = checkpoint_id or f"test-v{version}"
        dst = local_checkpoint_dir(lake, cid) / "hf"
        shutil.copytree(policy_dir, dst)
        publish_checkpoint(lake, checkpoint_id=cid, policy_version=version, parent_checkpoint_id=None,
                           snapshot_ids=[], train_config={"kind": "test"}, train_config_hash="test", seed=0)
        return cid

    return _publish


@pytest.fixture
def killed_then_rerun(lake, policy_dir, tmp_path):
    """Run a rollout script (argv: lake, policy, tool log, kill after N tool calls) in a fresh interpreter
    killed -9 after its 3rd tool call, then again to the end; returns (the tool log, the rerun's stdout)."""
    log = tmp_path / "tool-executions.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def _run(script: str) -> tuple[Path, str]:
        def run(kill: int) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", script, lake.uri, str(policy_dir), str(log), str(kill)],
                                  capture_output=True, text=True, timeout=600, env=env,
                                  cwd=Path(__file__).resolve().parents[2])

        crashed = run(3)
        assert crashed.returncode == -9, crashed.stderr[-2000:]
        assert len(log.read_text().split()) == 3
        restarted = run(0)
        assert restarted.returncode == 0, restarted.stderr[-2000:]
        return log, restarted.stdout

    return _run
