"""A synthetic lake with every table the health report reads, for tests,
the query benchmark and report screenshots.

Trajectories come from pipeline.testing.trajectories.make_trajectories (one batch per policy
version, reward rising with the version), then get the faults a real fleet
has: infrastructure failures with null reward, groups that mix environment or
verifier versions, varied tool calls, rows partly sampled by the previous
policy. Receipts and snapshot_members are what the real admission core
(engine_duckdb.decide_candidates: the SQL engine, then decide.finalize)
decides for those rows, one admission run per run and policy version with
the next version current; checkpoints and events are derived from the rows
with the shapes in schemas/*.yaml, the way the trainer and the rollout
workers would write them. Deterministic for a seed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.admission.config import AdmissionConfig
from pipeline.schema import table_spec

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

START = datetime(2026, 11, 1, tzinfo=timezone.utc)
ADMISSION = AdmissionConfig(quality=False)   # the receipts' admission config (current_policy_version per run)


@dataclass(frozen=True, kw_only=True)
class HealthLakeSpec:
    trajectories_per_version: int = 400
    versions: int = 3
    group_size: int = 4
    seed: int = 0
    runs: tuple[str, ...] = ("run-0",)
    short_tokens: bool = False   # 4-8 response tokens: benchmarks at 1M rows (queries only read lengths)
    event_episodes: int | None = None  # episodes that get events (default: all trajectories)
    chunk: int = 200_000         # rows per trajectories append
    side_appends: int = 1        # receipts and snapshot_members land in this many appends (one per admission run)
    events_chunk: int = 1_000_000  # rows per events append
    checkpoints: bool = True
    receipts: bool = True
    events: bool = True
    metrics: bool = True          # per-step training metrics of every checkpoint after version 0
    evaluations: bool = True      # a held-out evaluation of every checkpoint (greedy, and 4 samples)
    steps_per_checkpoint: int = 8
    # reward-hacking shapes (the report's alarms; None: a healthy lake)
    hacked_from: int | None = None    # rollouts of this policy version on pass 95% of the time, while held-out
                                      # success stays at this version's level: train outruns held-out
    shaping_from: int | None = None   # rollouts of this policy version on also carry an untagged shaping
                                      # component length_bonus = 2.0: its share of the reward drifts up


def make_version_batch(spec: HealthLakeSpec, run: str, version: int, offset: int, n: int) -> pa.Table:
    """``n`` trajectories of ``run`` at policy ``version`` with injected faults."""
    from pipeline.lake.contenthash import content_hashes
    from pipeline.testing.trajectories import make_trajectories

    seed = spec.seed * 1000 + version * 37 + offset // max(spec.chunk, 1) + sum(run.encode()) % 7
    rng = np.random.default_rng(seed)
    kwargs: dict[str, Any] = dict(median_len=5, sigma=0.2, max_len=8, prompt_len=2, multi_turn=False) if spec.short_tokens \
        else dict(median_len=48, sigma=0.6, max_len=512, prompt_len=8)
    start = START + timedelta(hours=6 * version, seconds=offset)
    t = make_trajectories(n, seed=seed, group_size=spec.group_size, run_id=run, policy_version=version,
                          id_prefix=f"{run}-v{version}-o{offset}-", start=start,
                          reward_p=0.95 if spec.hacked_from is not None and version >= spec.hacked_from
                          else min(0.2 + 0.15 * version, 0.9), with_hash=False, **kwargs)
    # make_trajectories spaces rows 1 s apart: squeeze each version into ~5 hours
    span_s = 5 * 3600
    created = pa.array([start + timedelta(seconds=int(s)) for s in
                        np.sort(rng.integers(0, span_s, n)).tolist()], pa.timestamp("us", tz="UTC"))
    dur = rng.gamma(2.0, 20.0, n)
    finished = pc.add(created, pa.array((dur * 1e6).astype(np.int64), pa.duration("us")))
    infra = rng.random(n) < 0.04
    expired = (~infra) & (rng.random(n) < 0.01)
    group_idx = np.arange(n) // spec.group_size
    n_groups = int(group_idx.max()) + 1
    env_bad = np.isin(group_idx, np.flatnonzero(rng.random(n_groups) < 0.03)) & (rng.random(n) < 0.5)
    ver_bad = np.isin(group_idx, np.flatnonzero(rng.random(n_groups) < 0.02)) & (rng.random(n) < 0.5)
    tools = rng.poisson(1.0 + 0.5 * version, n).astype(np.int32)
    status = np.where(infra, "INFRA_FAILED", np.where(expired, "EXPIRED", "ACCEPTED"))
    verdict = np.asarray(t.column("verdict").to_numpy(zero_copy_only=False), dtype=object)
    verdict = np.where(infra, "ENV_ERROR", np.where(expired, "UNKNOWN", verdict))
    stop = np.where(infra, "env_timeout", np.where(expired, "wall_clock", "eos"))
    reward = t.column("reward").to_numpy()
    comps: list[list[tuple[str, float]] | None] = []
    fmt_ok = rng.random(n) > 0.05
    for i in range(n):
        if infra[i] or expired[i]:
            comps.append(None)
        else:
            comps.append([("task_success", float(reward[i])), ("format", 1.0 if fmt_ok[i] else 0.0),
                          ("tool_cost", -0.01 * float(tools[i]))]
                         + ([("length_bonus", 2.0)] if spec.shaping_from is not None and version >= spec.shaping_from
                            else []))
    reward_arr = pa.array(np.where(infra | expired, np.nan, reward), pa.float64(),
                          mask=infra | expired)
    repl = {
        "created_at": created,
        "finished_at": finished,
        "status": pa.array(status),
        "verdict": pa.array(verdict.astype(str)),
        "stop_reason": pa.array(stop),
        "reward": reward_arr,
        "reward_components": pa.array(comps, pa.map_(pa.string(), pa.float64())),
        "env_version": pa.array(np.where(env_bad, "env-2", "env-1")),
        "verifier_version": pa.array(np.where(ver_bad, "ver-2", "ver-1")),
        "num_tool_calls": pa.array(tools),
        "num_turns": pa.array(tools + 1),
        "queue_wait_ms": pa.array(rng.gamma(1.5, 400.0 * (1 + version), n).astype(np.int64)),
    }
    for name, col in repl.items():
        i = t.schema.get_field_index(name)
        t = t.set_column(i, t.schema.field(name), col.cast(t.schema.field(name).type))
    if version > 0:
        # ~3% of the valid rows were partly sampled by the previous policy (weights updated mid-generation):
        # admitted with the next version current, they are stale_policy
        t = _sampled_earlier(t, (~infra) & (~expired) & (rng.random(n) < 0.03), version - 1)
    i = t.schema.get_field_index("content_hash")
    return t.set_column(i, pa.field("content_hash", pa.string()), content_hashes(t))


def _sampled_earlier(t: pa.Table, rows: np.ndarray, version: int) -> pa.Table:
    """``t`` with the first response token of each of ``rows`` sampled by policy ``version``."""
    tpv = t.column("token_policy_versions").combine_chunks()
    flat = tpv.flatten().to_numpy(zero_copy_only=False).copy()
    offsets = tpv.offsets.to_numpy()
    offsets = offsets - offsets[0]
    first = offsets[:-1][rows & (np.diff(offsets) > 0)]
    flat[first[flat[first] >= 0]] = version
    col = type(tpv).from_arrays(pa.array(offsets), pa.array(flat, tpv.type.value_type))
    i = t.schema.get_field_index("token_policy_versions")
    return t.set_column(i, t.schema.field(i), col)


def build_health_lake(lake: Lake, spec: HealthLakeSpec = HealthLakeSpec()) -> dict[str, int]:
    """Write trajectories (+ receipts, snapshot_members, checkpoints, events per ``spec``)."""
    from pipeline.admission.candidates import extract, source_columns
    from pipeline.landing.ingest import stamp_derived

    counts = {"trajectories": 0, "receipts": 0, "snapshot_members": 0, "checkpoints": 0, "events": 0}
    seq = 0
    keep_cols = ["trajectory_id", "group_id", "run_id", "task_id", "policy_version", "status", "verdict", "reward",
                 "difficulty", "queue_wait_ms", "content_hash", "num_tool_calls", "created_at", "finished_at"]
    scalars: list[pa.Table] = []
    candidates: dict[tuple[str, int], list[pa.Table]] = {}
    for run in spec.runs:
        for v in range(spec.versions):
            for off in range(0, spec.trajectories_per_version, spec.chunk):
                n = min(spec.chunk, spec.trajectories_per_version - off)
                t = stamp_derived(make_version_batch(spec, run, v, off, n), f"synth-{seq}")
                lake.append("trajectories", t, command="synth", app_id="synth-health", txn_version=seq)
                seq += 1
                counts["trajectories"] += n
                scalars.append(t.select(keep_cols))
                if spec.receipts:
                    candidates.setdefault((run, v), []).append(extract(t.select(source_columns(ADMISSION)), ADMISSION))
    rows = pa.concat_tables(scalars)
    snaps_by_version: dict[tuple[str, int], str] = {}
    if spec.receipts:
        receipts, members, snaps_by_version = _admit(candidates)
        for name, table in (("receipts", receipts), ("snapshot_members", members)):
            step = -(-table.num_rows // max(spec.side_appends, 1)) or 1
            for j, off in enumerate(range(0, table.num_rows, step)):
                lake.append(name, table.slice(off, step), command="synth", app_id=f"synth-health-{name}",
                            txn_version=j)
        counts["receipts"] = receipts.num_rows
        counts["snapshot_members"] = members.num_rows
    if spec.checkpoints and snaps_by_version:
        ck = _checkpoints(spec, snaps_by_version)
        lake.append("checkpoints", ck, command="synth", app_id="synth-health-ck", txn_version=0)
        counts["checkpoints"] = ck.num_rows
        if spec.metrics:
            mt = _metrics(spec, ck)
            lake.append("metrics", mt, command="synth", app_id="synth-health-metrics", txn_version=0)
            counts["metrics"] = mt.num_rows
        if spec.evaluations:
            ev = _evaluations(spec, ck)
            lake.append("evaluations", ev, command="synth", app_id="synth-health-evals", txn_version=0)
            counts["evaluations"] = ev.num_rows
    if spec.events:
        ev = _events(rows, spec)
        for j, off in enumerate(range(0, ev.num_rows, spec.events_chunk)):
            lake.append("events", ev.slice(off, spec.events_chunk), command="synth", app_id="synth-health-ev",
                        txn_version=j)
        counts["events"] = ev.num_rows
    return counts


def _admit(candidates: dict[tuple[str, int], list[pa.Table]]
           ) -> tuple[pa.Table, pa.Table, dict[tuple[str, int], str]]:
    """(receipts, snapshot_members, snapshot id per (run, version)): the real
    admission core over each run's rows of one policy version, decided when the
    next version is current (ADMISSION's config otherwise)."""
    from pipeline.admission.config import admission_config_hash
    from pipeline.admission.engine_duckdb import decide_candidates
    from pipeline.admission.run import stamp_receipts
    from pipeline.snapshots.format import compute_snapshot_id

    receipt_schema = table_spec("receipts").arrow_schema()
    member_schema = table_spec("snapshot_members").arrow_schema()
    receipts, members, snaps = [], [], {}
    for (run, v), parts in candidates.items():
        cfg = dataclasses.replace(ADMISSION, current_policy_version=v + 1)
        chash = admission_config_hash(cfg)
        decided_at = START + timedelta(days=30, hours=v)
        dec = decide_candidates(pa.concat_tables(parts), cfg, current_policy_version=v + 1, now=decided_at,
                                config_hash=chash)
        adm = dec.admitted
        sid = compute_snapshot_id(zip(adm.column("trajectory_id").to_pylist(), adm.column("content_hash").to_pylist()),
                                  chash, cfg.advantage) if adm.num_rows else None
        receipts.append(stamp_receipts(dec.receipts, f"adm-{run}/{v}", sid, receipt_schema, decided_at=decided_at))
        if sid is not None:
            snaps[(run, v)] = sid
            adm = adm.add_column(0, member_schema.field("snapshot_id"), pa.array([sid] * adm.num_rows, pa.string()))
            members.append(adm.select(member_schema.names).cast(member_schema))
    return (pa.concat_tables(receipts) if receipts else receipt_schema.empty_table(),
            pa.concat_tables(members) if members else member_schema.empty_table(), snaps)


def _checkpoints(spec: HealthLakeSpec, snaps: dict[tuple[str, int], str]) -> pa.Table:
    """Version 0 (no data), then version v+1 trained on the snapshots of versions v and v-1."""
    rows = []
    parent = None
    for v in range(spec.versions + 1):
        used = sorted({s for (run, ver), s in snaps.items() if v - 2 <= ver <= v - 1})
        cid = f"ck-{v:04d}"
        rows.append({
            "checkpoint_id": cid, "parent_checkpoint_id": parent, "snapshot_ids": used, "policy_version": v,
            "path": f"_checkpoints/{cid}", "train_config_hash": "t" * 64,
            "train_config_json": json.dumps({"lr": 1e-5}), "code_version": "synth", "seed": spec.seed,
            "world_size": 1, "global_step": 10 * v, "samples_seen": 100 * v,
            "metrics_json": json.dumps({"loss": 1.0 / (v + 1)}), "file_sha256": [("model.safetensors", "0" * 64)],
            "created_at": START + timedelta(hours=6 * v + 5, minutes=30),
        })
        parent = cid
    return pa.Table.from_pylist(rows, schema=table_spec("checkpoints").arrow_schema())


def _evaluations(spec: HealthLakeSpec, ck: pa.Table) -> pa.Table:
    """Rows shaped like schemas/evaluations.yaml: held-out success rises with the version (up to
    ``spec.hacked_from``)."""
    rows = []
    for cid, v, created in zip(ck.column("checkpoint_id").to_pylist(), ck.column("policy_version").to_pylist(),
                               ck.column("created_at").to_pylist()):
        for samples in (1, 4):
            p1 = min(0.95, 0.2 + 0.12 * (v if spec.hacked_from is None else min(v, spec.hacked_from)))
            pk = {1: p1} if samples == 1 else {1: p1, 2: min(1.0, p1 * 1.4), 4: min(1.0, p1 * 1.7)}
            rows.append({
                "eval_id": f"eval-{cid}-{samples}", "policy_version": v, "checkpoint_id": cid, "env": "arithmetic-tool",
                "split": "eval", "engine": "hf", "seed": 0, "n": 200, "samples": samples,
                "temperature": 0.0 if samples == 1 else 1.0, "judged": 200 * samples, "success": p1,
                "pass_at_k": sorted(pk.items()), "reward_mean": p1, "format_rate": 0.9, "tool_use_rate": 0.5,
                "success_by_difficulty": [("easy", min(1.0, p1 + 0.1)), ("hard", max(0.0, p1 - 0.1))],
                "statuses": [("COMPLETED", 200 * samples)], "command": "synth", "run_id": f"eval-run-{cid}",
                "evaluated_at": created + timedelta(minutes=5),
            })
    schema = table_spec("evaluations").arrow_schema()
    return pa.Table.from_pylist(rows, schema=pa.schema([f for f in schema if f.name != "row_key"]))


def _metrics(spec: HealthLakeSpec, ck: pa.Table) -> pa.Table:
    """Per-step metrics shaped like schemas/metrics.yaml: loss falls, reward rises."""
    rng = np.random.default_rng(spec.seed + 5)
    rows = []
    for cid, snaps, v, created in zip(ck.column("checkpoint_id").to_pylist(), ck.column("snapshot_ids").to_pylist(),
                                      ck.column("policy_version").to_pylist(), ck.column("created_at").to_pylist()):
        if not snaps:
            continue
        for step in range(spec.steps_per_checkpoint):
            prog = (v - 1) * spec.steps_per_checkpoint + step
            rows.append({
                "checkpoint_id": cid, "snapshot_id": snaps[-1], "run_id": f"train-{cid}", "global_step": step,
                "epoch": 0, "loss": float(1.0 / (1 + 0.1 * prog) + rng.normal(0, 0.02)),
                "pg_loss": float(0.9 / (1 + 0.1 * prog)), "kl": float(0.01 * (1 + 0.05 * prog)),
                "entropy": float(2.0 - 0.03 * prog), "reward_mean": float(0.2 + 0.01 * prog + rng.normal(0, 0.02)),
                "advantage_mean": 0.0, "clip_fraction": float(abs(rng.normal(0.05, 0.01))),
                "clip_frac_high": 0.03, "clip_frac_low": 0.02, "approx_kl": float(0.001 * (1 + 0.1 * step)),
                "ratio_p05": 0.9, "ratio_p50": 1.0, "ratio_p95": 1.1, "mismatch_kl": 1e-6,
                "grad_norm": float(abs(rng.normal(1.0, 0.2))), "lr": 1e-5, "tokens": 4096, "sequences": 64,
                "micro_batches": 4, "padding_ratio": float(abs(rng.normal(0.1, 0.02))),
                "tokens_per_s": float(abs(rng.normal(2000, 100))), "step_seconds": 2.0,
                "policy_lag": float(rng.uniform(0, 1)), "policy_lag_max": 1,
                "ess_token_frac": float(0.99 - 0.002 * step), "ess_seq_frac": float(0.95 - 0.01 * step),
                "behav_ratio_p50": 1.0, "behav_ratio_p90": 1.05, "behav_ratio_p99": float(1.2 + 0.01 * step),
                "behav_ratio_max": 1.6, "behav_ratio_above": 0.0,
                "created_at": created - timedelta(seconds=10 * (spec.steps_per_checkpoint - step)),
            })
    return pa.Table.from_pylist(rows, schema=table_spec("metrics").arrow_schema())


def _events(rows: pa.Table, spec: HealthLakeSpec) -> pa.Table:
    """CREATED, then per turn GENERATING (+ a tool call: TOOL_WAITING, ACTION_COMMITTED,
    ACTION_EXECUTED, OBSERVATION_PERSISTED), then VERIFYING, TERMINAL. Some
    episodes are resumed by a second worker; some actions never confirmed."""
    rng = np.random.default_rng(spec.seed + 7)
    n = rows.num_rows if spec.event_episodes is None else min(spec.event_episodes, rows.num_rows)
    pick = np.sort(rng.choice(rows.num_rows, n, replace=False)) if n < rows.num_rows else np.arange(n)
    sub = rows.take(pa.array(pick))
    tid = np.asarray(sub.column("trajectory_id").to_numpy(zero_copy_only=False), dtype=object)
    gid = np.asarray(sub.column("group_id").to_numpy(zero_copy_only=False), dtype=object)
    run = np.asarray(sub.column("run_id").to_numpy(zero_copy_only=False), dtype=object)
    ver = sub.column("policy_version").to_numpy()
    status = np.asarray(sub.column("status").to_numpy(zero_copy_only=False), dtype=object)
    tools = np.minimum(sub.column("num_tool_calls").to_numpy(), 3)
    t0 = sub.column("created_at").cast(pa.int64()).to_numpy()
    resumed = rng.random(n) < 0.02
    unconfirmed = rng.random(n) < 0.01
    cols: dict[str, list] = {k: [] for k in ("episode_id", "step_id", "action_id", "event_type", "run_id", "group_id",
                                             "worker_id", "policy_version", "state", "payload", "created_at")}

    def add(i, step, action, etype, ts, worker, state=None, payload=None):
        row = {"episode_id": tid[i], "step_id": step, "action_id": action, "event_type": etype, "run_id": run[i],
               "group_id": gid[i], "worker_id": worker, "policy_version": int(ver[i]), "state": state,
               "payload": payload, "created_at": int(ts)}
        for k, v in row.items():
            cols[k].append(v)

    gen = rng.gamma(2.0, 150_000.0 * (1 + 0.3 * ver)[:, None], (n, 4)).astype(np.int64)   # us
    tool = rng.lognormal(np.log(40_000.0), 0.8, (n, 4)).astype(np.int64)
    verify = rng.gamma(3.0, 5_000.0, n).astype(np.int64)
    for i in range(n):
        w = f"w{i % 8}"
        ts = t0[i]
        add(i, 0, "", "CREATED", ts, w, "CREATED")
        for s in range(int(tools[i]) + 1):
            ts += 1000
            add(i, s, "", "GENERATING", ts, w, "GENERATING")
            ts += gen[i, s]
            if s < tools[i]:
                a = f"a{s}"
                add(i, s, a, "TOOL_WAITING", ts, w, "TOOL_WAITING")
                ts += 500
                add(i, s, a, "ACTION_COMMITTED", ts, w, payload=json.dumps({"tool": "calc"}))
                ts += tool[i, s]
                if unconfirmed[i] and s == tools[i] - 1:
                    w = f"w{(i + 1) % 8}"  # crashed before confirming; another worker finishes
                    continue
                add(i, s, a, "ACTION_EXECUTED", ts, w)
                ts += 300
                add(i, s, a, "OBSERVATION_PERSISTED", ts, w)
                if resumed[i] and s == 0:
                    w = f"w{(i + 3) % 8}"
        ts += 1000
        add(i, int(tools[i]), "", "VERIFYING", ts, w, "VERIFYING")
        ts += verify[i]
        add(i, int(tools[i]), "", "TERMINAL", ts, w, str(status[i]))
    schema = table_spec("events").ingest_schema()  # row_key: the lake's
    arrays = []
    for f in schema:
        vals = cols[f.name]
        if f.name == "created_at":
            arrays.append(pa.array(vals, pa.int64()).cast(f.type))
        else:
            arrays.append(pa.array(vals, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)
