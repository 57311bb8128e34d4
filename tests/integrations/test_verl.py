"""A real verl DataProto, in the layout verl's agent loop returns, lands row-exact.

The batch is built the way ``AgentLoopWorker._postprocess`` builds it:
prompts left-padded to prompt_length, responses right-padded to
response_length, ``response_mask`` 0 on tool observations and padding,
``rollout_log_probs`` padded with 0, ``rm_scores`` holding the score on the
last response token, ``uid`` per prompt repeated n times, ``__num_turns__``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

try:
    import torch
    from tensordict import TensorDict
    from verl import DataProto
except ImportError as exc:  # pragma: no cover - depends on the environment
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"verl is not installed in CI ({exc}); scripts/setup-env.sh --test installs it") from exc
    pytest.skip(f"VERL NOT INSTALLED ({exc}): the verl adapter is untested here; "
                f"run `bash scripts/setup-env.sh --test` to install it", allow_module_level=True)

from pipeline.integrations.verl import VerlBatchError, from_dataproto

PROMPT_LEN, RESPONSE_LEN = 8, 12
# (uid, prompt, [(tokens, is_policy)...], log-probs of policy tokens, score)
SAMPLES = [
    ("u-a", [5, 6, 7], [([11, 12], 1), ([90, 91, 92], 0), ([13], 1)], 0.5),
    ("u-a", [5, 6, 7], [([14, 15, 16, 2], 1)], 0.0),
    ("u-b", [8, 9, 10, 11, 12, 13, 14, 15], [([17] * 12, 1)], 1.0),       # fills both limits
    ("u-a", [5, 6, 7], [([18], 1), ([93], 0), ([19, 2], 1)], 1.0),
    ("u-b", [8, 9, 10, 11, 12, 13, 14, 15], [([20, 2], 1)], 0.0),
]


def _lp(j: int) -> float:
    return float(np.float32(-0.1 * (j + 1)))


def _batch(logprob_key="rollout_log_probs", score_key="rm_scores", obs_logprob=0.0):
    B = len(SAMPLES)
    prompts = torch.zeros(B, PROMPT_LEN, dtype=torch.int64)
    responses = torch.zeros(B, RESPONSE_LEN, dtype=torch.int64)
    rmask = torch.zeros(B, RESPONSE_LEN, dtype=torch.int64)
    amask = torch.zeros(B, PROMPT_LEN + RESPONSE_LEN, dtype=torch.int64)
    lps = torch.zeros(B, RESPONSE_LEN, dtype=torch.float32)
    scores = torch.zeros(B, RESPONSE_LEN, dtype=torch.float32)
    for i, (_, prompt, segs, score) in enumerate(SAMPLES):
        prompts[i, PROMPT_LEN - len(prompt):] = torch.tensor(prompt)
        amask[i, PROMPT_LEN - len(prompt):PROMPT_LEN] = 1
        toks = [t for s, _ in segs for t in s]
        pol = [p for s, p in segs for _ in s]
        responses[i, :len(toks)] = torch.tensor(toks)
        rmask[i, :len(toks)] = torch.tensor(pol)
        amask[i, PROMPT_LEN:PROMPT_LEN + len(toks)] = 1
        lps[i, :len(toks)] = torch.tensor([_lp(j) if p else obs_logprob for j, p in enumerate(pol)])
        scores[i, len(toks) - 1] = score
    td = {"prompts": prompts, "responses": responses, "response_mask": rmask, "attention_mask": amask,
          "input_ids": torch.cat([prompts, responses], 1), "position_ids": torch.cumsum(amask, 1),
          logprob_key: lps, score_key: scores}
    nt = {"uid": np.array([s[0] for s in SAMPLES], dtype=object),
          "__num_turns__": np.array([4, 2, 2, 4, 2], dtype=np.int32),
          "acc": np.array([s[3] for s in SAMPLES], dtype=np.float64)}
    return DataProto(batch=TensorDict(td, batch_size=B), non_tensor_batch=nt, meta_info={"reward_extra_keys": ["acc"]})


KW = dict(run_id="verl-run", policy_version=7, tokenizer_rev="qwen-tok", prompt_template_rev="chat-1",
          env_version="sandbox-3", verifier_version="math-2")


def _land(lake, tmp_path, table):
    from pipeline import lake as lake_api

    if hasattr(lake_api, "ingest_table"):
        return lake_api.ingest_table(lake, table, source="verl-test")
    import pyarrow.parquet as pq

    from pipeline.ingest import ingest_files

    path = tmp_path / f"verl-{len(list(tmp_path.iterdir()))}.parquet"
    pq.write_table(table, path)
    return ingest_files(lake, [path])


def test_dataproto_lands_row_exact(lake, tmp_path):
    t = from_dataproto(_batch(), **KW, temperature=0.8, task_version="gsm8k-v1")
    assert t.num_rows == len(SAMPLES)
    rows = t.to_pylist()
    for row, (uid, prompt, segs, score) in zip(rows, SAMPLES):
        toks = [x for s, _ in segs for x in s]
        pol = [p for s, p in segs for _ in s]
        assert row["prompt_ids"] == prompt and row["response_ids"] == toks and row["loss_mask"] == pol
        assert row["response_logprobs"] == [_lp(j) if p else 0.0 for j, p in enumerate(pol)]
        assert row["token_policy_versions"] == [7 if p else -1 for p in pol]
        assert row["group_id"] == uid and row["group_size"] == sum(s[0] == uid for s in SAMPLES)
        assert row["reward"] == score and dict(row["reward_components"]) == {"acc": score}
        assert row["num_tool_calls"] == sum(1 for _, p in segs if not p)
        assert row["num_turns"] == sum(1 for _, p in segs if p)
        assert row["temperature"] == 0.8 and row["task_version"] == "gsm8k-v1"
    assert [r["stop_reason"] for r in rows] == ["eos", "eos", "max_length", "eos", "eos"]
    assert [r["trajectory_id"] for r in rows][:2] == ["verl-run:u-a:0", "verl-run:u-a:1"]
    r = _land(lake, tmp_path, t)
    assert (r.landed, r.quarantined) == (len(SAMPLES), 0)
    landed = lake.read("trajectories").sort_by("trajectory_id")
    want = t.sort_by("trajectory_id")
    for name in ("prompt_ids", "response_ids", "response_logprobs", "loss_mask", "reward", "group_size"):
        assert landed.column(name).to_pylist() == want.column(name).to_pylist(), name
    again = _land(lake, tmp_path, from_dataproto(_batch(), **KW, temperature=0.8, task_version="gsm8k-v1",
                                                 created_at=landed.column("created_at").to_pylist()[0],
                                                 finished_at=landed.column("finished_at").to_pylist()[0]))
    assert again.landed == 0  # same ids, same content (timestamps pinned): a no-op


def test_old_log_probs_and_token_level_scores(lake, tmp_path):
    """Without rollout_log_probs the actor's old_log_probs are used; they are
    non-zero on observation tokens in verl, and zeroed here (the contract)."""
    t = from_dataproto(_batch("old_log_probs", "token_level_scores", obs_logprob=-3.0), **KW)
    row = t.to_pylist()[0]
    assert row["response_logprobs"] == [_lp(0), _lp(1), 0.0, 0.0, 0.0, _lp(5)]
    assert _land(lake, tmp_path, t).landed == len(SAMPLES)


def test_bad_layouts_are_clear_errors():
    b = _batch()
    b.batch["response_mask"][0, RESPONSE_LEN - 1] = 1  # 1 on padding
    with pytest.raises(VerlBatchError, match="response_mask is 1 on padding"):
        from_dataproto(b, **KW)
    b = _batch()
    b.batch["attention_mask"][1, 0] = 1  # a hole in the left padding
    with pytest.raises(VerlBatchError, match="not one contiguous left-padded run"):
        from_dataproto(b, **KW)
    b = _batch()
    del b.non_tensor_batch["uid"]
    with pytest.raises(VerlBatchError, match="uid"):
        from_dataproto(b, **KW)


@pytest.mark.parametrize("damage, match", [
    ("float-mask", r"sample 0: response_mask\[0, 1\] is 0.5"),
    ("mask-256", r"sample 2: response_mask\[2, 3\] is 256"),
    ("attention-2", r"sample 1: attention_mask\[1, 7\] is 2"),
    ("id-above-int32", r"sample 1: responses holds token id 2147483648"),
    ("negative-id", r"sample 0: prompts holds token id -100"),
    ("float-ids", r"sample 0: responses has dtype float32"),
    ("uid-none", r"sample 3: uid is None"),
    ("uid-empty", r"sample 4: uid is ''"),
    ("logprobs-short", r"rollout_log_probs has shape \(5, 11\)"),
    ("scores-short", r"rm_scores has shape \(5, 11\)"),
    ("non-tensor-short", r"non_tensor_batch\['acc'\] has 4 entries for 5 samples"),
])
def test_malformed_batches_name_the_sample_and_field(damage, match):
    """Each of these landed wrong rows (or raised a numpy error) before: a float
    mask cast 0.5 to 0, 256 wrapped to 0 in int8, ids above int32 wrapped."""
    b = _batch()
    td, nt = b.batch, b.non_tensor_batch
    if damage == "float-mask":
        td["response_mask"] = td["response_mask"].to(torch.float32)
        td["response_mask"][0, 1] = 0.5
    elif damage == "mask-256":
        td["response_mask"][2, 3] = 256
    elif damage == "attention-2":
        td["attention_mask"][1, 7] = 2
    elif damage == "id-above-int32":
        td["responses"][1, 0] = 2**31
    elif damage == "negative-id":
        td["prompts"][0, PROMPT_LEN - 1] = -100
    elif damage == "float-ids":
        td["responses"] = td["responses"].to(torch.float32)
    elif damage == "uid-none":
        nt["uid"][3] = None
    elif damage == "uid-empty":
        nt["uid"][4] = ""
    elif damage in ("logprobs-short", "scores-short"):
        key = "rollout_log_probs" if damage == "logprobs-short" else "rm_scores"
        td[key] = td[key][:, :-1].clone()             # one token short
    elif damage == "non-tensor-short":
        nt["acc"] = nt["acc"][:4]
    with pytest.raises(VerlBatchError, match=match):
        from_dataproto(b, **KW)

