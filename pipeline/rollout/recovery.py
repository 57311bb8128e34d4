"""Recovery: the state of a worker's planned episodes from what is on record.

A restarted worker rebuilds its episodes from its event records (``resume``): an
action with ACTION_EXECUTED but no OBSERVATION_PERSISTED gets its observation
from the recorded output and the tool is *not* called again; an action that
was committed but never confirmed is re-run only when the environment declares
its tools idempotent, otherwise the episode ends INFRA_FAILED.

Recovery is per run, not per worker: the new owner first ships every spool
left in the run's spool directory (any worker id, any former ``--workers``),
then each worker rebuilds its episodes from the run's events in the lake and
the landed trajectory ids, so a rerun with any ``--workers`` resumes every
unfinished episode once. An action the lake records as executed is never
re-run; one committed with unknown outcome follows the environment's
``idempotent``. With a non-idempotent environment the worker ships its
committed actions before running the tools (``ship_before_tools``), so even a
lost spool leaves every possibly-executed action on record (docs/drills.md,
drills 4 and 5).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pipeline.rollout.envs import Task
from pipeline.rollout.episode import Episode

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.rollout.config import RolloutConfig


def rebuild(records: list[dict[str, Any]], tasks: dict[str, tuple[Task, str, int]]) -> dict[str, Episode | None]:
    """Episodes from their event records (spool lines and/or lake rows, any order,
    duplicates allowed). ``tasks``: episode_id -> (task, group_id, group_size),
    the deterministic plan. Returns episode_id -> Episode (unfinished) or None
    (finished: its TERMINAL event is recorded)."""
    by_ep: dict[str, dict[tuple, dict[str, Any]]] = {}
    for r in records:
        if r.get("kind", "event") != "event":
            continue
        key = (r["step_id"], r["action_id"], r["event_type"])
        by_ep.setdefault(r["episode_id"], {}).setdefault(key, r)
    order = {t: i for i, t in enumerate(["CREATED", "GENERATING", "ACTION_COMMITTED", "TOOL_WAITING",
                                         "ACTION_EXECUTED", "OBSERVATION_PERSISTED", "VERIFYING", "TERMINAL"])}
    out: dict[str, Episode | None] = {}
    for eid, evs in by_ep.items():
        if eid not in tasks:
            continue
        if any(k[2] == "TERMINAL" for k in evs):
            out[eid] = None
            continue
        rows = sorted(evs.values(), key=lambda r: (r["step_id"], order[r["event_type"]]))
        task, group_id, group_size = tasks[eid]
        created = next((r for r in rows if r["event_type"] == "CREATED"), None)
        if created is None:
            continue
        cp = json.loads(created["payload"])
        ep = Episode(episode_id=eid, group_id=group_id, group_size=group_size, task=task, seed=int(cp["seed"]),
                     prompt_ids=list(cp["prompt_ids"]), policy_version=int(created["policy_version"]))
        ep.written = set(evs)
        ep.env_state_hash = cp.get("env_state_hash")
        executed: list[str] = []           # a stateful episode's executed actions, re-applied on restore
        ep.created_at = datetime.fromisoformat(created["created_at"]) if isinstance(created["created_at"], str) \
            else created["created_at"]
        for r in rows:
            p = json.loads(r["payload"]) if r.get("payload") else {}
            et = r["event_type"]
            if et == "GENERATING" and p.get("turn") == 0:
                ep.policy_version = int(r["policy_version"])
            if et in ("ACTION_COMMITTED", "VERIFYING"):
                ep.response_ids += p["ids"]
                ep.logprobs += p["logprobs"]
                ep.mask += [1] * len(p["ids"])
                ep.token_versions += [int(p["version"])] * len(p["ids"])
                ep.turns = p["turn"] + 1
            if et == "ACTION_COMMITTED":
                ep.pending = {"action_id": r["action_id"], "text": p["args"], "step": r["step_id"],
                              "unconfirmed": True}
                ep.state = "TOOL_WAITING"
            elif et == "TOOL_WAITING" and ep.pending is not None:
                ep.pending["waiting"] = True
            elif et == "ACTION_EXECUTED" and ep.pending is not None:
                ep.pending["output"] = p["output"]
                executed.append(ep.pending["text"])
            elif et == "OBSERVATION_PERSISTED":
                ep.response_ids += p["obs"]
                ep.logprobs += [0.0] * len(p["obs"])
                ep.mask += [0] * len(p["obs"])
                ep.token_versions += [-1] * len(p["obs"])
                ep.tool_calls += 1
                ep.pending = None
                ep.state = "GENERATING"
            elif et == "VERIFYING":
                ep.final_turn = list(p["ids"])
                ep.state = "VERIFYING"
        if ep.state == "CREATED" or (ep.state == "GENERATING" and ep.pending is None):
            ep.state = "GENERATING" if ep.turns else "CREATED"
        ep.replay = executed if ep.env_state_hash is not None else None
        out[eid] = ep
    return out


def reconcile(lake: Lake, cfg: RolloutConfig, tasks: dict[str, Any], spool_records: list[dict[str, Any]]) -> dict:
    """The state of this worker's planned episodes (``tasks``) from everything on
    record for the run: its spool, the run's events in the lake (whichever worker
    shipped them) and the trajectory ids already landed (an episode whose row
    landed is finished even when its last events were lost with a spool)."""
    import pyarrow.dataset as ds

    records = list(spool_records)
    ids = list(tasks)
    if ids and lake.exists("events"):
        shipped = lake.read("events", filter=(ds.field("run_id") == cfg.run_id) & ds.field("episode_id").isin(ids))
        records = shipped.to_pylist() + records
    state = rebuild(records, tasks) if records else {}
    if ids and lake.exists("trajectories"):
        landed = lake.read("trajectories", columns=["trajectory_id"],
                           filter=(ds.field("run_id") == cfg.run_id) & ds.field("trajectory_id").isin(ids))
        for tid in landed.column("trajectory_id").to_pylist():
            state[tid] = None
    return state
