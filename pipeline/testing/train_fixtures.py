"""Tiny policies and synthetic snapshots for the trainer's tests and benchmarks.

``publish_tiny_policy`` saves a random tiny Llama (+ a word-level tokenizer)
as a published policy version; ``publish_synthetic_snapshot`` writes a
snapshot in the admission format (pipeline.snapshots) from
``pipeline.testing.trajectories.make_trajectories``, token ids folded into the model's
vocabulary and GRPO advantages per group.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

TINY = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512}


def tiny_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


# the tokenizer_rev pipeline.testing.trajectories's trajectories declare: the tiny policy is the model they are made for
SYNTH_TOKENIZER_REV = "tok-1"


def publish_tiny_policy(lake: Lake, *, checkpoint_id: str = "tiny-v0", seed: int = 0,
                        tokenizer_rev: str = SYNTH_TOKENIZER_REV, parent: str | None = None, **arch: Any):
    """Build, save and publish a tiny random Llama as policy version 0 (or next), recorded as
    sampling with ``tokenizer_rev``. ``parent``: the checkpoint id it descends from (a newer
    version of that line: the trainer accepts data its ancestors sampled); None starts a line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.policy_store import (HF_SUBDIR, local_checkpoint_dir, next_policy_version, publish_checkpoint,
                                       resolve_policy)

    spec = TINY | arch
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**spec, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                         pad_token_id=0))
    out = local_checkpoint_dir(lake, checkpoint_id) / HF_SUBDIR
    model.save_pretrained(str(out))
    tiny_tokenizer(spec["vocab_size"]).save_pretrained(str(out))
    publish_checkpoint(lake, checkpoint_id=checkpoint_id, policy_version=next_policy_version(lake),
                       parent_checkpoint_id=parent, snapshot_ids=[], train_config={"kind": "tiny", **spec, "tokenizer_rev": tokenizer_rev},
                       train_config_hash="tiny", seed=seed, command="test fixture")
    return resolve_policy(lake, checkpoint_id)


def grpo_advantages(group_ids: list[str], rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    adv = np.zeros(len(rewards))
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    for idx in groups.values():
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std() + eps)
    return adv


def _fold(col: pa.ChunkedArray, vocab: int) -> pa.Array:
    arr = col.combine_chunks()
    vals = arr.values.to_numpy() % (vocab - 3) + 3
    return pa.ListArray.from_arrays(arr.offsets, pa.array(vals.astype(np.int32)))


def synthetic_payload(n: int, *, seed: int = 0, vocab_size: int = 256, group_size: int = 4, median_len: int = 24,
                      prompt_len: int = 8, max_len: int = 200, sigma: float = 0.5, policy_version: int = 0,
                      snapshot_id: str = "") -> pa.Table:
    """Trajectories (ingest contract) turned into snapshot payload rows."""
    from pipeline.lake.contenthash import content_hashes
    from pipeline.testing.trajectories import make_trajectories

    t = make_trajectories(n, seed=seed, group_size=group_size, median_len=median_len, prompt_len=prompt_len,
                          max_len=max_len, sigma=sigma, policy_version=policy_version)
    t = t.set_column(t.schema.get_field_index("prompt_ids"), "prompt_ids", _fold(t.column("prompt_ids"), vocab_size))
    t = t.set_column(t.schema.get_field_index("response_ids"), "response_ids", _fold(t.column("response_ids"), vocab_size))
    t = t.set_column(t.schema.get_field_index("content_hash"), "content_hash", content_hashes(t.drop(["content_hash"])))
    rewards = t.column("reward").to_numpy()
    gids = t.column("group_id").to_pylist()
    return pa.table({
        "snapshot_id": pa.array([snapshot_id] * t.num_rows),
        "trajectory_id": t.column("trajectory_id"), "group_id": t.column("group_id"),
        "content_hash": t.column("content_hash"),
        "advantage": pa.array(grpo_advantages(gids, rewards)), "reward": t.column("reward"),
        "policy_lag": pa.array(np.zeros(t.num_rows, np.int64)), "difficulty": t.column("difficulty"),
        "length_bucket": pa.nulls(t.num_rows, pa.string()), "tool_call_bucket": pa.nulls(t.num_rows, pa.string()),
        "reward_std_bucket": pa.nulls(t.num_rows, pa.string()), "run_id": t.column("run_id"),
        "task_id": t.column("task_id"), "group_size": t.column("group_size"),
        "policy_version": t.column("policy_version"), "token_policy_versions": t.column("token_policy_versions"),
        "prompt_ids": t.column("prompt_ids"), "response_ids": t.column("response_ids"),
        "response_logprobs": t.column("response_logprobs"), "loss_mask": t.column("loss_mask"),
        "num_turns": t.column("num_turns"), "num_tool_calls": t.column("num_tool_calls"),
    })


def publish_payload_snapshot(lake: Lake, payload: pa.Table, *, config_hash: str = "test-admission",
                             estimator: str = "grpo", current_policy_version: int = 0) -> str:
    """Write ``payload`` as a snapshot (files + snapshots row); returns its id."""
    from pipeline.snapshots.format import compute_snapshot_id
    from pipeline.snapshots.publish import write_snapshot_files
    from pipeline.schema import arrow_schema

    sid = compute_snapshot_id(zip(payload.column("trajectory_id").to_pylist(),
                                  payload.column("content_hash").to_pylist()), config_hash, estimator)
    payload = payload.set_column(0, "snapshot_id", pa.array([sid] * payload.num_rows))
    snap = write_snapshot_files(lake, payload, snapshot_id=sid,
                                manifest_extra={"config_hash": config_hash, "advantage_estimator": estimator})
    tokens = int(pc.sum(pc.list_value_length(payload.column("response_ids"))).as_py() or 0)
    row = {"snapshot_id": sid, "admission_run_id": "fixture", "config_hash": config_hash, "config_json": "{}",
           "advantage_estimator": estimator, "current_policy_version": current_policy_version,
           "num_groups": len(set(payload.column("group_id").to_pylist())), "num_members": payload.num_rows,
           "num_tokens": tokens, "path": snap.path, "manifest_sha256": snap.manifest_sha256,
           "source_versions": [], "quality_json": None, "created_at": datetime.now(timezone.utc)}
    lake.append("snapshots", pa.Table.from_pylist([row], schema=arrow_schema("snapshots")), command="test fixture",
                app_id=f"snapshot:{sid}", txn_version=0)
    return sid


def publish_synthetic_snapshot(lake: Lake, n: int = 32, **kw: Any) -> str:
    return publish_payload_snapshot(lake, synthetic_payload(n, **kw))
