"""The event loop: rollout workers, the trainer, weight sync, failures, admission.

A heap of ``(time, seq, kind, a, b)`` events; ``seq`` breaks ties in creation
order, so a seed gives one exact run. The model, in one paragraph:

- A *group* is one task sampled ``group_size`` times; its members are jobs in a
  FIFO queue, picked up by free workers. A member's duration is lognormal for
  its task class; it may die of an infrastructure fault part-way
  (INFRA_FAILED) or hit ``max_trajectory_s`` (EXPIRED). A worker samples the
  whole trajectory with the policy version it had when it started it.
- A group is *complete* when every member is terminal; complete groups wait
  for the next admission run, which decides all of them at once with
  ``current_policy_version`` = the trainer's latest published version.
- async: workers keep generating (up to ``max_outstanding_groups`` groups in
  the system); the trainer takes ``batch_groups`` admitted groups per step,
  runs admission when it is short of them (at most every
  ``admission_interval_s``) and otherwise waits (idle).
- sync: the trainer dispatches ``batch_groups`` groups with version v, waits
  for all of them, runs admission, trains on what was admitted and publishes
  v+1; workers idle meanwhile.
- A step takes ``trainer_step_s``; the new version is published
  ``weight_sync_s`` later (the trainer is blocked during the sync).

Per-trajectory records are plain lists indexed by trajectory index (members of
group g are ``g*G .. g*G+G-1``); metrics.py turns them into the summary.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections import deque
from typing import Any

import numpy as np

from pipeline.sim.config import SimConfig
from pipeline.sim.gate import ACCEPTED, EXPIRED, INFRA_FAILED, FreshnessGate, Gate, GateRules

# event kinds
DONE, CRASH, RESTART, STEP_END, PUBLISH, ADMIT_TICK = range(6)

NAN = float("nan")


class Draws:
    """Uniform and standard-normal numbers drawn from the generator in blocks
    (one numpy call per 64k numbers instead of several per group)."""

    BLOCK = 1 << 16

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self._u: list[float] = []
        self._ui = 0
        self._z: list[float] = []
        self._zi = 0

    def uniform(self, k: int) -> list[float]:
        if self._ui + k > len(self._u):
            self._u = self._u[self._ui:] + self.rng.random(max(self.BLOCK, k)).tolist()
            self._ui = 0
        out = self._u[self._ui:self._ui + k]
        self._ui += k
        return out

    def normal(self, k: int) -> list[float]:
        if self._zi + k > len(self._z):
            self._z = self._z[self._zi:] + self.rng.standard_normal(max(self.BLOCK, k)).tolist()
            self._zi = 0
        out = self._z[self._zi:self._zi + k]
        self._zi += k
        return out


def rules_of(cfg: SimConfig) -> GateRules:
    return GateRules(max_policy_lag=cfg.max_policy_lag, max_queue_wait_ms=cfg.max_queue_wait_ms,
                     min_valid_members=cfg.min_valid_members, min_reward_std=cfg.min_reward_std)


class Simulation:
    def __init__(self, cfg: SimConfig, gate: Gate | None = None) -> None:
        self.cfg = cfg
        self.gate: Gate = gate if gate is not None else FreshnessGate(rules_of(cfg))
        self.rng = np.random.default_rng(cfg.seed)
        self.classes = cfg.classes()
        w = np.array([c.weight for c in self.classes], float)
        cum = np.cumsum(w / w.sum())
        cum[-1] = 1.0
        self._cum_list = cum.tolist()
        self._draws = Draws(self.rng)
        # crashes draw from their own stream: sweeping the crash rate keeps the task draws identical
        self.crash_rng = np.random.default_rng([cfg.seed, 1])
        self._mu = [math.log(c.median_s) for c in self.classes]
        self.G = cfg.group_size
        self.end_time = cfg.duration_s
        self.now = 0.0
        self.events = 0
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        # per group
        self.g_class: list[int] = []
        self.g_task: list[int] = []
        self.g_created: list[float] = []
        self.g_complete: list[float] = []
        self.g_left: list[int] = []           # members not yet terminal
        self.g_decision: list[str | None] = []
        self.g_decided_at: list[float] = []
        self.g_trained_version: list[int] = []  # version the trainer held when it trained the group (-1: not)
        # per trajectory
        self.duration: list[float] = []       # drawn run time if nothing fails
        self.fail_at: list[float] = []        # fraction of duration at which an infra fault hits (nan: none)
        self.reward: list[float | None] = []
        self.version: list[int] = []          # behaviour policy version (-1: not started)
        self.worker: list[int] = []
        self.start: list[float] = []
        self.end: list[float] = []
        self.status: list[str | None] = []
        self.reason: list[str | None] = []    # admission: "" valid, else exclusion reason
        self.decided_version: list[int] = []  # current_policy_version at the decision
        # workers
        n = cfg.workers
        self.w_busy: list[int] = [-1] * n     # trajectory index or -1
        self.w_epoch: list[int] = [0] * n     # bumps on crash: stale DONE events are ignored
        self.w_down: list[bool] = [False] * n
        self.w_in_free: list[bool] = [True] * n
        self.free: deque[int] = deque(range(n))
        self.jobs: deque[int] = deque()
        # trainer
        self.policy_version = 0               # latest published
        self.visible_version = 0              # what workers sample with
        self.trainer_state = "idle"           # idle | training | syncing
        self.idle_since = 0.0
        self.trainer_idle_s = 0.0
        self.trainer_train_s = 0.0
        self.trainer_sync_s = 0.0
        self.steps = 0
        self.trained_groups: list[list[int]] = []   # groups per step
        self.ready: list[int] = []            # complete, undecided groups (FIFO)
        self.train_buf: deque[int] = deque()  # admitted, not yet trained
        self.outstanding = 0                  # groups created and not yet rejected or trained
        self.last_admission = -math.inf
        self.tick_pending = False
        self.admission_runs = 0
        self.sync_batch_left = 0
        self.wall_s = 0.0

    # -- plumbing -------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def members(self, g: int) -> range:
        return range(g * self.G, (g + 1) * self.G)

    # -- groups and workers -----------------------------------------------------------
    def _new_group(self) -> int:
        G, draws = self.G, self._draws
        g = len(self.g_class)
        u = draws.uniform(2 + 3 * G)      # class, task, then per member: fault?, fault point, reward
        z = draws.normal(G)               # per member: duration
        c = bisect.bisect_right(self._cum_list, u[0])
        c = min(c, len(self.classes) - 1)
        tc = self.classes[c]
        mu, sigma, rate, p = self._mu[c], tc.sigma, self.cfg.infra_failure_rate, tc.pass_rate
        self.g_class.append(c)
        self.g_task.append(int(u[1] * tc.n_tasks))
        self.g_created.append(self.now)
        self.g_complete.append(NAN)
        self.g_left.append(G)
        self.g_decision.append(None)
        self.g_decided_at.append(NAN)
        self.g_trained_version.append(-1)
        exp = math.exp
        self.duration.extend([exp(mu + sigma * zk) for zk in z] if sigma > 0 else [tc.median_s] * G)
        self.fail_at.extend([u[3 + 3 * k] if u[2 + 3 * k] < rate else NAN for k in range(G)])
        self.reward.extend([1.0 if u[4 + 3 * k] < p else 0.0 for k in range(G)])
        self.version.extend([-1] * G)
        self.worker.extend([-1] * G)
        self.start.extend([NAN] * G)
        self.end.extend([NAN] * G)
        self.status.extend([None] * G)
        self.reason.extend([None] * G)
        self.decided_version.extend([-1] * G)
        self.jobs.extend(range(g * G, (g + 1) * G))
        self.outstanding += 1
        return g

    def _assign(self) -> None:
        """Give jobs to free workers; async creates groups while back-pressure allows."""
        async_mode = self.cfg.mode == "async"
        cap = self.cfg.max_outstanding_groups
        while self.free:
            if not self.jobs:
                if async_mode and self.outstanding < cap:
                    self._new_group()
                else:
                    return
            w = self.free.popleft()
            self.w_in_free[w] = False
            if self.w_down[w]:
                continue
            self._start(w, self.jobs.popleft())

    def _start(self, w: int, i: int) -> None:
        now = self.now
        self.w_busy[w] = i
        self.worker[i] = w
        self.version[i] = self.visible_version
        self.start[i] = now
        d = self.duration[i]
        f = self.fail_at[i]
        limit = self.cfg.max_trajectory_s
        if f == f:  # an infra fault part-way
            self.status[i] = INFRA_FAILED
            d = d * f
            if limit is not None and d > limit:
                d, self.status[i] = limit, EXPIRED
        elif limit is not None and d > limit:
            d, self.status[i] = limit, EXPIRED
        else:
            self.status[i] = ACCEPTED
        if self.status[i] != ACCEPTED:
            self.reward[i] = None  # no valid evaluation (never the same as 0.0)
        self._push(now + d, DONE, w, self.w_epoch[w])

    def _finish(self, i: int) -> None:
        self.end[i] = self.now
        g = i // self.G
        self.g_left[g] -= 1
        if self.g_left[g] == 0:
            self.g_complete[g] = self.now
            self.ready.append(g)
            self._on_group_complete(g)

    def _release(self, w: int) -> None:
        self.w_busy[w] = -1
        if not self.w_in_free[w] and not self.w_down[w]:
            self.free.append(w)
            self.w_in_free[w] = True

    def _on_done(self, w: int, epoch: int) -> None:
        if epoch != self.w_epoch[w]:
            return  # the worker crashed meanwhile; that trajectory already ended
        i = self.w_busy[w]
        self._release(w)
        self._finish(i)
        self._assign()

    def _on_crash(self, w: int) -> None:
        self._push(self.now + self.crash_rng.exponential(3600.0 / self.cfg.worker_crash_per_h), CRASH, w)
        if self.w_down[w]:
            return
        self.w_epoch[w] += 1
        self.w_down[w] = True
        i = self.w_busy[w]
        self.w_busy[w] = -1
        self._push(self.now + self.cfg.worker_restart_s, RESTART, w)
        if i >= 0:
            self.status[i] = INFRA_FAILED
            self.reward[i] = None
            self._finish(i)
            self._assign()

    def _on_restart(self, w: int) -> None:
        self.w_down[w] = False
        self._release(w)
        self._assign()

    # -- admission and trainer ------------------------------------------------------------
    def _admit(self) -> None:
        """Decide every complete, undecided group (one admission run)."""
        groups, self.ready = self.ready, []
        self.last_admission = self.now
        if not groups:
            return
        self.admission_runs += 1
        members = [self.members(g) for g in groups]
        decisions = self.gate.decide(self, groups, members, self.now, self.policy_version)
        for g, idx, dec in zip(groups, members, decisions):
            self.g_decision[g] = dec.decision
            self.g_decided_at[g] = self.now
            for i, r in zip(idx, dec.reasons):
                self.reason[i] = r
                self.decided_version[i] = self.policy_version
            if dec.decision == "admit":
                self.train_buf.append(g)
            else:
                self.outstanding -= 1
        self._assign()  # rejected groups freed back-pressure room

    def _leave_idle(self) -> None:
        if self.trainer_state == "idle":
            self.trainer_idle_s += self.now - self.idle_since

    def _train(self, groups: list[int]) -> None:
        self._leave_idle()
        self.trainer_state = "training"
        for g in groups:
            self.g_trained_version[g] = self.policy_version
        self.trained_groups.append(groups)
        self.outstanding -= len(groups)
        self._push(self.now + self.cfg.trainer_step_s, STEP_END)
        self._assign()

    def _try_step_async(self) -> None:
        if self.trainer_state != "idle":
            return
        B = self.cfg.batch_groups
        if len(self.train_buf) < B and self.ready:
            due = self.last_admission + self.cfg.admission_interval_s
            if self.now >= due:
                self._admit()
            elif not self.tick_pending:
                self.tick_pending = True
                self._push(due, ADMIT_TICK)
        if len(self.train_buf) >= B:
            self._train([self.train_buf.popleft() for _ in range(B)])

    def _dispatch_sync(self) -> None:
        for _ in range(self.cfg.batch_groups):
            self._new_group()
        self.sync_batch_left = self.cfg.batch_groups
        self._assign()

    def _on_group_complete(self, g: int) -> None:
        if self.cfg.mode == "async":
            self._try_step_async()
            return
        self.sync_batch_left -= 1
        if self.sync_batch_left == 0:
            self._admit()
            batch = list(self.train_buf)
            self.train_buf.clear()
            if batch:
                self._train(batch)
            else:  # nothing admitted: no step, no new version; sample again
                self._dispatch_sync()

    def _on_step_end(self) -> None:
        self.trainer_state = "syncing"
        self.trainer_train_s += self.cfg.trainer_step_s
        self.steps += 1
        self._push(self.now + self.cfg.weight_sync_s, PUBLISH)

    def _on_publish(self) -> None:
        self.trainer_sync_s += self.cfg.weight_sync_s
        self.policy_version += 1
        self.visible_version = self.policy_version
        self.trainer_state = "idle"
        self.idle_since = self.now
        if self.cfg.mode == "async":
            self._try_step_async()
        else:
            self._dispatch_sync()

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> "Simulation":
        t0 = time.perf_counter()
        cfg = self.cfg
        if cfg.worker_crash_per_h > 0:
            for w in range(cfg.workers):
                self._push(self.crash_rng.exponential(3600.0 / cfg.worker_crash_per_h), CRASH, w)
        if cfg.mode == "sync":
            self._dispatch_sync()
        else:
            self._assign()
        heap, end = self._heap, self.end_time
        pop = heapq.heappop
        n = 0
        while heap and heap[0][0] <= end:
            t, _, kind, a, b = pop(heap)
            self.now = t
            n += 1
            if kind == DONE:
                self._on_done(a, b)
            elif kind == STEP_END:
                self._on_step_end()
            elif kind == PUBLISH:
                self._on_publish()
            elif kind == ADMIT_TICK:
                self.tick_pending = False
                self._try_step_async()
            elif kind == CRASH:
                self._on_crash(a)
            elif kind == RESTART:
                self._on_restart(a)
        self.now = end
        # close the books: partial states up to the end of simulated time
        if self.trainer_state == "idle":
            self.trainer_idle_s += end - self.idle_since
            self.idle_since = end
        elif self.trainer_state == "training":
            self.trainer_train_s += end - (heap_time_of(self._heap, STEP_END) - cfg.trainer_step_s)
        elif self.trainer_state == "syncing":
            self.trainer_sync_s += end - (heap_time_of(self._heap, PUBLISH) - cfg.weight_sync_s)
        self.events = n
        self.wall_s = time.perf_counter() - t0
        return self


def heap_time_of(heap: list[tuple[float, int, int, int, int]], kind: int) -> float:
    return min(e[0] for e in heap if e[2] == kind)


def simulate(cfg: SimConfig, gate: Gate | None = None) -> dict[str, Any]:
    """Run one simulation and return its summary (metrics.summarize)."""
    from pipeline.sim.metrics import summarize

    return summarize(Simulation(cfg, gate).run())
