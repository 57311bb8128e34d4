"""verl ``DataProto`` -> rows of the ingest contract (``pip install .[verl]``).

A batch as verl's agent loop returns it (``AgentLoopManager.generate_sequences``,
then the trainer's reward / log-prob steps) holds, per sample ``i``:

- ``prompts [B, P]``: the prompt, LEFT-padded; ``attention_mask[:, :P]`` is 1 on
  its tokens;
- ``responses [B, R]``: model tokens and tool-observation tokens, RIGHT-padded;
  ``attention_mask[:, P:]`` is 1 on them;
- ``response_mask [B, R]``: 1 on tokens the policy sampled, 0 on observation
  and padding tokens;
- ``rollout_log_probs [B, R]`` (the inference engine's log-probs) or, without
  them, ``old_log_probs`` (recomputed by the actor);
- ``rm_scores`` or ``token_level_scores [B, R]``: the reward, placed on the last
  response token (the sequence reward is the sum over the response);
- ``non_tensor_batch["uid"]``: one id per prompt, shared by its n samples (the
  GRPO group); ``"__num_turns__"``: chat messages of the sample.

``from_dataproto`` removes the padding exactly (a mask that is not one
contiguous run, or a response_mask that is 1 on padding, is an error, never
guessed around) and returns a ``pyarrow.Table`` for ``ingest_table``. It
validates like the file path: masks hold only 0 and 1, token ids are integers
in 0..2^31-1 (the contract's int32), every sample has a uid, and the per-token
tensors are [B, R]; anything else is one ``VerlBatchError`` naming the sample
and the field, never a cast that silently changes a value.
Derived columns: ``group_size`` = samples per uid in the batch;
``loss_mask`` = the unpadded ``response_mask``; ``response_logprobs`` = the
log-probs with exact 0.0 where the mask is 0 (the contract's rule);
``token_policy_versions`` = ``policy_version`` on policy tokens, -1 on
observations; ``num_turns`` = policy segments of the response (verl's
``__num_turns__`` counts chat messages: user, assistant and tool, +1, not model
turns); ``num_tool_calls`` = observation segments; ``stop_reason`` =
``max_length`` when the response fills R, else ``eos``; ``verdict`` = PASS when
reward > 0 else FAIL; ``reward_components`` = the numeric
``meta_info["reward_extra_keys"]`` columns; ``trajectory_id`` =
``{run_id}:{uid}:{k}`` (k-th sample of the uid), so landing the same batch
twice is a no-op. Any contract column can be set through ``defaults`` as one
value for all rows or a sequence of B values (e.g. ``task_id``,
``temperature``, ``created_at``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.errors import PipelineError
from pipeline.schema import table_spec


class VerlBatchError(PipelineError):
    """A DataProto that does not have the layout of verl's agent-loop output."""


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy() if hasattr(t, "detach") else np.asarray(t)


def _run(mask_row: np.ndarray, where: str, *, side: str, i: int) -> int:
    """Length of the single contiguous run of 1s, which must touch ``side``."""
    n = int(mask_row.sum())
    ok = mask_row[-n:].all() if side == "right" else mask_row[:n].all()
    if n and not ok:
        raise VerlBatchError(f"sample {i}: {where} is not one contiguous {'left' if side == 'right' else 'right'}-"
                             f"padded run", hint="pass the DataProto verl's agent loop returns, unmodified")
    return n


TOKEN_ID_MAX = 2**31 - 1   # the contract stores token ids as int32 (schemas/trajectories.yaml)


def _check_binary(name: str, a: np.ndarray) -> np.ndarray:
    """``a`` as int64 if every value is exactly 0 or 1; else an error naming the first bad sample."""
    if a.dtype == bool:
        return a.astype(np.int64)
    bad = ~((a == 0) | (a == 1))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise VerlBatchError(f"sample {i}: {name}[{i}, {j}] is {a[i, j].item()!r}; a mask holds only 0 and 1",
                             hint=f"pass verl's {name} unmodified (0/1 integers or booleans)")
    return a.astype(np.int64)


def _check_ids(name: str, i: int, ids: np.ndarray) -> np.ndarray:
    """The unpadded token ids of sample ``i`` as int32, or an error naming the sample and field."""
    if not (np.issubdtype(ids.dtype, np.integer) or ids.dtype == bool):
        raise VerlBatchError(f"sample {i}: {name} has dtype {ids.dtype}; token ids are integers",
                             hint=f"pass verl's {name} tensor unmodified (int64 token ids)")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > TOKEN_ID_MAX):
        bad = ids[(ids < 0) | (ids > TOKEN_ID_MAX)][0]
        raise VerlBatchError(f"sample {i}: {name} holds token id {int(bad)}, outside 0..{TOKEN_ID_MAX} (int32)",
                             hint="token ids are a vocabulary index; check the tokenizer and the padding")
    return ids.astype(np.int32)


def _segments(mask: np.ndarray, value: int) -> int:
    """Number of maximal runs of ``value`` in a 0/1 vector."""
    hit = mask == value
    return int(hit[0]) + int(np.count_nonzero(hit[1:] & ~hit[:-1])) if len(hit) else 0


def from_dataproto(batch, *, run_id: str, policy_version: int, tokenizer_rev: str, prompt_template_rev: str,
                   env_version: str, verifier_version: str, **defaults: Any) -> pa.Table:
    """Rows of the ingest contract (schemas/trajectories.yaml) from a verl DataProto."""
    b = _checked(batch)
    now = datetime.now(timezone.utc)
    cols = _columns(b, run_id=run_id, policy_version=policy_version)
    fixed = {
        "task_version": "unversioned", "run_id": run_id, "policy_version": policy_version,
        "tokenizer_rev": tokenizer_rev, "prompt_template_rev": prompt_template_rev,
        "harness_version": _harness_version(), "env_version": env_version, "verifier_version": verifier_version,
        "temperature": 1.0, "top_p": 1.0, "sampling_seed": None, "status": "ACCEPTED", "difficulty": None,
        "tool_schema_version": None, "env_state_hash": None,
        "turn_rewards": None, "verifier_confidence": None, "verifier_evidence": None,
        "created_at": now, "finished_at": now, "queue_wait_ms": 0,
    }
    return _table(cols, fixed, defaults, len(b.uids))


@dataclass(frozen=True, kw_only=True)
class _Batch:
    """A DataProto's tensors as numpy, checked: B samples of P prompt and R response positions."""

    prompts: np.ndarray           # [B, P], left-padded
    responses: np.ndarray         # [B, R], right-padded
    rmask: np.ndarray             # response_mask [B, R], 0/1
    amask: np.ndarray             # attention_mask [B, P + R], 0/1
    logprobs: np.ndarray          # [B, R] float32
    scores: np.ndarray | None     # [B, R] float64, or None (no reward)
    nt: dict[str, Any]            # non_tensor_batch
    uids: list[str]               # the GRPO group of each sample
    extra_keys: list[str]         # reward components named by meta_info['reward_extra_keys']


def _checked(batch) -> _Batch:
    """The tensors from_dataproto reads, or a VerlBatchError naming the first thing missing or malformed."""
    td, nt = batch.batch, dict(batch.non_tensor_batch or {})
    keys = set(td.keys())
    for need in ("prompts", "responses", "response_mask", "attention_mask"):
        if need not in keys:
            raise VerlBatchError(f"the DataProto has no {need!r} tensor (it has {sorted(keys)})",
                                 hint="pass the batch after generate_sequences (verl's agent loop output)")
    if "uid" not in nt:
        raise VerlBatchError("non_tensor_batch has no 'uid' (the GRPO group of each sample)",
                             hint="verl's trainer sets batch.non_tensor_batch['uid'] before repeating prompts n times")
    prompts, responses = _np(td["prompts"]), _np(td["responses"])
    if prompts.ndim != 2 or responses.ndim != 2 or len(responses) != len(prompts):
        raise VerlBatchError(f"prompts {prompts.shape} and responses {responses.shape} must be [B, P] and [B, R]")
    B, P = prompts.shape
    R = responses.shape[1]
    rmask, amask = _np(td["response_mask"]), _np(td["attention_mask"])
    if amask.shape != (B, P + R) or rmask.shape != (B, R):
        raise VerlBatchError(f"attention_mask {amask.shape} / response_mask {rmask.shape} do not match prompts "
                             f"{prompts.shape} + responses {responses.shape}")
    rmask, amask = _check_binary("response_mask", rmask), _check_binary("attention_mask", amask)
    lp_key = "rollout_log_probs" if "rollout_log_probs" in keys else "old_log_probs" if "old_log_probs" in keys else None
    if lp_key is None:
        raise VerlBatchError("the DataProto has neither rollout_log_probs nor old_log_probs",
                             hint="enable actor_rollout_ref.rollout.calculate_log_probs=True, or land the batch after "
                                  "the trainer computed old_log_probs")
    logprobs = _np(td[lp_key]).astype(np.float32)
    score_key = "rm_scores" if "rm_scores" in keys else "token_level_scores" if "token_level_scores" in keys else None
    scores = _np(td[score_key]).astype(np.float64) if score_key else None
    for name, arr in ((lp_key, logprobs), (score_key, scores)):
        if arr is not None and arr.shape != (B, R):
            raise VerlBatchError(f"{name} has shape {tuple(arr.shape)}, responses {(B, R)}: one value per response "
                                 "token is needed", hint=f"pass the {name} computed for these responses")
    for name, vals in nt.items():
        if hasattr(vals, "__len__") and len(vals) != B:
            raise VerlBatchError(f"non_tensor_batch[{name!r}] has {len(vals)} entries for {B} samples")
    uids = []
    for i, u in enumerate(nt["uid"]):
        if u is None or (isinstance(u, float) and not np.isfinite(u)) or str(u).strip() == "":
            raise VerlBatchError(f"sample {i}: uid is {u!r}; every sample needs the uid of its prompt (its group)",
                                 hint="verl's trainer sets non_tensor_batch['uid'] before repeating prompts n times")
        uids.append(str(u))
    extra_keys = [k for k in (getattr(batch, "meta_info", None) or {}).get("reward_extra_keys", []) if k in nt]
    return _Batch(prompts=prompts, responses=responses, rmask=rmask, amask=amask, logprobs=logprobs, scores=scores,
                  nt=nt, uids=uids, extra_keys=extra_keys)


def _columns(b: _Batch, *, run_id: str, policy_version: int) -> dict[str, list]:
    """The per-sample columns, one value per sample."""
    prompts, responses, rmask, amask = b.prompts, b.responses, b.rmask, b.amask
    logprobs, scores, nt, uids, extra_keys = b.logprobs, b.scores, b.nt, b.uids, b.extra_keys
    B, P = prompts.shape
    R = responses.shape[1]
    counts: dict[str, int] = {}
    for u in uids:
        counts[u] = counts.get(u, 0) + 1
    seen: dict[str, int] = {}
    cols: dict[str, list] = {c: [] for c in (
        "trajectory_id", "group_id", "group_size", "task_id", "prompt_ids", "response_ids", "response_logprobs",
        "loss_mask", "token_policy_versions", "reward", "reward_components", "num_turns", "num_tool_calls",
        "stop_reason", "verdict")}
    for i in range(B):
        p_len = _run(amask[i, :P], "the prompt's attention_mask", side="right", i=i)
        r_len = _run(amask[i, P:], "the response's attention_mask", side="left", i=i)
        if rmask[i, r_len:].any():
            raise VerlBatchError(f"sample {i}: response_mask is 1 on padding (after {r_len} response tokens)")
        mask = rmask[i, :r_len].astype(np.int8)   # 0/1, checked above
        lp = np.where(mask == 1, logprobs[i, :r_len], np.float32(0.0)).astype(np.float32)
        k = seen.get(uids[i], 0)
        seen[uids[i]] = k + 1
        cols["trajectory_id"].append(f"{run_id}:{uids[i]}:{k}")
        cols["group_id"].append(uids[i])
        cols["group_size"].append(counts[uids[i]])
        task = uids[i]
        if "index" in nt:
            task = f"{nt['data_source'][i]}:{nt['index'][i]}" if "data_source" in nt else str(nt["index"][i])
        cols["task_id"].append(task)
        cols["prompt_ids"].append(_check_ids("prompts", i, prompts[i, P - p_len:]))
        cols["response_ids"].append(_check_ids("responses", i, responses[i, :r_len]))
        cols["response_logprobs"].append(lp)
        cols["loss_mask"].append(mask)
        cols["token_policy_versions"].append(np.where(mask == 1, policy_version, -1).astype(np.int32))
        reward = float(scores[i, :r_len].sum()) if scores is not None else None
        cols["reward"].append(reward)
        comps = []
        for key in extra_keys:
            v = nt[key][i]
            if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and np.isfinite(v):
                comps.append((key, float(v)))
        cols["reward_components"].append(comps or None)
        cols["num_turns"].append(max(1, _segments(mask, 1)))
        cols["num_tool_calls"].append(_segments(mask, 0))
        cols["stop_reason"].append("max_length" if r_len == R else "eos")
        cols["verdict"].append("UNKNOWN" if reward is None else "PASS" if reward > 0 else "FAIL")
    return cols


def _table(cols: dict[str, list], fixed: dict[str, Any], defaults: dict[str, Any], B: int) -> pa.Table:
    """The contract's ingest columns: ``defaults`` (a value or one per sample) over ``cols`` over ``fixed``."""
    spec = table_spec("trajectories")
    unknown = set(defaults) - {c.name for c in spec.ingest_columns}
    if unknown:
        raise VerlBatchError(f"unknown default(s) {sorted(unknown)}; defaults set columns of the trajectories "
                             "contract (see docs/how-to/land-rollouts.md, Ingest contract)")
    arrays = {}
    for c in spec.ingest_columns:
        if c.name == "content_hash":
            continue
        if c.name in defaults:
            v = defaults[c.name]
            vals = list(v) if isinstance(v, Sequence) and not isinstance(v, str) and not c.is_list else [v] * B
            if len(vals) != B:
                raise VerlBatchError(f"default {c.name} has {len(vals)} values for {B} samples")
        elif c.name in cols:
            vals = cols[c.name]
        else:
            vals = [fixed[c.name]] * B
        arrays[c.name] = pa.array(vals, c.arrow_type)
    return pa.table(arrays, schema=pa.schema([c.arrow_field().with_nullable(True) for c in spec.ingest_columns
                                              if c.name != "content_hash"]))


def _harness_version() -> str:
    try:
        from importlib.metadata import version

        return f"verl-{version('verl')}"
    except Exception:  # noqa: BLE001 - verl's metadata is optional here
        return "verl"
