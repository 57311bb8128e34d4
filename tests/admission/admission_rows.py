"""Hand-built trajectories for admission tests: every field explicit, tiny tokens."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow as pa

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def traj(tid: str, gid: str, *, reward: float | None = 1.0, group_size: int = 4, policy_version: int = 5,
         tpv: list[int] | None | str = "auto", tokenizer_rev: str = "tok-1", prompt_template_rev: str = "tmpl-1",
         env_version: str = "env-1", verifier_version: str = "ver-1", temperature: float = 1.0,
         status: str = "ACCEPTED", verdict: str | None = None, components: dict[str, float] | None = None,
         difficulty: str | None = "easy", num_tool_calls: int = 0, queue_wait_ms: int = 10,
         age_s: float = 3600.0, response_len: int = 3, run_id: str = "run-0", task_id: str = "task-0",
         top_p: float = 1.0, task_version: str = "v1", harness_version: str = "h-1",
         tool_schema_version: str | None = None, prompt_ids: list[int] | None = None) -> dict:
    """One trajectories row in the ingest contract (content_hash filled by ``land``)."""
    finished = NOW - timedelta(seconds=age_s)
    mask = [1] * response_len
    if tpv == "auto":
        tpv = [policy_version] * response_len
    if verdict is None:
        verdict = "PASS" if (reward or 0) > 0 else "FAIL"
    return {
        "trajectory_id": tid, "group_id": gid, "group_size": group_size, "task_id": task_id,
        "task_version": task_version, "run_id": run_id, "policy_version": policy_version,
        "token_policy_versions": tpv, "tokenizer_rev": tokenizer_rev, "prompt_template_rev": prompt_template_rev,
        "harness_version": harness_version, "env_version": env_version, "verifier_version": verifier_version,
        "temperature": temperature, "top_p": top_p, "sampling_seed": None, "status": status, "verdict": verdict,
        "stop_reason": "eos", "reward": reward,
        "reward_components": None if components is None else list(components.items()),
        "difficulty": difficulty, "num_turns": 1, "num_tool_calls": num_tool_calls,
        "created_at": finished - timedelta(seconds=5), "finished_at": finished, "queue_wait_ms": queue_wait_ms,
        "prompt_ids": prompt_ids or [1, 2], "response_ids": list(range(3, 3 + response_len)),
        "response_logprobs": [-0.5] * response_len, "loss_mask": mask,
        "tool_schema_version": tool_schema_version,
    }


def to_table(rows: list[dict]) -> pa.Table:
    from pipeline.lake.contenthash import content_hashes
    from pipeline.schema import table_spec

    spec = table_spec("trajectories")
    fields = [c.arrow_field() for c in spec.ingest_columns if c.name != "content_hash"]
    t = pa.Table.from_pylist(rows, schema=pa.schema(fields))
    return t.append_column(spec.column("content_hash").arrow_field(), content_hashes(t))


def land(lake, rows: list[dict], *, ingest_id: str = "ing-test") -> pa.Table:
    """Append rows to trajectories as a writer would (validated contract, derived columns)."""
    from pipeline.lake.ingest import stamp_derived

    t = stamp_derived(to_table(rows), ingest_id)
    lake.append("trajectories", t, command="test")
    return t

