"""A synthetic lake with every table the health report reads, for tests,
the query benchmark and report screenshots.

Trajectories come from pipeline.testing.trajectories.make_trajectories (one batch per policy
version, reward rising with the version), then get the faults a real fleet
has: infrastructure failures with null reward, groups that mix environment or
verifier versions, varied tool calls. Receipts, snapshot_members, checkpoints
and events are derived from those rows with the shapes in schemas/*.yaml, the
way admission, the trainer and the rollout workers would write them (a
simplified admission: enough for the report, not a reference for admission).
Deterministic for a seed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.schema import table_spec

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

START = datetime(2026, 11, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class HealthLakeSpec:
    trajectories_per_version: int = 400
    versions: int = 3
    group_size: int = 4
    seed: int = 0
    runs: tuple[str, ...] = ("run-0",)
    short_tokens: bool = False   # 4-8 response tokens: benchmarks at 1M rows (queries only read lengths)
    event_episodes: int | None = None  # episodes that get events (default: all trajectories)
    chunk: int = 200_000         # rows per trajectories append
    checkpoints: bool = True
    receipts: bool = True
    events: bool = True
    metrics: bool = True          # per-step training metrics of every checkpoint after version 0
    evaluations: bool = True      # a held-out evaluation of every checkpoint (greedy, and 4 samples)
    steps_per_checkpoint: int = 8


def _ids(prefix: str, idx: np.ndarray) -> pa.Array:
    return pa.array([f"{prefix}{i}" for i in idx.tolist()], pa.string())


def make_version_batch(spec: HealthLakeSpec, run: str, version: int, offset: int, n: int) -> pa.Table:
    """``n`` trajectories of ``run`` at policy ``version`` with injected faults."""
    from pipeline.lake.contenthash import content_hashes
    from pipeline.testing.trajectories import make_trajectories

    seed = spec.seed * 1000 + version * 37 + offset // max(spec.chunk, 1) + sum(run.encode()) % 7
    rng = np.random.default_rng(seed)
    kwargs = dict(median_len=5, sigma=0.2, max_len=8, prompt_len=2, multi_turn=False) if spec.short_tokens \
        else dict(median_len=48, sigma=0.6, max_len=512, prompt_len=8)
    start = START + timedelta(hours=6 * version, seconds=offset)
    t = make_trajectories(n, seed=seed, group_size=spec.group_size, run_id=run, policy_version=version,
                          id_prefix=f"{run}-v{version}-o{offset}-", start=start,
                          reward_p=min(0.2 + 0.15 * version, 0.9), with_hash=False, **kwargs)
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
    comps = []
    fmt_ok = rng.random(n) > 0.05
    for i in range(n):
        if infra[i] or expired[i]:
            comps.append(None)
        else:
            comps.append([("task_success", float(reward[i])), ("format", 1.0 if fmt_ok[i] else 0.0),
                          ("tool_cost", -0.01 * float(tools[i]))])
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
    i = t.schema.get_field_index("content_hash")
    return t.set_column(i, pa.field("content_hash", pa.string()), content_hashes(t))


def build_health_lake(lake: Lake, spec: HealthLakeSpec = HealthLakeSpec()) -> dict[str, int]:
    """Write trajectories (+ receipts, snapshot_members, checkpoints, events per ``spec``)."""
    from pipeline.lake.ingest import stamp_derived

    counts = {"trajectories": 0, "receipts": 0, "snapshot_members": 0, "checkpoints": 0, "events": 0}
    seq = 0
    keep_cols = ["trajectory_id", "group_id", "run_id", "task_id", "policy_version", "status", "verdict", "reward",
                 "difficulty", "queue_wait_ms", "content_hash", "num_tool_calls", "created_at", "finished_at"]
    scalars: list[pa.Table] = []
    lens: list[np.ndarray] = []
    for run in spec.runs:
        for v in range(spec.versions):
            for off in range(0, spec.trajectories_per_version, spec.chunk):
                n = min(spec.chunk, spec.trajectories_per_version - off)
                t = make_version_batch(spec, run, v, off, n)
                lake.append("trajectories", stamp_derived(t, f"synth-{seq}"), command="synth",
                            app_id="synth-health", txn_version=seq)
                seq += 1
                counts["trajectories"] += n
                scalars.append(t.select(keep_cols))
                lens.append(pc.list_value_length(t.column("response_ids")).to_numpy())
    rows = pa.concat_tables(scalars)
    length = np.concatenate(lens)
    snaps_by_version: dict[tuple[str, int], str] = {}
    if spec.receipts:
        receipts, members, snaps_by_version = _admit(rows, length, spec)
        lake.append("receipts", receipts, command="synth", app_id="synth-health-receipts", txn_version=0)
        lake.append("snapshot_members", members, command="synth", app_id="synth-health-members", txn_version=0)
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
        for j, off in enumerate(range(0, ev.num_rows, 1_000_000)):
            lake.append("events", ev.slice(off, 1_000_000), command="synth", app_id="synth-health-ev",
                        txn_version=j)
        counts["events"] = ev.num_rows
    return counts


def _admit(rows: pa.Table, length: np.ndarray, spec: HealthLakeSpec):
    """Group decisions the way docs/admission-rules.md describes them (simplified, vectorized)."""
    import pandas as pd

    rng = np.random.default_rng(spec.seed + 99)
    df = rows.select(["trajectory_id", "group_id", "run_id", "task_id", "policy_version", "status", "verdict",
                      "reward", "difficulty", "queue_wait_ms", "content_hash"]).to_pandas()
    df["length"] = length
    valid = (~df.status.isin(["INFRA_FAILED", "EXPIRED"])) & df.verdict.isin(["PASS", "FAIL"]) & df.reward.notna()
    stale = valid & (rng.random(len(df)) < 0.03)
    df["reason"] = np.where(~valid, np.where(df.status == "INFRA_FAILED", "infra_failed",
                                             np.where(df.status == "EXPIRED", "expired", "no_reward")),
                            np.where(stale, "stale_policy", ""))
    df["ok"] = df.reason == ""
    df["r_ok"] = df.reward.where(df.ok)
    df["w_ok"] = df.queue_wait_ms.where(df.ok)
    by = df.groupby("group_id", sort=True)
    g = by.agg(run_id=("run_id", "first"), task_id=("task_id", "first"), ver=("policy_version", "min"),
               arrived=("trajectory_id", "size"), n_ok=("ok", "sum"), r_max=("r_ok", "max"), r_min=("r_ok", "min"),
               r_mean=("r_ok", "mean"), r_std=("r_ok", lambda x: x.std(ddof=0)), w_max=("w_ok", "max"),
               difficulty=("difficulty", "first"), mean_len=("length", "mean"))
    g["decision"] = np.where(g.n_ok < 2, "insufficient_valid", np.where(g.r_max > g.r_min, "admit", "zero_variance"))
    g["length_bucket"] = [_len_bucket(x) for x in g.mean_len]
    keys = [f"{r}/{v}" for r, v in zip(g.run_id, g.ver)]
    g["snap"] = [hashlib.sha256(k.encode()).hexdigest() if d == "admit" else None for k, d in zip(keys, g.decision)]
    snaps = {(r, int(v)): s for r, v, s in zip(g.run_id, g.ver, g.snap) if isinstance(s, str)}
    ok_ids = df[df.ok].groupby("group_id").trajectory_id.agg(list)
    bad = df[~df.ok]
    excluded = bad.groupby("group_id").apply(lambda x: list(zip(x.trajectory_id, x.reason)), include_groups=False)
    now = START + timedelta(days=30)
    n = len(g)
    rec = {
        "group_id": g.index.to_numpy(dtype=object), "admission_run_id": [f"adm-{k}" for k in keys],
        "config_hash": ["c" * 64] * n, "current_policy_version": (g.ver + 1).to_numpy(),
        "run_id": g.run_id.to_numpy(dtype=object), "task_id": g.task_id.to_numpy(dtype=object),
        "ref_policy_version": g.ver.to_numpy(), "ref_tokenizer_rev": ["tok-1"] * n,
        "ref_prompt_template_rev": ["tmpl-1"] * n, "ref_env_version": ["env-1"] * n,
        "ref_verifier_version": ["ver-1"] * n, "ref_temperature": [1.0] * n,
        "group_size": [spec.group_size] * n, "arrived_members": g.arrived.to_numpy(),
        "valid_members": [ok_ids.get(k, []) for k in g.index],
        "excluded_members": [excluded.get(k, []) for k in g.index],
        "reward_mean": g.r_mean.to_numpy(), "reward_std": g.r_std.to_numpy(), "policy_lag": [1] * n,
        "max_queue_wait_ms": pd.array(g.w_max.to_numpy(), dtype="Int64"),
        "difficulty": g.difficulty.to_numpy(dtype=object), "length_bucket": g.length_bucket.to_numpy(dtype=object),
        "tool_call_bucket": [None] * n, "reward_std_bucket": [None] * n,
        "checks": [[("min_valid_members", "pass" if k >= 2 else f"fail:{k} < 2"),
                    ("reward_spread", "skip" if k < 2 else "pass" if d == "admit" else "fail:max == min")]
                   for k, d in zip(g.n_ok, g.decision)],
        "decision": g.decision.to_numpy(dtype=object),
        "snapshot_id": [s if isinstance(s, str) else None for s in g.snap],
        "decided_at": [now + timedelta(hours=int(v)) for v in g.ver],
        "ref_top_p": [1.0] * n, "ref_task_version": ["v1"] * n, "ref_harness_version": ["h-1"] * n,
        "ref_tool_schema_version": [""] * n, "ref_prompt_hash": [None] * n,
    }
    schema = table_spec("receipts").arrow_schema()
    receipts = pa.Table.from_arrays([pa.array(list(rec[f.name]) if f.name == "max_queue_wait_ms" else rec[f.name],
                                              f.type, from_pandas=True) for f in schema], schema=schema)
    m = df[df.ok].join(g[["snap", "r_mean", "r_std", "length_bucket"]], on="group_id")
    m = m[m.snap.notna()]
    adv = (m.reward - m.r_mean) / (m.r_std + 1e-6)
    k = len(m)
    mem = {
        "snapshot_id": m.snap.to_numpy(dtype=object), "trajectory_id": m.trajectory_id.to_numpy(dtype=object),
        "group_id": m.group_id.to_numpy(dtype=object), "content_hash": m.content_hash.to_numpy(dtype=object),
        "advantage": adv.to_numpy(), "reward": m.reward.to_numpy(),
        "policy_lag": rng.integers(0, 2, k), "difficulty": m.difficulty.to_numpy(dtype=object),
        "length_bucket": m.length_bucket.to_numpy(dtype=object), "tool_call_bucket": [None] * k,
        "reward_std_bucket": [None] * k,
    }
    schema = table_spec("snapshot_members").arrow_schema()
    members = pa.Table.from_arrays([pa.array(mem[f.name], f.type, from_pandas=True) for f in schema], schema=schema)
    return receipts, members, snaps


def _len_bucket(mean_len: float) -> str:
    return "short" if mean_len < 32 else "medium" if mean_len < 128 else "long"


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
    """Rows shaped like schemas/evaluations.yaml: held-out success rises with the version."""
    rows = []
    for cid, v, created in zip(ck.column("checkpoint_id").to_pylist(), ck.column("policy_version").to_pylist(),
                               ck.column("created_at").to_pylist()):
        for samples in (1, 4):
            p1 = min(0.95, 0.2 + 0.12 * v)
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
