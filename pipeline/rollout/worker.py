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
tail; SIGTERM / SIGINT, ``stop_file`` or ``rounds`` end it. Both together
(``straggler_policy=carry``): a round closes at its N complete groups and its
episodes still running are carried on as partial rollouts (never cancelled
mid-run, never holding a newer policy back, so their later tokens carry its
version); once every round of ``rounds`` has closed, what still runs is
cancelled. Which groups are complete, which rounds closed and which episodes
are carried is the worker's ``GroupLedger`` (pipeline/rollout/rounds.py).

``PolicyHolder`` serves the policy (and switches to a newer one when
following); ``run_worker`` (a ``WorkerRun``) feeds the harness the worker's groups
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
from typing import TYPE_CHECKING, Any, Callable

from pipeline.rollout.engine import Sampling
from pipeline.rollout.plan import launched_groups, plan, plan_retries, retry_id, worker_share
from pipeline.rollout.rounds import GroupLedger
from pipeline.rollout.summary import RolloutSummary, bound_by, percentiles

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake
    from pipeline.rollout.engine import Engine
    from pipeline.rollout.episode import Episode
    from pipeline.rollout.harness import Harness
    from pipeline.rollout.config import RolloutConfig


class PolicyHolder:
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

    def _resolve(self, spec: str | None = None, *, weights: bool = True) -> tuple[Path, str | None, int]:
        """(hf dir, checkpoint id, version) of the policy served, or of checkpoint ``spec``.
        ``weights=False``: a delta-only version's own ``hf/`` (config and tokenizer), its
        full weights not rebuilt (resolve_policy's ``weights``)."""
        from pipeline.policy_store import resolve_policy

        local = Path(self.cfg.policy)
        if spec is None and not self.cfg.follow_latest and local.is_dir():
            # a user's HF directory (not published; counts as version 0)
            return (local if (local / "config.json").exists() else local / "hf"), str(local), 0
        if spec is None and not self.cfg.follow_latest and self.cfg.policy != "latest":
            spec = self.cfg.policy
        ref = resolve_policy(self.lake, spec, weights=weights)
        return Path(ref.hf_dir), ref.checkpoint_id, max(0, ref.policy_version)

    def newer(self) -> bool:
        """A newer policy is published than the one served (following only; reads the lake, switches nothing)."""
        return (self.cfg.follow_latest and self.engine is not None
                and self._resolve(weights=False)[1] != self.checkpoint_id)

    def __call__(self):
        from pipeline.rollout import codec
        from pipeline.rollout.backends import make_engine, switch_weights

        if self.engine is None or self.cfg.follow_latest:
            # a running engine switching in place is given the new version's deltas: its full
            # weights (rebuilt from the chain in the delta-only layout) are resolved only if they do not apply
            lazy = self.engine is not None and self.cfg.weight_switch == "in_place"
            hf_dir, ckpt, version = self._resolve(weights=not lazy)
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
                    self.engine, rec = switch_weights(
                        self.engine, hf_dir, mode=self.cfg.weight_switch, threads=self.cfg.threads, deltas=deltas,
                        full_dir=(lambda: self._resolve(ckpt)[0]) if lazy and ckpt is not None else None)
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
    return WorkerRun(lake, cfg, worker, guard=guard or (lambda: None)).run()


def make_harness(cfg: RolloutConfig, env: Any, holder: PolicyHolder, spool: Any, worker_id: str,
                 before_tools: Callable[[], Any] | None) -> Harness:
    """The harness a worker drives, its settings taken from ``cfg``."""
    from pipeline.rollout.harness import Harness
    from pipeline.rollout.settings import Faults, Latency, Limits, Schedule

    return Harness(env, holder, spool, run_id=cfg.run_id, worker_id=worker_id,
                   sampling=Sampling(cfg.temperature, cfg.top_p, cfg.max_tokens_per_turn),
                   limits=Limits(max_turns=cfg.max_turns, max_tokens_per_turn=cfg.max_tokens_per_turn,
                                 max_total_tokens=cfg.max_total_tokens, wall_clock_s=cfg.wall_clock_s,
                                 tool_timeout_s=cfg.tool_timeout_s, tool_concurrency=cfg.tool_concurrency,
                                 verify_timeout_s=cfg.verify_timeout_s,
                                 verifier_concurrency=cfg.verifier_concurrency,
                                 max_obs_tokens_per_turn=cfg.max_obs_tokens_per_turn,
                                 max_obs_tokens=cfg.max_obs_tokens, obs_keep=cfg.obs_keep),
                   faults=Faults(tool_timeout=cfg.tool_timeout_p, env_crash=cfg.env_crash_p,
                                 verifier_error=cfg.verifier_error_p, kill_after_executed=cfg.kill_after_executed,
                                 seed=cfg.seed, hold_after_executed=cfg.hold_after_executed,
                                 hold_file=cfg.hold_file),
                   follow_every_turn=cfg.follow_latest and cfg.follow_every_turn,
                   before_tools=before_tools,
                   schedule=Schedule(cfg.schedule, cfg.max_batch, cfg.max_wait_ms,
                                     cfg.groups_per_wave * cfg.group_size),
                   latency=Latency(tool_ms=cfg.tool_latency_ms, tool_sigma=cfg.tool_latency_sigma,
                                   slow_tool_p=cfg.slow_tool_p, verifier_ms=cfg.verifier_latency_ms,
                                   verifier_sigma=cfg.verifier_latency_sigma, slow_verifier_p=cfg.slow_verifier_p,
                                   seed=cfg.seed))


class WorkerRun:
    """One invocation of a worker (``run_worker``): the harness it drives, the groups
    it owes (``plan``, resumed from the record by ``reconcile``) and what it feeds the
    harness (``feed``), does with each finished episode (``on_finish``: retries,
    over-provisioning's group count) and at every turn of the loop (``tick``: ship)."""

    def __init__(self, lake: Lake, cfg: RolloutConfig, worker: int, *, guard: Callable[[], None]) -> None:
        from pipeline.rollout.envs import get_env
        from pipeline.rollout.recovery import reconcile
        from pipeline.rollout.spool import Spool, run_spool_dir

        self.lake, self.cfg, self.worker, self.guard = lake, cfg, worker, guard
        self.t0 = time.perf_counter()
        self.worker_id = f"{cfg.run_id}/w{worker}"
        self.env = env = get_env(cfg.env, **({"tool_log": cfg.tool_log} if cfg.tool_log else {}))
        self.spool = Spool(run_spool_dir(lake, cfg), self.worker_id, fsync=cfg.spool_fsync)
        self.holder = PolicyHolder(lake, cfg)
        self.holder.env = env
        self.summary = RolloutSummary(cfg.run_id, cfg.env, cfg.engine, workers=cfg.workers, schedule=cfg.schedule)
        self.unshipped: list[Episode] = []      # finished, not shipped yet (oldest first)
        self.ship_lag: list[float] = []
        self.door = None
        if cfg.ingest_url:   # the fleet's front door: publish to the lake's log, pipeline serve commits
            from pipeline.landing import connect

            self.door = connect(cfg.ingest_url, stream=cfg.ingest_stream)
        durable = cfg.ship_before_tools == "always" or (cfg.ship_before_tools == "auto" and not env.idempotent)
        self.harness = make_harness(cfg, env, self.holder, self.spool, self.worker_id,
                                    self.ship if durable else None)
        groups = plan(cfg, env, worker)
        self.rounds = 1                 # continuous mode (``follow``): rounds planned so far
        self.stopping = False           # continuous mode: stop requested (SIGTERM / SIGINT / stop_file)
        self.state = reconcile(lake, cfg, self.tasks_of(groups), self.spool.records())
        self.budget = (worker_share(cfg.retry_run_budget, cfg.workers, worker)
                       - sum(1 for _, gid, _, _ in groups for n in range(cfg.retry_group_budget)
                             if retry_id(gid, n) in self.state))
        self.index = {gid: (k, task) for k, gid, task, _ in groups}
        self.todo = deque(groups)
        self.ledger = GroupLedger(cfg, worker, cancel=self.cancel_rest)
        self.switch_from: str | None = None     # carry: a switch the scheduler makes between requests
        self.started: list[Episode] = []        # every episode this invocation runs (retries look up their group's)
        self.last_poll = 0.0
        self.draining = False
        self.last_progress = time.monotonic()
        self.ledger.add_groups(groups, self.state)

    def cancel_rest(self) -> None:
        """The run has the groups it needs (``GroupLedger``): the harness ends what still runs."""
        self.harness.cancel_rest = True

    # -- shipping ----------------------------------------------------------------------------
    def ship(self) -> None:
        from pipeline.rollout.spool import ship, ship_log

        self.guard()
        _add_ship(self.summary, ship(self.lake, self.spool) if self.door is None else ship_log(self.door, self.spool))
        now = time.monotonic()
        self.ship_lag.extend((now - e.finished_mono) * 1000 for e in self.unshipped)
        self.unshipped.clear()

    def tick(self) -> None:
        cfg = self.cfg
        now = time.monotonic()
        if self.unshipped and (len(self.unshipped) >= cfg.flush_rows
                               or now - self.unshipped[0].finished_mono >= cfg.flush_seconds):
            self.ship()
        if cfg.progress and now - self.last_progress >= 5.0:
            self.last_progress = now
            active = sum(1 for e in self.started if not e.done)
            print(f"[{self.worker_id}] {len(self.started) - active} of {len(self.started)} trajectories finished, "
                  f"policy v{self.holder.version}, {time.perf_counter() - self.t0:.1f}s", file=sys.stderr, flush=True)

    # -- the groups owed -----------------------------------------------------------------------
    def tasks_of(self, groups) -> dict:
        cfg = self.cfg
        tasks = {eid: (task, gid, cfg.group_size) for _, gid, task, members in groups for eid, _ in members}
        for _, gid, task, _ in groups:         # possible retries: known ids, so a restart resumes them too
            tasks.update({retry_id(gid, n): (task, gid, cfg.group_size) for n in range(cfg.retry_group_budget)})
        return tasks

    def group_items(self, group) -> list:
        """A group's episodes still owed: resumed ones (rebuilt) and (id, seed) of those never started."""
        _, gid, task, members = group
        items: list = []
        for n in range(self.cfg.retry_group_budget):     # retries started before a restart
            rid = retry_id(gid, n)
            if rid in self.state and self.state[rid] is not None:
                items.append(self.state[rid])
        for eid, seed in members:
            if eid in self.state and self.state[eid] is None:
                continue                            # finished before a restart
            items.append(self.state[eid] if eid in self.state else (eid, seed))
        return items

    def next_round(self) -> bool:
        """Continuous mode: plan the next round's groups (the next ``launched_groups`` indices).
        They start as soon as there is room, while the last round's tail still runs."""
        from pipeline.rollout.recovery import reconcile

        cfg = self.cfg
        if not cfg.follow or self.stopping or (cfg.rounds and self.rounds >= cfg.rounds):
            return False
        if cfg.stop_file and os.path.exists(cfg.stop_file):
            self.stopping = True
            return False
        more = plan(dataclasses.replace(cfg, group_offset=cfg.group_offset + self.rounds * launched_groups(cfg)),
                    self.env, self.worker)
        self.rounds += 1
        self.state.update(reconcile(self.lake, cfg, self.tasks_of(more), self.spool.records()))
        self.index.update({gid: (k, task) for k, gid, task, _ in more})
        self.todo.extend(more)
        self.ledger.add_groups(more, self.state)
        return True

    # -- what the harness asks -------------------------------------------------------------------
    def feed(self, free: int, active: int) -> list | None:
        cfg, harness, holder = self.cfg, self.harness, self.holder
        out: list = []
        while self.todo or self.next_round():
            items = self.group_items(self.todo[0])
            if harness.cancel_rest or self.ledger.closed_group(self.todo[0][1]):
                # enough groups: only episodes a restart left half-done, to end (or carry) them
                items = [w for w in items if not isinstance(w, tuple)]
            if not items:
                self.todo.popleft()
                continue
            if (active or out) and len(items) > free:
                break                               # no room for the whole group yet
            if not self._policy_ready(bool(active or out)):
                break
            self.guard()
            _, gid, task, _ = self.todo.popleft()
            version = holder.version
            harness.codec = holder.codec            # prompts and observations in the policy's tokenizer
            for w in items:
                if isinstance(w, tuple):
                    w = harness.new_episode(episode_id=w[0], group_id=gid, group_size=cfg.group_size, task=task,
                                            seed=w[1], policy_version=version)
                else:
                    self.summary.resumed += 1
                out.append(w)
                self.ledger.started(w)
            free -= len(items)
        self.started.extend(out)
        return out if out or self.todo else None

    def _policy_ready(self, busy: bool) -> bool:
        """Before a group starts: the engine is up, and (following a newer policy between
        episodes) no switch is pending. False: start nothing now (the episodes in flight
        finish on their version first)."""
        cfg, holder = self.cfg, self.holder
        if holder.engine is None:
            holder()
        elif cfg.follow_latest and not cfg.follow_every_turn and self.ledger.carry:
            return self._carry_ready(busy)
        elif cfg.follow_latest and not cfg.follow_every_turn:
            if not busy:                            # nothing in flight: switch now if there is a newer policy
                self.draining = False
                if holder.newer():
                    holder()
                    self.harness.engine_changed = True
            elif self.draining:
                return False
            elif time.monotonic() - self.last_poll >= 1.0:
                self.last_poll = time.monotonic()
                if holder.newer():                  # let the episodes in flight finish on their version first
                    self.draining = True
                    return False
        return True

    def _carry_ready(self, busy: bool) -> bool:
        """``_policy_ready`` under straggler_policy=carry: only the episodes that must keep one
        version (``live``: of rounds still open) hold a newer policy back; carried ones go on
        under it. A batch engine switches at once (nothing generates between its steps); a
        continuous one is switched by the scheduler between requests (``engine_changed``)."""
        holder = self.holder
        if self.switch_from is not None:            # the scheduler's switch is still to come
            if holder.checkpoint_id == self.switch_from:
                return False
            self.switch_from = None
        if self.ledger.live:
            if not self.draining and self._poll_newer():
                self.draining = True                # let the live episodes finish on their version first
            return not self.draining
        if not (self.draining or (self._poll_newer() if busy else holder.newer())):
            return True
        self.draining = False
        if busy and hasattr(holder.engine, "add_request") and self.cfg.schedule != "waves":
            self.switch_from = holder.checkpoint_id   # carried requests may be running: between requests
            self.harness.engine_changed = True
            return False
        holder()
        self.harness.engine_changed = True
        return True

    def _poll_newer(self) -> bool:
        """A newer policy is published (reads the lake at most once a second)."""
        if time.monotonic() - self.last_poll < 1.0:
            return False
        self.last_poll = time.monotonic()
        return self.holder.newer()

    def on_finish(self, ep: Episode) -> list:
        self.unshipped.append(ep)
        self.ledger.ended(ep)
        if self.harness.cancel_rest:
            return []                               # the run has its groups: no retries
        extra, self.budget = plan_retries(self.cfg, self.harness, lambda: (None, self.holder.version),
                                          {ep.group_id: self.index[ep.group_id]}, self.state, [ep], self.started,
                                          self.budget, self.summary)
        self.started.extend(extra)
        for e in extra:
            self.ledger.started(e)
        if self.ledger.need is not None:
            self.ledger.progress(ep)
        return extra

    # -- the run -----------------------------------------------------------------------------
    def run(self) -> RolloutSummary:
        self.holder()                  # the engine starts before the clock of rolling out does
        self.harness.codec = self.holder.codec
        restore = _stop_on_signals(self.stop) if self.cfg.follow else {}
        t_run = time.perf_counter()
        try:
            self.harness.run([], feed=self.feed, on_finish=self.on_finish, tick=self.tick)
        finally:
            for sig, handler in restore.items():
                signal.signal(sig, handler)
        self.summary.rollout_seconds = time.perf_counter() - t_run
        self.summary.rounds = self.rounds
        self.ship()
        self.spool.close()
        if self.door is not None:
            self.door.close()
        self.holder.close()
        return self.summarize()

    def stop(self) -> None:
        """Continuous mode: start no new group (SIGTERM / SIGINT); the episodes in flight finish."""
        self.stopping = True

    def summarize(self) -> RolloutSummary:
        summary, harness, finished = self.summary, self.harness, self.started
        summary.trajectories = len(finished)
        summary.statuses = dict(Counter(e.status for e in finished if e.status is not None))   # all are terminal
        summary.verdicts = dict(Counter(e.verdict for e in finished if e.verdict is not None))
        rewards = [e.reward for e in finished if e.reward is not None]
        summary.reward_mean = sum(rewards) / len(rewards) if rewards else None
        judged = [e for e in finished if e.verdict in ("PASS", "FAIL")]
        summary.success_rate = sum(e.verdict == "PASS" for e in judged) / len(judged) if judged else None
        summary.generated_tokens = sum(sum(e.mask) for e in finished)
        summary.policy_versions = sorted(self.holder.versions)
        summary.tool_executions = harness.tool_executions
        summary.cancelled = harness.cancelled
        summary.carried = len(self.ledger.carried)
        summary.groups_complete = self.ledger.complete if self.ledger.need is not None else None
        summary.pool_bounds = dict(harness.pool_bounds)
        summary.pool_wait_s = harness.stats.pool_wait_s()
        summary.bound_by = bound_by(harness.stats.busy_s, summary.pool_wait_s)
        summary.tools_abandoned = harness.tools_abandoned
        summary.verifiers_abandoned = harness.verifiers_abandoned
        summary.engine_busy_s = harness.stats.busy_s
        summary.engine_steps = harness.stats.steps
        summary.engine_busy_share = harness.stats.busy_s / summary.rollout_seconds if summary.rollout_seconds else 0.0
        summary.samples = {k: list(v) for k, v in harness.stats.samples.items()} | {"ship": self.ship_lag}
        summary.waits_ms = percentiles(summary.samples)
        summary.weight_switches = list(self.holder.switches)
        summary.seconds = time.perf_counter() - self.t0
        summary.tokens_per_s = summary.generated_tokens / summary.rollout_seconds if summary.rollout_seconds else 0.0
        return summary


def _stop_on_signals(stop: Callable[[], None]) -> dict:
    """Continuous mode: SIGTERM / SIGINT stop new groups from starting; the episodes in
    flight finish and ship, and the run returns. Only in the main thread (where signal
    handlers live); returns the handlers to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame) -> None:
        stop()

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def _add_ship(summary: RolloutSummary, rep) -> None:
    summary.landed += rep.trajectories
    summary.events += rep.events
    summary.quarantined += rep.quarantined
