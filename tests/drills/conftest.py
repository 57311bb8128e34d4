"""Fixtures shared by the drills."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def policy_lake(tmp_path_factory):
    """A lake with policy version 0: a short warm start that mostly demonstrates
    the calculator, so the policy calls the tool (built once per session)."""
    from pipeline.lake.delta import Lake
    from pipeline.rollout.policy import init_policy

    lake = Lake(tmp_path_factory.mktemp("drill-policy") / "lake")
    init_policy(lake, warm_start_steps=60, demonstrations=600, batch_size=32, tool_fraction=0.95)
    return lake
