"""A rollout worker: its share of the run through one harness, shipped as it goes.

Each worker (a process when ``workers > 1``) owns the groups ``k`` with
``k % workers == w``, runs them in waves of ``groups_per_wave`` through the
harness, and ships its spool to Delta in batches (app id = worker id,
transaction version = batch sequence). Task seeds, episode ids and sampling
seeds are functions of ``(run_id, seed, group, member)``, so a restarted
run knows exactly which episodes it owes.

Over-provisioning (``group_redundancy``): the plan holds ceil(N(1 + r))
groups; once this worker's share of N is complete (every member ended, none
cancelled, one policy version) the harness cancels the rest
(``Harness.cancel``) and no retry starts. Continuous mode (``follow``): when a
round's groups have all started, the next round's are planned (the next group
indices) and start as room frees, so the engine never waits for a round's
tail; SIGTERM / SIGINT, ``stop_file`` or ``rounds`` end it.

``_PolicyHolder`` serves the policy (and switches to a newer one when
following); ``run_worker`` feeds the harness the worker's groups
(pipeline/rollout/plan.py), resumes what is on record
(pipeline/rollout/recovery.py) and ships finished trajectories.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.rollout.engine import Sampling
from pipeline.rollout.plan import _retries, _worker_share, launched_groups, plan, retry_id
from pipeline.rollout.summary import RolloutSummary, _percentiles, bound_by

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake
    from pipeline.rollout.engine import Engine
    from pipeline.rollout.run import RolloutConfig


def _spool_dir(lake: Lake, cfg: RolloutConfig) -> Path:
    if cfg.spool_dir:
        return Path(cfg.spool_dir)
    base = Path(lake.uri) if lake.is_local else Path(os.environ.get("PIPELINE_CACHE",
                                                                    Path.home() / ".cache" / "pipeline"))
    return base / "_spool" / cfg.run_id


class _PolicyHolder:
    """The engine for the current policy; switches to a newer one when following.

    A switch loads the new weights into the running engine (``Engine.load_weights``:
    transformers ``load_state_dict``, vLLM's in-place weight reload) when the
    engine can and the architecture is unchanged; otherwise (or with
    ``weight_switch=rebuild``) it closes the engine and builds a new one. Each
    switch is timed (``switches``)."""

    def __init__(self, lake: Lake, cfg: RolloutConfig) -> None:
        self.lake, self.cfg = lake, cfg
        self.engine: Engine | None = None
        self.checkpoint_id: str | None = None
        self.version = 0
        self.versions: set[int] = set()
        self.codec = None       # the policy's tokenizer (pipeline/rollout/codec.py)
        self.switches: list[dict[str, Any]] = []
        self.env: Any = None    # the environment the codec renders (set by run_worker)

    def _resolve(self) -> tuple[Path, str | None, int]:
        from pipeline.policy_store import resolve_policy

        local = Path(self.cfg.policy)
        if not self.cfg.follow_latest and local.is_dir():
            # a user's HF directory (not published; counts as version 0)
            return (local if (local / "config.json").exists() else local / "hf"), str(local), 0
        ref = resolve_policy(self.lake, None if self.cfg.follow_latest or self.cfg.policy == "latest"
                             else self.cfg.policy)
        return Path(ref.hf_dir), ref.checkpoint_id, max(0, ref.policy_version)

    def newer(self) -> bool:
        """A newer policy is published than the one served (following only; reads the lake, switches nothing)."""
        return self.cfg.follow_latest and self.engine is not None and self._resolve()[1] != self.checkpoint_id

    def __call__(self):
        from pipeline.rollout import codec
        from pipeline.rollout.backends import make_engine, switch_weights

        if self.engine is None or self.cfg.follow_latest:
            hf_dir, ckpt, version = self._resolve()
            if ckpt != self.checkpoint_id:
                if self.engine is None:
                    self.engine = make_engine(self.cfg.engine, hf_dir, threads=self.cfg.threads)
                else:
                    deltas, read_s = None, 0.0
                    if self.cfg.weight_switch == "in_place" and ckpt is not None and self.checkpoint_id is not None:
                        from pipeline.policy_store.delta import delta_path

                        t0 = time.perf_counter()       # the deltas' reading counts in the switch's seconds
                        deltas = delta_path(self.lake, self.checkpoint_id, ckpt)
                        read_s = time.perf_counter() - t0
                    self.engine, rec = switch_weights(self.engine, hf_dir, mode=self.cfg.weight_switch,
                                                      threads=self.cfg.threads, deltas=deltas)
                    if rec["mode"] == "delta":
                        rec["seconds"] += read_s
                    self.switches.append(rec | {"version": version})
                self.codec = codec.load(hf_dir, env=self.env, render=self.cfg.render)
                self.checkpoint_id = ckpt
                self.version = version
        self.versions.add(self.version)
        return self.engine, self.version

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def run_worker(lake: Lake, cfg: RolloutConfig, worker: int, *, guard=None) -> RolloutSummary:
    """Run worker ``worker``'s share of the run. ``guard()`` is called before new
    groups start and before every shipment and raises when this worker may no
    longer write (its run's owner is gone or lost the lease).

    The harness streams: up to ``groups_per_wave`` groups are in flight, a new
    one starts as soon as there is room, failed members are retried as soon as
    they fail, and finished trajectories ship once ``flush_rows`` are waiting or
    the oldest has waited ``flush_seconds`` (``tick``), while the rest still run.
    With ``follow_latest`` a newer policy is taken between turns
    (``follow_every_turn``) or, otherwise, once the episodes in flight have
    finished (no new group starts meanwhile), so a trajectory keeps one version."""
    from pipeline.rollout.envs import get_env
    from pipeline.rollout.harness import Harness
    from pipeline.rollout.recovery import reconcile
    from pipeline.rollout.settings import Faults, Latency, Limits, Schedule
    from pipeline.rollout.spool import Spool, ship

    guard = guard or (lambda: None)
    t0 = time.perf_counter()
    worker_id = f"{cfg.run_id}/w{worker}"
    env = get_env(cfg.env, **({"tool_log": cfg.tool_log} if cfg.tool_log else {}))
    spool = Spool(_spool_dir(lake, cfg), worker_id, fsync=cfg.spool_fsync)
    holder = _PolicyHolder(lake, cfg)
    holder.env = env
    summary = RolloutSummary(cfg.run_id, cfg.env, cfg.engine, workers=cfg.workers, schedule=cfg.schedule)
    unshipped: list = []          # finished, not shipped yet (oldest first)
    ship_lag: list[float] = []

    door = None
    if cfg.ingest_url:   # the fleet's front door: publish to the lake's log, pipeline serve commits
        from pipeline.landing import connect
        from pipeline.rollout.spool import ship_log

        door = connect(cfg.ingest_url, stream=cfg.ingest_stream)

    def _ship() -> None:
        guard()
        _add_ship(summary, ship(lake, spool) if door is None else ship_log(door, spool))
        now = time.monotonic()
        ship_lag.extend((now - e.finished_mono) * 1000 for e in unshipped)
        unshipped.clear()

    durable = cfg.ship_before_tools == "always" or (cfg.ship_before_tools == "auto" and not env.idempotent)
    harness = Harness(env, holder, spool, run_id=cfg.run_id, worker_id=worker_id,
                      sampling=Sampling(cfg.temperature, cfg.top_p, cfg.max_tokens_per_turn),
                      limits=Limits(max_turns=cfg.max_turns, max_tokens_per_turn=cfg.max_tokens_per_turn,
                                    max_total_tokens=cfg.max_total_tokens, wall_clock_s=cfg.wall_clock_s,
                                    tool_timeout_s=cfg.tool_timeout_s, tool_concurrency=cfg.tool_concurrency,
                                    verify_timeout_s=cfg.verify_timeout_s,
                                    verifier_concurrency=cfg.verifier_concurrency,
                                    max_obs_tokens_per_turn=cfg.max_obs_tokens_per_turn,
                                    max_obs_tokens=cfg.max_obs_tokens, obs_keep=cfg.obs_keep),
                      faults=Faults(cfg.tool_timeout_p, cfg.env_crash_p, cfg.verifier_error_p,
                                    cfg.kill_after_executed, cfg.seed, cfg.hold_after_executed, cfg.hold_file),
                      follow_every_turn=cfg.follow_latest and cfg.follow_every_turn,
                      before_tools=_ship if durable else None,
                      schedule=Schedule(cfg.schedule, cfg.max_batch, cfg.max_wait_ms,
                                        cfg.groups_per_wave * cfg.group_size),
                      latency=Latency(cfg.tool_latency_ms, cfg.tool_latency_sigma, cfg.slow_tool_p,
                                      cfg.verifier_latency_ms, cfg.verifier_latency_sigma, cfg.slow_verifier_p,
                                      seed=cfg.seed))
    groups = plan(cfg, env, worker)
    rounds = [1]                    # continuous mode (``follow``): rounds planned so far
    stopping = [False]              # continuous mode: stop requested (SIGTERM / SIGINT / stop_file)
    # over-provisioning: the groups this worker needs complete (its share of `groups`); None = all of them
    need = _worker_share(cfg.groups, cfg.workers, worker) if cfg.group_redundancy > 0 else None

    def tasks_of(groups) -> dict:
        tasks = {eid: (task, gid, cfg.group_size) for _, gid, task, members in groups for eid, _ in members}
        for _, gid, task, _ in groups:         # possible retries: known ids, so a restart resumes them too
            tasks.update({retry_id(gid, n): (task, gid, cfg.group_size) for n in range(cfg.retry_group_budget)})
        return tasks

    state = reconcile(lake, cfg, tasks_of(groups), spool.records())
    budget = [_worker_share(cfg.retry_run_budget, cfg.workers, worker)
              - sum(1 for _, gid, _, _ in groups for n in range(cfg.retry_group_budget) if retry_id(gid, n) in state)]
    index = {gid: (k, task) for k, gid, task, _ in groups}
    todo = deque(groups)
    opened: dict[str, int] = {}     # group -> its episodes not yet terminal (this invocation)
    spoiled: set[str] = set()       # groups with a cancelled member or two policy versions
    versions: dict[str, set[int]] = {}
    complete = [0]
    if need is not None:            # groups complete on record (a restart): every member and retry ended
        for _, gid, _, members in groups:
            ids = [eid for eid, _ in members] + [retry_id(gid, n) for n in range(cfg.retry_group_budget)
                                                 if retry_id(gid, n) in state]
            if all(eid in state and state[eid] is None for eid in ids):
                complete[0] += 1
        harness.cancel_rest = complete[0] >= need
    started: list = []             # every episode this invocation runs (retries look up their group's)
    last_poll = [0.0]
    draining = [False]
    last_progress = [time.monotonic()]

    def group_items(group) -> list:
        """A group's episodes still owed: resumed ones (rebuilt) and (id, seed) of those never started."""
        _, gid, task, members = group
        items: list = []
        for n in range(cfg.retry_group_budget):     # retries started before a restart
            rid = retry_id(gid, n)
            if rid in state and state[rid] is not None:
                items.append(state[rid])
        for eid, seed in members:
            if eid in state and state[eid] is None:
                continue                            # finished before a restart
            items.append(state[eid] if eid in state else (eid, seed))
        return items

    def next_round() -> bool:
        """Continuous mode: plan the next round's groups (the next ``launched_groups`` indices).
        They start as soon as there is room, while the last round's tail still runs."""
        if not cfg.follow or stopping[0] or (cfg.rounds and rounds[0] >= cfg.rounds):
            return False
        if cfg.stop_file and os.path.exists(cfg.stop_file):
            stopping[0] = True
            return False
        more = plan(dataclasses.replace(cfg, group_offset=cfg.group_offset + rounds[0] * launched_groups(cfg)),
                    env, worker)
        rounds[0] += 1
        state.update(reconcile(lake, cfg, tasks_of(more), spool.records()))
        index.update({gid: (k, task) for k, gid, task, _ in more})
        todo.extend(more)
        return True

    def feed(free: int, active: int) -> list | None:
        out: list = []
        while todo or next_round():
            items = group_items(todo[0])
            if harness.cancel_rest:     # enough groups: only episodes a restart left half-done, to end them
                items = [w for w in items if not isinstance(w, tuple)]
            if not items:
                todo.popleft()
                continue
            if (active or out) and len(items) > free:
                break                               # no room for the whole group yet
            if holder.engine is None:
                holder()
            elif cfg.follow_latest and not cfg.follow_every_turn:
                if not (active or out):             # nothing in flight: switch now if there is a newer policy
                    draining[0] = False
                    if holder.newer():
                        holder()
                        harness.engine_changed = True
                elif draining[0]:
                    break
                elif time.monotonic() - last_poll[0] >= 1.0:
                    last_poll[0] = time.monotonic()
                    if holder.newer():              # let the episodes in flight finish on their version first
                        draining[0] = True
                        break
            guard()
            _, gid, task, _ = todo.popleft()
            version = holder.version
            harness.codec = holder.codec            # prompts and observations in the policy's tokenizer
            for w in items:
                if isinstance(w, tuple):
                    w = harness.new_episode(episode_id=w[0], group_id=gid, group_size=cfg.group_size, task=task,
                                            seed=w[1], policy_version=version)
                else:
                    summary.resumed += 1
                out.append(w)
                versions.setdefault(gid, set()).add(w.policy_version)
            opened[gid] = opened.get(gid, 0) + len(items)
            free -= len(items)
        started.extend(out)
        return out if out or todo else None

    def on_finish(ep) -> list:
        unshipped.append(ep)
        if harness.cancel_rest:
            return []                               # the run has its groups: no retries
        extra, budget[0] = _retries(cfg, harness, lambda: (None, holder.version), {ep.group_id: index[ep.group_id]},
                                    state, [ep], started, budget[0], summary)
        started.extend(extra)
        if need is not None:
            _group_progress(ep, extra)
        return extra

    def _group_progress(ep, extra: list) -> None:
        """Over-provisioning: count a group complete once all its episodes ended (none
        cancelled, one policy version); with enough, the rest are cancelled."""
        gid = ep.group_id
        opened[gid] = opened.get(gid, 0) - 1 + len(extra)
        versions.setdefault(gid, set()).update(e.policy_version for e in extra)
        if ep.stop_reason == "cancelled" or len(versions.get(gid, ())) > 1:
            spoiled.add(gid)
        if opened[gid] == 0 and gid not in spoiled:
            complete[0] += 1
            if need is not None and complete[0] >= need:
                harness.cancel_rest = True

    def tick() -> None:
        now = time.monotonic()
        if unshipped and (len(unshipped) >= cfg.flush_rows or now - unshipped[0].finished_mono >= cfg.flush_seconds):
            _ship()
        if cfg.progress and now - last_progress[0] >= 5.0:
            last_progress[0] = now
            print(f"[{worker_id}] {len(started) - harness_active()} of {len(started)} trajectories finished, "
                  f"policy v{holder.version}, {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    def harness_active() -> int:
        return sum(1 for e in started if not e.done)

    holder()                       # the engine starts before the clock of rolling out does
    harness.codec = holder.codec
    restore = _stop_on_signals(stopping) if cfg.follow else {}
    t_run = time.perf_counter()
    try:
        harness.run([], feed=feed, on_finish=on_finish, tick=tick)
    finally:
        for sig, handler in restore.items():
            signal.signal(sig, handler)
    summary.rollout_seconds = time.perf_counter() - t_run
    summary.rounds = rounds[0]
    _ship()
    spool.close()
    if door is not None:
        door.close()
    holder.close()
    finished = started
    summary.trajectories = len(finished)
    summary.statuses = dict(Counter(e.status for e in finished))
    summary.verdicts = dict(Counter(e.verdict for e in finished))
    rewards = [e.reward for e in finished if e.reward is not None]
    summary.reward_mean = sum(rewards) / len(rewards) if rewards else None
    judged = [e for e in finished if e.verdict in ("PASS", "FAIL")]
    summary.success_rate = sum(e.verdict == "PASS" for e in judged) / len(judged) if judged else None
    summary.generated_tokens = sum(sum(e.mask) for e in finished)
    summary.policy_versions = sorted(holder.versions)
    summary.tool_executions = harness.tool_executions
    summary.cancelled = harness.cancelled
    summary.groups_complete = complete[0] if need is not None else None
    summary.pool_bounds = dict(harness.pool_bounds)
    summary.pool_wait_s = harness.stats.pool_wait_s()
    summary.bound_by = bound_by(harness.stats.busy_s, summary.pool_wait_s)
    summary.tools_abandoned = harness.tools_abandoned
    summary.verifiers_abandoned = harness.verifiers_abandoned
    summary.engine_busy_s = harness.stats.busy_s
    summary.engine_steps = harness.stats.steps
    summary.engine_busy_share = harness.stats.busy_s / summary.rollout_seconds if summary.rollout_seconds else 0.0
    summary.samples = {k: list(v) for k, v in harness.stats.samples.items()} | {"ship": ship_lag}
    summary.waits_ms = _percentiles(summary.samples)
    summary.weight_switches = list(holder.switches)
    summary.seconds = time.perf_counter() - t0
    summary.tokens_per_s = summary.generated_tokens / summary.rollout_seconds if summary.rollout_seconds else 0.0
    return summary


def _stop_on_signals(stopping: list[bool]) -> dict:
    """Continuous mode: SIGTERM / SIGINT stop new groups from starting; the episodes in
    flight finish and ship, and the run returns. Only in the main thread (where signal
    handlers live); returns the handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum, frame) -> None:
        stopping[0] = True

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}


def _add_ship(summary: RolloutSummary, rep) -> None:
    summary.landed += rep.trajectories
    summary.events += rep.events
    summary.quarantined += rep.quarantined
