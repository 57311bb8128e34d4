"""A template lake (tiny published policy + one synthetic snapshot) built once, copied per test."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def template_lake(tmp_path_factory):
    from pipeline.lake.delta import Lake
    from pipeline.testing.train_fixtures import publish_synthetic_snapshot, publish_tiny_policy

    root = tmp_path_factory.mktemp("train-template") / "lake"
    lake = Lake(root)
    publish_tiny_policy(lake, checkpoint_id="tiny-v0")
    sid = publish_synthetic_snapshot(lake, 48, seed=7, median_len=20, prompt_len=6)
    return root, sid


@pytest.fixture
def tlake(template_lake, tmp_path):
    """(Lake, snapshot_id): a fresh copy of the template."""
    from pipeline.lake.delta import Lake

    src, sid = template_lake
    dst = tmp_path / "lake"
    shutil.copytree(src, dst)
    return Lake(dst), sid


@pytest.fixture
def tlake2(template_lake, tmp_path):
    """A second, independent copy (to compare two runs)."""
    from pipeline.lake.delta import Lake

    src, sid = template_lake
    dst = tmp_path / "lake2"
    shutil.copytree(src, dst)
    return Lake(dst), sid
