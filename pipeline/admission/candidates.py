"""Candidate members: the scalar view of trajectories that admission decides on.

Decisions never touch token payload. The two per-token facts they need were
reduced to scalars once, when the row landed (pipeline/landing/ingest.py
``stamp_derived``): ``oldest_version`` = min over the response tokens'
sampling versions that are >= 0 (observation tokens carry -1), falling back to
``policy_version`` when there is none; ``response_len`` = number of response
tokens; ``prompt_hash`` = the prompt's identity. Unrecorded
``tool_schema_version`` and ``prompt_hash`` (null) become "" here, once, for
every engine. Reward components the config gates or caps on become plain
``comp_<name>`` columns, and ``reward`` is the capped reward, shaped by the
run's truncation policy (truncation.py: soft_penalty).

``extract`` is the pure core (Arrow in, Arrow out), shared by the DuckDB and
the Dask engines; ``scan`` is the pyarrow reader over a Delta version.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.admission.config import AdmissionConfig
from pipeline.admission.rules import NULLABLE_KEYS

# scalar trajectory columns the decisions read
SCALARS = (
    "trajectory_id", "group_id", "group_size", "task_id", "run_id", "policy_version",
    "tokenizer_rev", "prompt_template_rev", "env_version", "verifier_version", "temperature",
    "status", "verdict", "reward", "difficulty", "num_tool_calls", "finished_at", "queue_wait_ms",
    "content_hash", "stop_reason", "top_p", "task_version", "harness_version", "tool_schema_version",
    "env_state_hash",
)
DERIVED = ("oldest_version", "response_len", "prompt_hash", "max_token_id")  # stored per row at landing


def source_columns(cfg: AdmissionConfig) -> list[str]:
    cols = list(SCALARS) + list(DERIVED)
    if cfg.components:
        cols.append("reward_components")
    return cols


def candidate_schema(cfg: AdmissionConfig) -> pa.Schema:
    from pipeline.schema import table_spec

    spec = table_spec("trajectories")
    fields = [spec.column(c).arrow_field() for c in SCALARS]
    fields.insert(SCALARS.index("policy_version") + 1, pa.field("oldest_version", pa.int64(), False))
    fields.append(pa.field("response_len", pa.int64(), False))
    fields.append(pa.field("prompt_hash", pa.string(), False))
    fields.append(pa.field("max_token_id", pa.int64()))      # null: landed before it was recorded
    for name in ("tool_schema_version", "env_state_hash"):
        i = [f.name for f in fields].index(name)
        fields[i] = fields[i].with_nullable(False)
    fields += [pa.field(f"comp_{c}", pa.float64()) for c in cfg.components]
    return pa.schema(fields)


def _component(maps: pa.Array, name: str) -> pa.Array:
    """Value of key ``name`` in each map (null when absent or the map is null)."""
    maps = maps.combine_chunks() if isinstance(maps, pa.ChunkedArray) else maps
    out = [None] * len(maps)
    for i, m in enumerate(maps.to_pylist()):
        if m:
            for k, v in m:
                if k == name:
                    out[i] = v
    return pa.array(out, pa.float64())


def extract(batch: pa.Table | pa.RecordBatch, cfg: AdmissionConfig,
            decided: pa.Array | None = None) -> pa.Table:
    """Raw trajectory rows (``source_columns``) -> candidate rows (``candidate_schema``).

    Rows of groups in ``decided`` (already-receipted group ids) are dropped."""
    t = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
    if decided is not None and len(decided) and t.num_rows:
        t = t.filter(pc.invert(pc.is_in(t.column("group_id"), value_set=decided)))
    schema = candidate_schema(cfg)
    if t.num_rows == 0:
        return schema.empty_table()
    cols = {c: t.column(c) for c in SCALARS}
    cols["oldest_version"] = t.column("oldest_version")
    cols["response_len"] = pc.cast(t.column("response_len"), pa.int64())
    cols["prompt_hash"] = t.column("prompt_hash")
    cols["max_token_id"] = (pc.cast(t.column("max_token_id"), pa.int64()) if "max_token_id" in t.column_names
                            else pa.nulls(t.num_rows, pa.int64()))
    if "env_state_hash" not in t.column_names:     # a table landed before the column existed
        cols["env_state_hash"] = pa.nulls(t.num_rows, pa.string())
    for name in NULLABLE_KEYS:
        cols[name] = pc.cast(cols[name], pa.string()).fill_null("")
    reward = t.column("reward")
    for name in cfg.components:
        comp = _component(t.column("reward_components"), name)
        cols[f"comp_{name}"] = comp
        if name in cfg.component_caps:
            excess = pc.max_element_wise(pc.subtract(comp.fill_null(0.0), cfg.component_caps[name]), 0.0)
            reward = pc.subtract(reward, excess)
    from pipeline.admission.truncation import shaped_reward

    cols["reward"] = shaped_reward(reward, cols["response_len"], cfg)   # the run's truncation policy
    return pa.table({f.name: cols[f.name] for f in schema}, schema=schema)


def scan(dataset, cfg: AdmissionConfig, decided: pa.Array | None = None, *, filter=None) -> pa.Table:
    """Stream a trajectories dataset in batches, keeping only candidate scalars."""
    parts = [extract(b, cfg, decided) for b in
             dataset.to_batches(columns=source_columns(cfg), batch_size=cfg.batch_rows, filter=filter)]
    parts = [p for p in parts if p.num_rows]
    return pa.concat_tables(parts) if parts else candidate_schema(cfg).empty_table()
