"""Synthetic trajectories in the ingest contract, for tests, benchmarks and the
simulator. Deterministic for a seed. Token arrays are realistic in shape:
response lengths lognormal (median ``median_len``, capped at ``max_len``),
alternating policy-sampled and observation segments for multi-turn rows.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa

from pipeline.schema import table_spec


def response_lengths(rng: np.random.Generator, n: int, *, median_len: int = 1000, sigma: float = 1.0,
                     max_len: int = 16384, min_len: int = 4) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median_len), sigma, n)), min_len, max_len).astype(np.int64)


def make_trajectories(n: int, *, seed: int = 0, group_size: int = 4, run_id: str = "run-0",
                      policy_version: int = 0, median_len: int = 64, sigma: float = 0.5, max_len: int = 16384,
                      prompt_len: int = 16, id_prefix: str = "t", multi_turn: bool = True,
                      start: datetime | None = None, with_hash: bool = True,
                      reward_p: float = 0.5) -> pa.Table:
    """``n`` trajectories in ``n // group_size`` (+1) groups, ingest schema."""
    rng = np.random.default_rng(seed)
    start = start or datetime(2026, 11, 1, tzinfo=timezone.utc)
    lens = response_lengths(rng, n, median_len=median_len, sigma=sigma, max_len=max_len)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    resp = rng.integers(3, 30000, total, dtype=np.int32)
    mask = np.ones(total, np.int8)
    if multi_turn:
        # an observation segment (mask 0) in the middle of each row longer than 8 tokens
        starts = offsets[:-1] + lens // 3
        seg = np.minimum(lens // 4, 64)
        for s, k in zip(starts[lens > 8], seg[lens > 8]):
            mask[s:s + k] = 0
    logp = np.where(mask == 1, -rng.exponential(1.0, total).astype(np.float32), np.float32(0.0)).astype(np.float32)
    tpv = np.where(mask == 1, policy_version, -1).astype(np.int32)
    prompt = rng.integers(3, 30000, n * prompt_len, dtype=np.int32)
    # a GRPO group samples one prompt G times: every member carries its group's first member's prompt
    first = (np.arange(n) // max(group_size, 1)) * max(group_size, 1)
    prompt = prompt.reshape(n, prompt_len)[first].ravel()
    poff = np.arange(0, (n + 1) * prompt_len, prompt_len, dtype=np.int32)

    def lst(values, offs=offsets):
        if total >= 2**31:
            return pa.LargeListArray.from_arrays(pa.array(offs), pa.array(values)).cast(pa.list_(pa.array(values).type))
        return pa.ListArray.from_arrays(pa.array(offs.astype(np.int32)), pa.array(values))

    group_idx = np.arange(n) // max(group_size, 1)
    reward = (rng.random(n) < reward_p).astype(np.float64)
    created = [start + timedelta(seconds=int(i)) for i in range(n)]
    finished = [c + timedelta(seconds=int(rng.integers(1, 120))) for c in created]
    comps = [[("task_success", float(r)), ("format", 1.0), ("tool_cost", -0.01)] for r in reward]
    cols = {
        "trajectory_id": pa.array([f"{id_prefix}{seed}-{i}" for i in range(n)]),
        "group_id": pa.array([f"{id_prefix}{seed}-g{g}" for g in group_idx]),
        "group_size": pa.array(np.full(n, group_size, np.int32)),
        "task_id": pa.array([f"task-{g % 50}" for g in group_idx]),
        "task_version": pa.array(["v1"] * n),
        "run_id": pa.array([run_id] * n),
        "policy_version": pa.array(np.full(n, policy_version, np.int64)),
        "token_policy_versions": lst(tpv),
        "tokenizer_rev": pa.array(["tok-1"] * n),
        "prompt_template_rev": pa.array(["tmpl-1"] * n),
        "harness_version": pa.array(["h-1"] * n),
        "env_version": pa.array(["env-1"] * n),
        "verifier_version": pa.array(["ver-1"] * n),
        "temperature": pa.array(np.full(n, 1.0)),
        "top_p": pa.array(np.full(n, 1.0)),
        "sampling_seed": pa.array(np.arange(n, dtype=np.int64)),
        "status": pa.array(["ACCEPTED"] * n),
        "verdict": pa.array(np.where(reward > 0, "PASS", "FAIL")),
        "stop_reason": pa.array(["eos"] * n),
        "reward": pa.array(reward),
        "reward_components": pa.array(comps, pa.map_(pa.string(), pa.float64())),
        "difficulty": pa.array(np.where(lens > median_len, "hard", "easy")),
        "num_turns": pa.array(np.where(lens > 8, 2, 1).astype(np.int32)),
        "num_tool_calls": pa.array(np.where(lens > 8, 1, 0).astype(np.int32)),
        "created_at": pa.array(created, pa.timestamp("us", tz="UTC")),
        "finished_at": pa.array(finished, pa.timestamp("us", tz="UTC")),
        "queue_wait_ms": pa.array(rng.integers(0, 5000, n, dtype=np.int64)),
        "prompt_ids": pa.ListArray.from_arrays(pa.array(poff), pa.array(prompt)),
        "response_ids": lst(resp),
        "response_logprobs": lst(logp),
        "loss_mask": lst(mask),
        "tool_schema_version": pa.nulls(n, pa.string()),
        "turn_rewards": pa.nulls(n, pa.list_(pa.float64())),
        "verifier_confidence": pa.nulls(n, pa.float64()),
        "verifier_evidence": pa.nulls(n, pa.string()),
        "env_state_hash": pa.nulls(n, pa.string()),
    }
    spec = table_spec("trajectories")
    fields = [c.arrow_field() for c in spec.ingest_columns if c.name != "content_hash"]
    t = pa.table(cols, schema=pa.schema(fields))
    hashes = pa.nulls(n, pa.string())
    if with_hash:
        from pipeline.lake.contenthash import content_hashes

        hashes = content_hashes(t)
    t = t.append_column(spec.column("content_hash").arrow_field().with_nullable(not with_hash), hashes)
    return t.select([c.name for c in spec.ingest_columns])
