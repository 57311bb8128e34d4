"""The scheduler: advances a harness's episodes, each on its own, running their
tool and verifier calls under deadlines and stepping the engine on whatever is
ready (pipeline/rollout/harness.py records what each step does).

The scheduler meets the harness through ``Stepper``, the interface it owns
(the harness implements it; this module imports nothing of the harness).

Streaming (``Scheduler``): there is no wave barrier. When an episode's turn
is generated it goes to its tool or its verifier, each a daemon thread (at
most ``tool_concurrency`` / ``verifier_concurrency`` at once) under a deadline
(``tool_timeout_s`` else the environment's, else 30s; ``verify_timeout_s``)
*and* its episode's wall clock, whichever comes first; the episode then goes
back to the engine's queue. The engine serves whatever is ready: a bounded
micro-batch (``Schedule.max_batch`` rows, ``max_wait_ms``) for engines that
take whole batches (transformers), or new requests joining a running batch
for engines with continuous batching (vLLM). A call past its deadline ends
its episode at the deadline (INFRA_FAILED, or EXPIRED when the wall clock ran
out) and its thread is abandoned, so no episode's outcome depends on another
episode's latency. Only the loop's thread writes the spool and calls the
engine. ``Schedule.order = "waves"`` keeps the old lockstep order (the
baseline of benchmarks/bench_rollout.py).

The calls themselves (staged until the spool is synced, queued, running in
their threads, collected, taken out past a deadline) are the scheduler's
``CallPool``; the loop decides what the engine does next.

The tool and verifier pools are sized for I/O by default (``settings.pool_size``:
the episodes in flight, at most ``POOL_CAP``, and never past the environment's
declared ``max_tool_concurrency`` / ``max_verifier_concurrency``).

``EngineStats`` measures the engine: busy seconds and the waits per
stage (engine queue, tool, verifier) that the rollout summary reports, and
per pool the time during which at least one call waited for a free slot
(``pool_wait_s``): when that exceeds the engine's busy time, the pool, not
the engine, bounded the run (the summary's ``bound_by``).

Over-provisioning (``group_redundancy``): once the worker has the groups it
needs it sets ``Harness.cancel_rest``; the loop then ends every episode still
active as cancelled (``Harness.cancel``: EXPIRED / UNKNOWN / ``cancelled``,
null reward, never a policy failure) and takes no new ones.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Protocol

from pipeline.rollout.engine import Engine, Request, Sampling
from pipeline.rollout.envs import ToolTimeout
from pipeline.rollout.episode import Episode, Status, StopReason, Verdict
from pipeline.rollout.settings import Faults, Latency, Limits, Schedule, pool_size

CallKind = Literal["tool", "verify"]


class EngineStats:
    """What the engine did: seconds generating, steps, and wait samples (ms) per stage."""

    STAGES = ("engine_queue", "tool", "verify")

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.steps = 0
        self.rows = 0
        self.samples: dict[str, list[float]] = {k: [] for k in self.STAGES}
        # per pool: (since, until) monotonic intervals a call waited for a free slot
        self.slot_waits: dict[str, list[tuple[float, float]]] = {"tool": [], "verify": []}

    def busy(self, seconds: float, rows: int) -> None:
        self.busy_s += seconds
        self.steps += 1
        self.rows += rows

    def sample(self, stage: str, ms: float) -> None:
        self.samples[stage].append(ms)

    def pool_wait_s(self) -> dict[str, float]:
        """Per pool: seconds during which at least one call waited for a free slot
        (the union of the waits, so 100 calls waiting the same second count 1 s)."""
        out = {}
        for kind, spans in self.slot_waits.items():
            total, end = 0.0, -math.inf
            for a, b in sorted(spans):
                if b <= end:
                    continue
                total += b - max(a, end)
                end = b
            out[kind] = total
        return out


class VerifierTimeout(Exception):
    """A verifier call did not answer within ``verify_timeout_s``."""


class Stepper(Protocol):
    """What the scheduler needs of a harness (pipeline/rollout/harness.py implements it): its
    settings, its counters, and the steps of an episode, each recording what it does in the spool.
    The scheduler decides when each step runs; the harness what it does."""

    env: Any
    spool: Any
    worker_id: str
    limits: Limits
    schedule: Schedule
    faults: Faults
    latency: Latency
    stats: EngineStats
    before_tools: Callable[[], Any] | None
    engine_fn: Callable[[], tuple[Engine, int]]
    follow_every_turn: bool
    engine_changed: bool            # the worker switched the policy between episodes: the next step reloads
    cancel_rest: bool               # the worker has its groups: end the active episodes (``Stepper.cancel``)
    pool_bounds: dict[str, int]     # set by the scheduler: the pool sizes it runs with
    tools_abandoned: int            # counted by the scheduler: calls left behind past their deadline
    verifiers_abandoned: int

    def next_ended(self) -> Episode | None: ...
    def restore(self, ep: Episode) -> None: ...
    def terminal(self, ep: Episode, status: Status, verdict: Verdict, stop_reason: StopReason, reward: float | None,
                 components: dict[str, float] | None, payload: dict[str, Any] | None) -> None: ...
    def cancel(self, ep: Episode) -> None: ...
    # a turn
    def start_turn(self, ep: Episode, version: int) -> None: ...
    def turn_budget(self, ep: Episode) -> int: ...
    def turn_sampling(self, budget: int) -> Sampling: ...
    def turn_request(self, ep: Episode) -> Request: ...
    def end_turn(self, ep: Episode, c: Any, version: int, meta: dict[str, Any]) -> str | None: ...
    # tool and verifier calls
    def tool_waiting(self, ep: Episode) -> None: ...
    def draw_key(self, ep: Episode, call: str) -> str: ...
    def tool_fault(self, ep: Episode) -> Exception | None: ...
    def verifier_fault(self, ep: Episode) -> Exception | None: ...
    def tool_timeout(self) -> float: ...
    def call_tool(self, ep: Episode, pause_s: float) -> Any: ...
    def call_verifier(self, ep: Episode, pause_s: float) -> Any: ...
    def record_tool_result(self, ep: Episode, out: Any, meta: dict[str, Any]) -> None: ...
    def record_verdict(self, ep: Episode, out: Any, meta: dict[str, Any]) -> None: ...


@dataclass
class _Call:
    """A tool or verifier call: queued, then running in a daemon thread under its deadline."""

    kind: CallKind
    ep: Episode
    fault: Exception | None
    queued: float
    started: float = 0.0
    deadline: float = math.inf      # the call's own deadline (tool_timeout_s / verify_timeout_s)
    pause_s: float = 0.0            # injected latency (Latency)
    token: int = 0
    published: float = 0.0         # runnable since (the spool synced): from here it waits for a slot
    finished: bool = False          # answered (its slot is free; the loop has yet to record it)


class CallPool:
    """The tool and verifier calls of one scheduler: staged until the spool is synced
    (``publish``), then queued, then running in daemon threads, at most ``bounds[kind]``
    of a kind at once, each under its deadline. Outcomes go to a completion queue the
    scheduler's loop reads (``finished``); calls past their deadline or their episode's
    wall clock are taken out (``overdue``), their threads abandoned."""

    def __init__(self, h: Stepper, bounds: dict[str, int], *, chain: bool) -> None:
        self.h = h
        self.bounds = bounds
        # call threads start the next queued call themselves, except where the loop must order
        # things: the crash-test faults (an exact crash point) and shipping before tools run
        self.chain = chain
        self.queues: dict[str, deque[_Call]] = {"tool": deque(), "verify": deque()}
        self.running: dict[int, _Call] = {}
        self.staged: list[_Call] = []                          # queued, waiting for the spool sync
        self.lock = threading.Lock()                           # queues + running, shared with the call threads
        self.done: queue.SimpleQueue = queue.SimpleQueue()     # (token, outcome, finished at)
        self.ship_first = False         # a committed action needs before_tools before its tool runs
        self._token = itertools.count(1)

    def stage(self, kind: CallKind, ep: Episode, now: float) -> None:
        """Stage a call; it becomes runnable once the spool is synced (``publish``)."""
        h = self.h
        if kind == "tool":
            fault = h.tool_fault(ep)
            key = h.draw_key(ep, ep.call["action_id"])
            self.ship_first = self.ship_first or h.before_tools is not None
        else:
            fault = h.verifier_fault(ep)
            key = h.draw_key(ep, f"verify{ep.turns}")
        pause = 0.0 if fault is not None else h.latency.draw(kind, key)
        self.staged.append(_Call(kind, ep, fault, now, pause_s=pause))

    def publish(self) -> None:
        """Make the staged calls runnable: the spool first (every ACTION_COMMITTED and
        TOOL_WAITING is durable before its tool can run), then the queues."""
        if not self.staged:
            return
        self.h.spool.sync()
        now = time.monotonic()
        with self.lock:
            for c in self.staged:
                c.published = now
                self.queues[c.kind].append(c)
        self.staged.clear()

    def calls(self) -> list[_Call]:
        """The calls running."""
        with self.lock:
            return list(self.running.values())

    def queued(self) -> list[_Call]:
        """The calls queued for a slot."""
        with self.lock:
            return [c for q in self.queues.values() for c in q]

    def busy(self) -> bool:
        """A call is staged, queued or running."""
        with self.lock:
            return bool(self.running or self.queues["tool"] or self.queues["verify"] or self.staged)

    def tools_busy(self) -> bool:
        """A tool call is staged, queued or running."""
        return bool(self.queues["tool"] or self.staged or any(c.kind == "tool" for c in self.calls()))

    def _next(self, kind: CallKind) -> _Call | None:
        """Under ``lock``: the next queued call of ``kind`` if a slot is free, registered as running."""
        q = self.queues[kind]
        if not q or sum(1 for c in self.running.values() if c.kind == kind and not c.finished) >= self.bounds[kind]:
            return None
        c = q.popleft()
        c.token = next(self._token)
        c.started = time.monotonic()
        if c.started > c.published:
            self.h.stats.slot_waits[kind].append((c.published, c.started))
        timeout = self.h.tool_timeout() if kind == "tool" else float(self.h.limits.verify_timeout_s or math.inf)
        c.deadline = c.started + timeout
        self.running[c.token] = c
        return c

    def dispatch(self) -> None:
        """Publish the staged calls and start the queued ones that have a free slot."""
        h = self.h
        self.publish()
        for kind in ("tool", "verify"):
            while True:
                if kind == "tool" and self.ship_first and self.queues["tool"]:
                    self.ship_first = False
                    if h.before_tools is not None:
                        h.before_tools()          # committed actions reach the lake before any of their tools run
                with self.lock:
                    c = self._next(kind)
                if c is None:
                    break
                threading.Thread(target=self._work, args=(c,), name=f"{kind}-{c.ep.episode_id}",
                                 daemon=True).start()

    def _work(self, c: _Call | None) -> None:
        """A call thread: run the call, hand its outcome to the loop; then (``chain``)
        free its slot and run the next queued call of its kind, so a finished call
        does not wait for the loop (busy with the engine) to start the next one."""
        while c is not None:
            if c.fault is not None:
                out: Any = c.fault
            else:
                try:
                    out = (self.h.call_tool(c.ep, c.pause_s) if c.kind == "tool"
                           else self.h.call_verifier(c.ep, c.pause_s))
                except BaseException as exc:  # noqa: BLE001 - handed to the harness as the call's outcome
                    out = exc
            self.done.put((c.token, out, time.monotonic()))
            if not self.chain:
                return
            with self.lock:
                c.finished = True
                c = self._next(c.kind)

    def finished(self, timeout: float | None) -> Iterator[tuple[_Call, Any, float]]:
        """The calls that answered, with their outcome and when (waiting up to ``timeout`` for
        the first); a late answer of a call abandoned at its deadline is dropped."""
        try:
            item = self.done.get(timeout=timeout) if timeout is None or timeout > 0 else self.done.get_nowait()
        except queue.Empty:
            item = None
        while item is not None:
            token, out, at = item
            with self.lock:
                c = self.running.pop(token, None)
            if c is not None:               # None: abandoned at its deadline, a late answer
                yield c, out, at
            try:
                item = self.done.get_nowait()
            except queue.Empty:
                item = None

    def overdue(self, now: float, wall_s: float) -> tuple[list[_Call], list[_Call]]:
        """Take out (queued calls whose episode's wall clock ran out, running calls past their
        deadline or their episode's wall clock): the latter's threads are abandoned."""
        expired: list[_Call] = []
        overdue: list[_Call] = []
        with self.lock:
            for q in self.queues.values():              # a call still queued when its episode's wall clock ran out
                for c in [c for c in q if now >= c.ep.started + wall_s]:
                    q.remove(c)
                    expired.append(c)
            for token, c in list(self.running.items()):
                if not c.finished and now >= min(c.deadline, c.ep.started + wall_s):
                    del self.running[token]             # abandoned: its thread is a daemon, its answer ignored
                    overdue.append(c)
        return expired, overdue

    def drain(self) -> list[_Call]:
        """Take out every call not answered yet: queued and staged ones are dropped, running
        ones abandoned (their answers ignored, as past a deadline)."""
        now = time.monotonic()
        with self.lock:
            calls = [c for q in self.queues.values() for c in q]
            for q in self.queues.values():
                q.clear()
            for token, c in list(self.running.items()):
                if not c.finished:
                    del self.running[token]
                    calls.append(c)
        calls += self.staged
        self.staged.clear()
        for c in calls:
            if c.published and not c.started:
                self.h.stats.slot_waits[c.kind].append((c.published, now))
        return calls


class Scheduler:
    """Advances episodes independently. One loop, in the calling thread (the only
    writer of the spool and the only caller of the engine):

    1. record the calls that finished (a completion queue fed by the call threads)
       and end those past their deadline or their episode's wall clock, at the
       deadline (the thread is abandoned; a late answer is ignored);
    2. start queued tool / verifier calls within ``tool_concurrency`` /
       ``verifier_concurrency`` (the spool is synced first: every
       ACTION_COMMITTED is durable before its tool runs);
    3. take new episodes from ``feed`` while the in-flight bound allows;
    4. run one engine step on the episodes that are ready: a bounded micro-batch
       (``Schedule.max_batch``) once it is full, or ``max_wait_ms`` after its
       oldest member became ready, or when nothing in flight could join it; an
       engine with continuous batching (``add_request``/``step``) instead takes
       every ready episode as a new request and advances one step;
    5. otherwise wait for the next completion or deadline.

    ``Schedule.order = "waves"`` keeps the old lockstep order as a baseline: the
    engine steps only when no call is in flight (every ready episode in one
    batch) and new episodes start only when none is active. The crash-test
    faults (kill/hold after the Nth execution) run tools one at a time and the
    engine waits for the tool queue, so the crash point is exact."""

    def __init__(self, h: Stepper, episodes: list[Episode], feed, on_finish, tick) -> None:
        self.h = h
        self.eps: list[Episode] = []
        self.ready: list[tuple[int, Episode, float]] = []      # (order, episode, ready since)
        self.feed, self.on_finish, self.tick = feed, on_finish, tick
        self.exhausted = feed is None
        crash = bool(h.faults.kill_after_executed or h.faults.hold_after_executed)
        self.barrier = h.schedule.order == "waves"
        self.tool_barrier = crash
        self.inflight_bound = max(1, int(h.schedule.max_inflight)) if h.schedule.max_inflight else 0
        bounds = {"tool": 1 if crash else pool_size(h.limits.tool_concurrency, self.inflight_bound,
                                                    getattr(h.env, "max_tool_concurrency", None)),
                  "verify": pool_size(h.limits.verifier_concurrency, self.inflight_bound,
                                      getattr(h.env, "max_verifier_concurrency", None))}
        h.pool_bounds = dict(bounds)
        self.pool = CallPool(h, bounds, chain=not crash and h.before_tools is None)
        self.active = 0
        self._order = itertools.count()
        self._batch = 0
        self.engine: Any = None
        self.version = 0
        self._steps = 0
        self.continuous = False
        self.generating: dict[str, tuple[Episode, float, float]] = {}   # request id -> (episode, queued, started)
        self._add(episodes)

    # -- bookkeeping -----------------------------------------------------------------------
    def _add(self, episodes: list[Episode]) -> None:
        """Take episodes in (new, or rebuilt after a restart) and queue each for what it needs next."""
        h = self.h
        now = time.monotonic()
        for ep in episodes:
            self.eps.append(ep)
            if ep.done:
                continue
            self.active += 1
            h.restore(ep)                           # a stateful episode rebuilt after a crash
            if ep.done:
                continue
            p = ep.pending
            if p is not None and "output" in p:     # executed before a crash: the observation joins next turn
                self.ready.append((next(self._order), ep, now))
            elif p is not None:
                if not p.get("waiting"):
                    h.tool_waiting(ep)
                if p.get("unconfirmed") and not h.env.idempotent:
                    h.terminal(ep, "INFRA_FAILED", "ENV_ERROR", "stop_sequence", None, None,
                                {"error": "tool outcome unknown after a restart; the tool is not idempotent"})
                else:
                    self.pool.stage("tool", ep, now)
            elif ep.state == "VERIFYING":
                self.pool.stage("verify", ep, now)
            else:
                self.ready.append((next(self._order), ep, now))
        self._finished()

    def _finished(self) -> None:
        """Hand the episodes that just ended to ``on_finish`` (retries come back as new episodes)."""
        while (ep := self.h.next_ended()) is not None:
            self.active -= 1
            if self.on_finish is not None:
                more = self.on_finish(ep)
                if more:
                    self._add(more)

    # -- calls -----------------------------------------------------------------------------
    def _collect(self, timeout: float | None) -> None:
        """Record finished calls (waiting up to ``timeout`` for the first), then end overdue ones."""
        h = self.h
        for c, out, at in self.pool.finished(timeout):
            if not c.ep.done:
                self._resolved(c, out, at)
        now = time.monotonic()
        wall_s = h.limits.wall_clock_s
        expired, overdue = self.pool.overdue(now, wall_s)
        for c in expired:
            h.stats.slot_waits[c.kind].append((c.published, now))
            h.terminal(c.ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None,
                       {"error": f"the wall clock ran out while the {c.kind} call was queued "
                                 f"(wall_clock_s={wall_s:g})", "waited_ms": round((now - c.queued) * 1000, 3)})
        for c in overdue:
            if c.kind == "tool":
                h.tools_abandoned += 1
            else:
                h.verifiers_abandoned += 1
            meta = {"waited_ms": round((now - c.queued) * 1000, 3)}
            if c.ep.started + wall_s <= c.deadline:     # the episode's wall clock ran out during the call
                h.terminal(c.ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None,
                           {"error": f"{c.kind} call outlived the episode's wall clock "
                                     f"(wall_clock_s={wall_s:g})"} | meta)
            elif c.kind == "tool":
                h.record_tool_result(c.ep, ToolTimeout(f"tool call exceeded its deadline of "
                                                       f"{c.deadline - c.started:g}s (harness tool_timeout_s)"), meta)
            else:
                h.record_verdict(c.ep, VerifierTimeout(f"verifier exceeded its deadline of "
                                                       f"{c.deadline - c.started:g}s (verify_timeout_s)"), meta)
        self._finished()

    def _resolved(self, c: _Call, out: Any, at: float) -> None:
        h = self.h
        waited = (at - c.queued) * 1000
        h.stats.sample(c.kind, waited)
        meta = {"waited_ms": round(waited, 3), "injected_ms": round(c.pause_s * 1000, 3)}
        if c.kind == "tool":
            h.record_tool_result(c.ep, out, meta)
            if not c.ep.done:
                self.ready.append((next(self._order), c.ep, time.monotonic()))
        else:
            h.record_verdict(c.ep, out, meta)

    # -- the engine ------------------------------------------------------------------------
    def _engine(self) -> None:
        self.engine, self.version = self.h.engine_fn()
        # continuous batching where the engine has it (vLLM); the wave baseline keeps whole-batch calls
        self.continuous = hasattr(self.engine, "add_request") and not self.barrier

    def _ripe(self, now: float) -> bool:
        if not self.ready:
            return False
        if self.continuous:
            return True
        inflight = self.pool.busy()
        if self.barrier:
            return not inflight
        if self.tool_barrier and self.pool.tools_busy():
            return False
        if not inflight or len(self.ready) >= self.h.schedule.max_batch:
            return True
        return now - min(t for _, _, t in self.ready) >= self.h.schedule.max_wait_ms / 1000

    def _take(self) -> list[tuple[Episode, float]]:
        self.ready.sort(key=lambda r: r[0])          # a stable order: the batch's rows do not depend on timing
        n = len(self.ready) if self.continuous or self.barrier else self.h.schedule.max_batch
        take, self.ready = self.ready[:n], self.ready[n:]
        return [(ep, t) for _, ep, t in take]

    def _step(self) -> None:
        """One engine step on the ready episodes (a micro-batch, or new requests of a continuous engine)."""
        h = self.h
        # a continuous engine switches only between requests (none of its running ones may see two policies)
        if ((h.follow_every_turn and self._steps) or h.engine_changed) and not self.generating:
            h.engine_changed = False
            self._engine()                      # a newer policy samples the next turns
        self._steps += 1
        batch = []
        now = time.monotonic()
        for ep, since in self._take():
            h.start_turn(ep, self.version)
            if not ep.done:
                batch.append((ep, since))
        self._finished()
        h.spool.sync()
        if not batch:
            return
        if self.continuous:
            for ep, since in batch:
                rid = f"{ep.episode_id}/t{ep.turns}"
                self.engine.add_request(rid, h.turn_request(ep), h.turn_sampling(h.turn_budget(ep)))
                self.generating[rid] = (ep, since, now)
            return
        self._batch += 1
        by_budget: dict[int, list[int]] = {}
        for i, (ep, _) in enumerate(batch):
            by_budget.setdefault(h.turn_budget(ep), []).append(i)
        outs: dict[int, Any] = {}
        t0 = time.perf_counter()
        for b, idx in by_budget.items():          # one engine call per distinct budget (usually one)
            reqs = [h.turn_request(batch[i][0]) for i in idx]
            for i, comps in zip(idx, self.engine.generate(reqs, h.turn_sampling(b))):
                outs[i] = comps[0]
        busy = time.perf_counter() - t0
        h.stats.busy(busy, len(batch))
        meta = {"batch": f"{h.worker_id}:{self._batch}", "gen_ms": round(busy * 1000, 3)}
        calls = []
        for i, (ep, since) in enumerate(batch):
            queued = (now - since) * 1000
            h.stats.sample("engine_queue", queued)
            calls.append((ep, h.end_turn(ep, outs[i], self.version, meta | {"queue_ms": round(queued, 3)})))
        self._after_turns(calls)

    def _step_continuous(self) -> None:
        """One step of a continuous-batching engine: turns that finished go on at once."""
        h = self.h
        t0 = time.perf_counter()
        finished = self.engine.step()
        busy = time.perf_counter() - t0
        h.stats.busy(busy, len(self.generating))
        calls = []
        for rid, comp in finished:
            ep, since, started = self.generating.pop(rid)
            queued = (started - since) * 1000
            h.stats.sample("engine_queue", queued)
            meta = {"batch": f"{h.worker_id}:{rid}", "gen_ms": round((time.monotonic() - started) * 1000, 3),
                    "queue_ms": round(queued, 3)}
            calls.append((ep, h.end_turn(ep, comp, self.version, meta)))
        self._after_turns(calls)

    def _after_turns(self, calls: list[tuple[Episode, str | None]]) -> None:
        h = self.h
        now = time.monotonic()
        for ep, nxt in calls:
            if nxt == "tool":
                h.tool_waiting(ep)
                self.pool.stage("tool", ep, now)
            elif nxt == "verify":
                self.pool.stage("verify", ep, now)
        h.spool.sync()          # every ACTION_COMMITTED is durable before any tool runs
        self._finished()

    def _cancel(self) -> None:
        """Over-provisioning: the worker has its groups (``Harness.cancel_rest``). Every
        episode still active and not generating ends cancelled now: queued calls are
        dropped, running ones abandoned (their answers ignored, as past a deadline);
        a turn being generated (continuous engine) ends first and is cancelled at the
        next turn of the loop. The worker's feed then starts nothing new (it only hands
        over the episodes a restart left half-done, which end cancelled here too)."""
        h = self.h
        calls = self.pool.drain()
        eps = [ep for _, ep, _ in self.ready] + [c.ep for c in calls]
        self.ready.clear()
        for ep in eps:
            if not ep.done:
                h.cancel(ep)
        self._finished()

    # -- the loop ----------------------------------------------------------------------------
    def _more(self) -> None:
        if self.exhausted or (self.barrier and self.active):
            return
        free = self.inflight_bound - self.active if self.inflight_bound else 1 << 30
        if free <= 0:
            return
        more = self.feed(free, self.active)
        if more is None:
            self.exhausted = True
        elif more:
            self._add(more)

    def run(self) -> list[Episode]:
        h = self.h
        h.spool.sync()
        self._engine()
        while True:
            self._collect(0)
            if h.cancel_rest and self.active:
                self._cancel()
            self.pool.dispatch()
            self._more()
            if self.tick is not None:
                self.tick()
            if self.active == 0 and self.exhausted:
                break
            if self.generating:
                if self.ready:
                    self._step()
                self._step_continuous()
                continue
            now = time.monotonic()
            if self._ripe(now):
                self._step()
                continue
            wait = 0.5
            if self.ready and not self.barrier and not self.tool_barrier:
                wait = min(wait, max(0.0, min(t for _, _, t in self.ready) + h.schedule.max_wait_ms / 1000 - now))
            calls = self.pool.calls()
            queued = self.pool.queued()
            for c in calls:
                wait = min(wait, max(0.0, min(c.deadline, c.ep.started + h.limits.wall_clock_s) - now))
            for c in queued:
                wait = min(wait, max(0.0, c.ep.started + h.limits.wall_clock_s - now))
            if not calls and not queued and not self.ready and not self.pool.staged and self.active and self.exhausted:
                raise RuntimeError(f"harness: {self.active} episodes are active but none can advance")
            self._collect(wait if calls else min(wait, 0.05))
        h.spool.sync()
        return self.eps
