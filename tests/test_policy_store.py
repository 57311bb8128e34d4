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


def test_a_file_changed_after_verification_is_refused_on_the_next_resolve(lake, tmp_path):
    """Resolution is cached per process only while every file is unchanged."""
    import os

    from pipeline.errors import IntegrityError
    from pipeline.policy_store import local_checkpoint_dir, publish_checkpoint

    hf = local_checkpoint_dir(lake, "c0") / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"weights")
    publish_checkpoint(lake, checkpoint_id="c0", policy_version=0, parent_checkpoint_id=None, snapshot_ids=[],
                       train_config={}, train_config_hash="t", seed=0)
    assert resolve_policy(lake).checkpoint_id == "c0"
    (hf / "model.safetensors").write_bytes(b"tampered")
    os.utime(hf / "model.safetensors", ns=(1, 1))
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        resolve_policy(lake)
