"""``pipeline simulate --land``: simulated trajectories land in a lake and the
real admission job decides them.

At every admission run of the simulation, the groups that completed since the
last run are turned into rows of the trajectories ingest contract (and their
harness events: CREATED ... TERMINAL, timed along each trajectory) (tiny token
arrays: a 4-token prompt, a 6-token response with one observation segment;
token_policy_versions = the behaviour version on policy tokens, -1 on
observation tokens), validated with ``validate_table`` (rejects go to
quarantine, like ingest), and appended in ONE commit per run as an
application transaction (app_id ``sim:<run_id>:<config hash>``, version = run
sequence), so rerunning the same simulation into the same lake lands nothing
twice. Then ``pipeline.admission.run.admit`` runs with the simulation's
``current_policy_version`` and ``now``, writes receipts and a snapshot, and
its receipts are the decisions the simulated trainer acts on.

Timestamps: simulated second 0 = ``start_time``. ``queue_wait_ms`` = time from
the member's finish to the admission run that lands it (a group lands when
complete, so the real job sees only complete groups).

The in-simulator gate decides the same groups alongside, and the summary
reports how often the two disagree (``lake.gate_mismatches``): the simulator's
gate is a model of the real one, and this is the check that it still is.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa

from pipeline.config import config_hash
from pipeline.sim.config import SimConfig
from pipeline.sim.gate import EXPIRED, INFRA_FAILED, VALID, Decision, FreshnessGate

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

PROMPT_LEN = 4
MASK = np.array([1, 1, 0, 0, 1, 1], np.int8)  # model turn, tool observation, model turn


def ids_prefix(cfg: SimConfig) -> str:
    """Trajectory/group id prefix: run id + config hash, so different configs in one lake never collide."""
    return f"{cfg.run_id}-{config_hash(cfg)[:10]}"


def _epoch_us(cfg: SimConfig) -> int:
    t = datetime.fromisoformat(cfg.start_time)
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return int(round(t.timestamp() * 1_000_000))


def trajectory_rows(sim, idx: Sequence[int], now: float) -> pa.Table:
    """Rows of the trajectories ingest contract (content_hash filled) for trajectories ``idx``."""
    from pipeline.lake.contenthash import content_hashes
    from pipeline.schema import table_spec

    cfg: SimConfig = sim.cfg
    ids = np.asarray(list(idx), np.int64)
    n = len(ids)
    prefix = ids_prefix(cfg)
    G = sim.G
    groups = ids // G
    version = np.asarray([sim.version[i] for i in ids], np.int64)
    status = [sim.status[i] for i in ids]
    reward = [sim.reward[i] for i in ids]
    start = np.asarray([sim.start[i] for i in ids], float)
    end = np.asarray([sim.end[i] for i in ids], float)
    cls = [sim.classes[sim.g_class[g]].name for g in groups]
    epoch = _epoch_us(cfg)
    created = epoch + np.round(start * 1e6).astype(np.int64)
    finished = np.maximum(epoch + np.round(end * 1e6).astype(np.int64), created)
    L = len(MASK)
    mask = np.tile(MASK, n)
    resp = ((ids[:, None] * 7919 + np.arange(L)[None, :]) % 29000 + 3).astype(np.int32).ravel()
    tpv = np.where(mask == 1, np.repeat(version, L), -1).astype(np.int32)
    logp = np.where(mask == 1, np.float32(-0.5), np.float32(0.0)).astype(np.float32)
    prompt = ((np.repeat(groups, PROMPT_LEN) * 31 + np.tile(np.arange(PROMPT_LEN), n)) % 29000 + 3).astype(np.int32)
    off = pa.array(np.arange(0, (n + 1) * L, L, dtype=np.int32))
    poff = pa.array(np.arange(0, (n + 1) * PROMPT_LEN, PROMPT_LEN, dtype=np.int32))
    verdict = ["ENV_ERROR" if s == INFRA_FAILED else "UNKNOWN" if s == EXPIRED else
               ("PASS" if r else "FAIL") for s, r in zip(status, reward)]
    stop = ["env_timeout" if s == INFRA_FAILED else "wall_clock" if s == EXPIRED else "eos" for s in status]
    comps = [None if r is None else [("task_success", float(r))] for r in reward]
    cols = {
        "trajectory_id": pa.array([f"{prefix}-t{i}" for i in ids]),
        "group_id": pa.array([f"{prefix}-g{g}" for g in groups]),
        "group_size": pa.array(np.full(n, G, np.int32)),
        "task_id": pa.array([f"{c}-{sim.g_task[g]}" for c, g in zip(cls, groups)]),
        "task_version": pa.array(["v1"] * n),
        "run_id": pa.array([cfg.run_id] * n),
        "policy_version": pa.array(version),
        "token_policy_versions": pa.ListArray.from_arrays(off, pa.array(tpv)),
        "tokenizer_rev": pa.array(["sim-tok"] * n),
        "prompt_template_rev": pa.array(["sim-tmpl"] * n),
        "harness_version": pa.array(["sim-harness"] * n),
        "env_version": pa.array(["sim-env"] * n),
        "verifier_version": pa.array(["sim-verifier"] * n),
        "temperature": pa.array(np.ones(n)),
        "top_p": pa.array(np.ones(n)),
        "sampling_seed": pa.array(ids),
        "status": pa.array(status),
        "verdict": pa.array(verdict),
        "stop_reason": pa.array(stop),
        "reward": pa.array(reward, pa.float64()),
        "reward_components": pa.array(comps, pa.map_(pa.string(), pa.float64())),
        "difficulty": pa.array(cls),
        "num_turns": pa.array(np.full(n, 2, np.int32)),
        "num_tool_calls": pa.array(np.full(n, 1, np.int32)),
        "created_at": pa.array(created, pa.timestamp("us", tz="UTC")),
        "finished_at": pa.array(finished, pa.timestamp("us", tz="UTC")),
        "queue_wait_ms": pa.array(np.maximum(np.floor((now - end) * 1000.0), 0).astype(np.int64)),
        "prompt_ids": pa.ListArray.from_arrays(poff, pa.array(prompt)),
        "response_ids": pa.ListArray.from_arrays(off, pa.array(resp)),
        "response_logprobs": pa.ListArray.from_arrays(off, pa.array(logp)),
        "loss_mask": pa.ListArray.from_arrays(off, pa.array(mask)),
        "tool_schema_version": pa.array(["sim-tools/1"] * n),
        "turn_rewards": pa.nulls(n, pa.list_(pa.float64())),
        "verifier_confidence": pa.nulls(n, pa.float64()),
        "verifier_evidence": pa.nulls(n, pa.string()),
        "env_state_hash": pa.nulls(n, pa.string()),
    }
    spec = table_spec("trajectories")
    fields = [c.arrow_field() for c in spec.ingest_columns if c.name != "content_hash"]
    t = pa.table(cols, schema=pa.schema(fields))
    return t.append_column(spec.column("content_hash").arrow_field(), content_hashes(t))


# (event_type, step_id, action_id, state after, fraction of the trajectory's duration) for a trajectory
# that finishes: two model turns around one tool call, then verification (matches MASK above)
LIFECYCLE = (
    ("CREATED", 0, "", "CREATED", 0.0),
    ("GENERATING", 0, "", "GENERATING", 0.0),
    ("ACTION_COMMITTED", 0, "a0", "TOOL_WAITING", 0.40),
    ("TOOL_WAITING", 0, "a0", "TOOL_WAITING", 0.40),
    ("ACTION_EXECUTED", 0, "a0", "TOOL_WAITING", 0.55),
    ("OBSERVATION_PERSISTED", 0, "a0", "GENERATING", 0.55),
    ("GENERATING", 1, "", "GENERATING", 0.55),
    ("VERIFYING", 1, "", "VERIFYING", 0.95),
)


def event_rows(sim, idx: Sequence[int]) -> pa.Table:
    """The events a harness would have written for trajectories ``idx`` (schemas/events.yaml):
    the full lifecycle for finished ones; for INFRA_FAILED / EXPIRED ones the events
    up to the moment they died, then TERMINAL."""
    from pipeline.schema import table_spec

    cfg: SimConfig = sim.cfg
    prefix = ids_prefix(cfg)
    epoch = _epoch_us(cfg)
    cols: dict[str, list] = {k: [] for k in ("episode_id", "step_id", "action_id", "event_type", "run_id",
                                             "group_id", "worker_id", "policy_version", "state", "payload",
                                             "created_at")}

    def add(i, g, et, step, action, state, t_us, payload=None):
        cols["episode_id"].append(f"{prefix}-t{i}")
        cols["step_id"].append(step)
        cols["action_id"].append(action)
        cols["event_type"].append(et)
        cols["run_id"].append(cfg.run_id)
        cols["group_id"].append(f"{prefix}-g{g}")
        cols["worker_id"].append(f"{prefix}-w{sim.worker[i]}")
        cols["policy_version"].append(sim.version[i])
        cols["state"].append(state)
        cols["payload"].append(payload)
        cols["created_at"].append(t_us)

    for i in idx:
        g = i // sim.G
        start, end, status = sim.start[i], sim.end[i], sim.status[i]
        full = sim.duration[i] if status == "ACCEPTED" else None
        t0 = epoch + round(start * 1e6)
        t_end = max(epoch + round(end * 1e6), t0)
        step = 0
        for et, step_id, action, state, frac in LIFECYCLE:
            if full is None and frac > 0 and start + frac * sim.duration[i] >= end:
                break  # died before this point
            add(i, g, et, step_id, action, state, min(t0 + round(frac * sim.duration[i] * 1e6), t_end))
            step = step_id
        reward = sim.reward[i]
        add(i, g, "TERMINAL", step, "", status, t_end,
            json.dumps({"status": status, "reward": reward}, separators=(",", ":")))
    schema = table_spec("events").ingest_schema()  # row_key: the lake's
    cols["created_at"] = pa.array(cols["created_at"], pa.timestamp("us", tz="UTC"))
    return pa.table({f.name: pa.array(cols[f.name], f.type) if f.name != "created_at" else cols["created_at"]
                     for f in schema}, schema=schema)


def admission_config(cfg: SimConfig, **extra: Any):
    """The real AdmissionConfig with the simulation's gate settings."""
    from pipeline.admission.config import AdmissionConfig

    return AdmissionConfig(max_policy_lag=cfg.max_policy_lag, max_queue_wait_ms=cfg.max_queue_wait_ms,
                           min_valid_members=cfg.min_valid_members, min_reward_std=cfg.min_reward_std,
                           **extra)


class LakeGate:
    """Lands each admission run's complete groups and lets the real ``admit`` decide them."""

    def __init__(self, lake: Lake, cfg: SimConfig, *, quality: bool = False) -> None:
        self.lake = lake
        self.cfg = cfg
        self.acfg = admission_config(cfg, quality=quality)
        from pipeline.sim.engine import rules_of

        self.reference = FreshnessGate(rules_of(cfg))
        self.app_id = f"sim:{ids_prefix(cfg)}"
        self.seq = 0
        self.landed = 0
        self.events = 0
        self.quarantined = 0
        self.snapshots: list[str] = []
        self.admission_run_ids: list[str] = []
        self.gate_mismatches = 0
        self.mismatch_examples: list[dict[str, Any]] = []
        self.decided = 0

    def _land(self, sim, idx: list[int], now: float) -> None:
        """One admission run's rows through the landing door, one transaction
        version (``seq``) per run. Our own rows: a rejected trajectory is a bug
        in trajectory_rows but is quarantined like ingest; a rejected event
        fails the run before anything is written (``strict``)."""
        from pipeline.landing.rows import land_rows

        ingest_id = f"{self.app_id}:{self.seq}"
        res = land_rows(self.lake, {"trajectories": trajectory_rows(sim, idx, now), "events": event_rows(sim, idx)},
                        command="simulate", ingest_id=ingest_id, source="simulate", fingerprint=ingest_id,
                        app_id=self.app_id, txn_version=self.seq, config_hash=config_hash(self.cfg),
                        strict=("events",))
        self.quarantined += res.offered_quarantine
        self.landed += res.landed.get("trajectories", 0)
        self.events += res.landed.get("events", 0)

    def decide(self, sim, groups, members, now, current_version) -> list[Decision]:
        from pipeline.admission.run import admit

        idx = [i for m in members for i in m]
        self._land(sim, idx, now)
        self.seq += 1
        epoch = _epoch_us(self.cfg)
        now_dt = datetime.fromtimestamp((epoch + round(now * 1e6)) / 1e6, tz=timezone.utc)
        result = admit(self.lake, self.acfg, current_policy_version=current_version, now=now_dt)
        run_id = getattr(result, "admission_run_id", None)
        if run_id:
            self.admission_run_ids.append(run_id)
        snap = getattr(result, "snapshot_id", None)
        if snap:
            self.snapshots.append(snap)
        decisions = self._read_receipts(sim, groups, members)
        reference = self.reference.decide(sim, groups, members, now, current_version)
        for g, ours, theirs in zip(groups, reference, decisions):
            if ours != theirs:
                self.gate_mismatches += 1
                if len(self.mismatch_examples) < 5:
                    self.mismatch_examples.append({"group": g, "sim_gate": [ours.decision, list(ours.reasons)],
                                                   "admission": [theirs.decision, list(theirs.reasons)]})
        self.decided += len(groups)
        return decisions

    def _read_receipts(self, sim, groups, members) -> list[Decision]:
        import pyarrow.dataset as ds

        prefix = ids_prefix(self.cfg)
        gids = [f"{prefix}-g{g}" for g in groups]
        t = self.lake.read("receipts", columns=["group_id", "decision", "valid_members", "excluded_members"],
                           filter=ds.field("group_id").isin(gids))
        by_gid = {r["group_id"]: r for r in t.to_pylist()}
        out = []
        for gid, idx in zip(gids, members):
            r = by_gid.get(gid)
            if r is None:  # the job did not decide a complete group: visible as a decision of its own
                out.append(Decision("undecided_by_admission", tuple("undecided" for _ in idx)))
                continue
            valid = set(r["valid_members"] or [])
            excluded = dict(r["excluded_members"] or [])
            reasons = tuple(VALID if f"{prefix}-t{i}" in valid else excluded.get(f"{prefix}-t{i}", "missing")
                            for i in idx)
            out.append(Decision(r["decision"], reasons))
        return out


def simulate_in_lake(lake: Lake, cfg: SimConfig, *, quality: bool = False) -> dict[str, Any]:
    """Run the simulation with the real admission job as its gate; the summary
    gains a ``lake`` section (rows landed, snapshots, gate agreement)."""
    from pipeline.sim.engine import Simulation
    from pipeline.sim.metrics import summarize

    gate = LakeGate(lake, cfg, quality=quality)
    sim = Simulation(cfg, gate).run()
    summary = summarize(sim)
    summary["lake"] = {
        "uri": lake.uri,
        "landed": gate.landed,
        "events": gate.events,
        "quarantined": gate.quarantined,
        "admission_runs": gate.seq,
        "snapshots": gate.snapshots,
        "groups_decided": gate.decided,
        "gate_mismatches": gate.gate_mismatches,
        "mismatch_examples": gate.mismatch_examples,
        "trajectories_version": lake.version("trajectories"),
        "receipts_version": lake.version("receipts"),
    }
    return summary

