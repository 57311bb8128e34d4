"""Policy resolution: published versions only, hash-verified; plain HF directories."""

from __future__ import annotations

import pytest

from pipeline.errors import NotFoundError
from pipeline.policy_store import resolve_policy


def test_plain_hf_directory_resolves_to_itself(tmp_path, lake):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert resolve_policy(lake, str(tmp_path / "model")).hf_dir == tmp_path / "model"
    (tmp_path / "ckpt" / "hf").mkdir(parents=True)
    (tmp_path / "ckpt" / "hf" / "config.json").write_text("{}")
    assert resolve_policy(lake, str(tmp_path / "ckpt")).hf_dir == tmp_path / "ckpt" / "hf"


def test_empty_lake_has_no_policy(lake):
    with pytest.raises(NotFoundError, match="pipeline policy init"):
        resolve_policy(lake)
