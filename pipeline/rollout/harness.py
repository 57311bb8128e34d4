"""The rollout harness: one state machine per episode, each advancing on its own.

States: CREATED -> GENERATING -> (TOOL_WAITING -> GENERATING)* -> VERIFYING
-> ACCEPTED | REJECTED | INFRA_FAILED | EXPIRED.

Every state change and side effect is an event (``events`` table, key
``(episode_id, step_id, action_id, event_type)``), written to the worker's
spool and fsynced *before* the harness acts on it:

    GENERATING(step k)                      a model turn starts
    ACTION_COMMITTED(step k, action a<k>)   the turn's tokens + the tool call (before the tool runs)
    TOOL_WAITING                            handed to the tool
    ACTION_EXECUTED                         the tool ran; its output is in the payload
    OBSERVATION_PERSISTED                   the observation tokens joined the context (when the next turn starts)
    VERIFYING                               final turn's tokens, verifier called
    TERMINAL                                status, verdict, reward

A restarted worker rebuilds its episodes from these records (``resume``): an
action with ACTION_EXECUTED but no OBSERVATION_PERSISTED gets its observation
from the recorded output and the tool is *not* called again; an action that
was committed but never confirmed is re-run only when the environment declares
its tools idempotent, otherwise the episode ends INFRA_FAILED.

Terminal outcomes (status / verdict / stop_reason / reward):

- final ``<ans>…<eos>``, verifier PASS/FAIL     ACCEPTED / PASS|FAIL / eos / reward
- hard format failure (no ``<ans>N<eos>``)      REJECTED / FAIL / eos|stop_sequence / 0.0
- per-turn or total token limit                 REJECTED / FAIL / max_length / 0.0
- turn limit (a tool call on the last turn)     REJECTED / FAIL / max_steps / 0.0
- wall-clock limit                              EXPIRED / UNKNOWN / wall_clock / null
- tool timeout (injected, or past the deadline) INFRA_FAILED / ENV_ERROR / env_timeout / null
- environment crash                             INFRA_FAILED / ENV_ERROR / stop_sequence / null
- verifier past ``verify_timeout_s``            INFRA_FAILED / UNKNOWN / verifier_timeout / null
- verifier error or UNKNOWN                     INFRA_FAILED / UNKNOWN / eos / null

(An environment that sets ``infra_failure_reward`` to a number gets the naive
scoring instead: a tool timeout ends REJECTED / FAIL / env_timeout with that
reward. It exists for the gate ablations in benchmarks/bench_gates.py.)

A null reward is "no valid evaluation" and never 0.0: admission drops those
members from group baselines instead of counting them as policy failures.

Streaming (``_Scheduler``): there is no wave barrier. When an episode's turn
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

``Latency`` injects a seeded latency model into tool and verifier calls (a
lognormal with a given mean and sigma, and a share of 10x slow calls): the
draw is a function of (seed, call key), it is recorded in the CREATED event
(the model) and in each call's event (``injected_ms``), so two runs can be
compared. ``EngineStats`` measures the engine: busy seconds and the waits per
stage (engine queue, tool, verifier) that the rollout summary reports.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import queue
import random
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Literal

from pipeline import vocab
from pipeline.rollout import codec as codecs
from pipeline.rollout.engine import Engine, Request, Sampling, derive_seed
from pipeline.rollout.envs import Environment, Task, ToolError, ToolTimeout, Verification
from pipeline.rollout.envs.base import tool_schema_version

HARNESS_VERSION = "harness/2"
DEFAULT_TOOL_TIMEOUT_S = 30.0
TERMINAL_STATES = ("ACCEPTED", "REJECTED", "INFRA_FAILED", "EXPIRED")


@dataclass(frozen=True)
class Limits:
    max_turns: int = 4
    max_tokens_per_turn: int = 16
    max_total_tokens: int = 64       # response tokens, policy + observation
    wall_clock_s: float = 120.0      # per trajectory
    tool_timeout_s: float = 0.0      # per tool call (0: the environment's tool_timeout_s, else 30s)
    tool_concurrency: int = 8        # tool calls running at once
    verify_timeout_s: float = 30.0   # per verifier call (INFRA_FAILED / verifier_timeout past it)
    verifier_concurrency: int = 8    # verifier calls running at once


@dataclass(frozen=True)
class Schedule:
    """How episodes share the engine."""

    order: Literal["stream", "waves"] = "stream"   # waves: the lockstep baseline
    max_batch: int = 256             # rows of one engine call (engines without continuous batching)
    max_wait_ms: float = 20.0        # a partial micro-batch waits this long for more ready episodes
    max_inflight: int = 0            # episodes active at once when fed (0: no bound)


@dataclass(frozen=True)
class Latency:
    """Injected latency of tool and verifier calls: lognormal with mean ``*_ms``
    and log-sd ``*_sigma``; a share ``slow_*_p`` of the calls takes 10x. Seeded
    per call key, so a call's latency does not depend on timing or workers."""

    tool_ms: float = 0.0
    tool_sigma: float = 0.0
    slow_tool_p: float = 0.0
    verifier_ms: float = 0.0
    verifier_sigma: float = 0.0
    slow_verifier_p: float = 0.0
    seed: int = 0

    @property
    def active(self) -> bool:
        return self.tool_ms > 0 or self.verifier_ms > 0

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("tool_ms", "tool_sigma", "slow_tool_p", "verifier_ms",
                                              "verifier_sigma", "slow_verifier_p", "seed")}

    def draw(self, kind: str, key: str) -> float:
        """Seconds to wait before the call ``key`` of ``kind`` (``tool`` | ``verify``)."""
        mean, sigma, slow = ((self.tool_ms, self.tool_sigma, self.slow_tool_p) if kind == "tool"
                             else (self.verifier_ms, self.verifier_sigma, self.slow_verifier_p))
        if mean <= 0:
            return 0.0
        rng = random.Random(derive_seed(self.seed, "latency", kind, key))
        # E[exp(N(mu, s^2))] = exp(mu + s^2/2) = mean
        ms = math.exp(rng.gauss(math.log(mean) - sigma * sigma / 2, sigma)) if sigma > 0 else mean
        if rng.random() < slow:
            ms *= 10
        return ms / 1000


class EngineStats:
    """What the engine did: seconds generating, steps, and wait samples (ms) per stage."""

    STAGES = ("engine_queue", "tool", "verify")

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.steps = 0
        self.rows = 0
        self.samples: dict[str, list[float]] = {k: [] for k in self.STAGES}

    def busy(self, seconds: float, rows: int) -> None:
        self.busy_s += seconds
        self.steps += 1
        self.rows += rows

    def sample(self, stage: str, ms: float) -> None:
        self.samples[stage].append(ms)


class VerifierTimeout(Exception):
    """A verifier call did not answer within ``verify_timeout_s``."""


@dataclass(frozen=True)
class Faults:
    """Fault injection (probabilities per tool call / verification)."""

    tool_timeout: float = 0.0
    env_crash: float = 0.0
    verifier_error: float = 0.0
    kill_after_executed: int = 0     # SIGKILL this process right after the Nth ACTION_EXECUTED is durable
    seed: int = 0
    # hold (sleep until killed) right after the Nth ACTION_EXECUTED is durable, once
    # ``<hold_file>.<pid>`` is written: the readiness marker crash tests kill on
    hold_after_executed: int = 0
    hold_file: str = ""


@dataclass
class Episode:
    episode_id: str
    group_id: str
    group_size: int
    task: Task
    seed: int
    prompt_ids: list[int]
    policy_version: int = 0          # behaviour version that started it
    state: str = "CREATED"
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    created_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    started: float = field(default_factory=time.monotonic)
    # set when terminal
    status: str | None = None
    verdict: str | None = None
    stop_reason: str | None = None
    reward: float | None = None
    components: dict[str, float] | None = None
    # a committed action awaiting its observation: {"action_id", "text", "output"?}
    pending: dict[str, Any] | None = None
    final_turn: list[int] | None = None
    finished_mono: float = 0.0       # monotonic time of TERMINAL (the worker's ship lag)
    written: set = field(default_factory=set)   # event keys (step, action, type) already recorded

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def call(self) -> dict[str, Any]:
        """``pending`` of an episode in the tool phase (only episodes with a committed action reach it)."""
        assert self.pending is not None, f"episode {self.episode_id} has no pending action"
        return self.pending


def _now() -> datetime:
    return datetime.now(timezone.utc)


def parse_answer(turn: list[int]) -> str | None:
    """The answer text of a final turn ``<ans>…<eos>``, None when the format is broken."""
    if len(turn) >= 2 and turn[0] == vocab.ANS_ID and turn[-1] == vocab.EOS_ID:
        body = turn[1:-1]
        if all(t >= len(vocab.SPECIAL) for t in body):
            return vocab.decode(body)
    return None


def parse_call(turn: list[int]) -> str | None:
    """The tool call text of a turn ``<call>…</call>``, None otherwise."""
    if len(turn) >= 2 and turn[0] == vocab.CALL_ID and turn[-1] == vocab.END_CALL_ID:
        body = turn[1:-1]
        if all(t >= len(vocab.SPECIAL) for t in body):
            return vocab.decode(body)
    return None


class Harness:
    """Runs episodes of one environment with one engine, writing events and
    trajectory rows to a spool (``spool.Spool``)."""

    def __init__(self, env: Environment, engine_fn: Callable[[], tuple[Engine, int]], spool, *, run_id: str,
                 worker_id: str, sampling: Sampling, limits: Limits = Limits(), faults: Faults = Faults(),
                 follow_every_turn: bool = False, before_tools: Callable[[], Any] | None = None,
                 codec=None, schedule: Schedule = Schedule(), latency: Latency = Latency()) -> None:
        self.env = env
        # the policy's tokenizer (pipeline/rollout/codec.py); the char one by default
        self.codec = codec if codec is not None else codecs.CharCodec()
        self.engine_fn = engine_fn           # -> (engine, policy_version); may swap to a newer policy
        self.spool = spool
        self.run_id = run_id
        self.worker_id = worker_id
        self.sampling = sampling
        self.limits = limits
        self.faults = faults
        self.follow_every_turn = follow_every_turn
        # called once the wave's ACTION_COMMITTED records are durable and before any
        # tool runs: the worker ships them to the lake there when its tools are not
        # idempotent, so that even a lost spool leaves every committed action on record
        self.before_tools = before_tools
        self.schedule = schedule
        self.latency = latency
        self._executed = 0
        self.tool_executions = 0
        self.tools_abandoned = 0          # tool threads left behind past their deadline
        self.verifiers_abandoned = 0      # verifier threads left behind past their deadline
        self.stats = EngineStats()
        self.engine_changed = False       # set by a worker that switched the policy between episodes
        self._ended: list[Episode] = []   # terminal since the scheduler last looked

    # -- events ------------------------------------------------------------------------
    def _event(self, ep: Episode, event_type: str, *, step: int, action_id: str = "", state: str | None = None,
               payload: dict[str, Any] | None = None, version: int | None = None) -> None:
        if state is not None:
            ep.state = state
        key = (step, action_id, event_type)
        if key in ep.written:      # already recorded before a restart: the first record stands
            return
        ep.written.add(key)
        self.spool.append({
            "kind": "event", "episode_id": ep.episode_id, "step_id": step, "action_id": action_id,
            "event_type": event_type, "run_id": self.run_id, "group_id": ep.group_id, "worker_id": self.worker_id,
            "policy_version": ep.policy_version if version is None else version, "state": ep.state,
            "payload": json.dumps(payload, separators=(",", ":")) if payload is not None else None,
            "created_at": _now().isoformat(),
        })

    # -- episodes ------------------------------------------------------------------------
    def new_episode(self, *, episode_id: str, group_id: str, group_size: int, task: Task, seed: int,
                    policy_version: int, extra: dict[str, Any] | None = None) -> Episode:
        # [i28 rendering] the codec renders the prompt: text protocol, or the env's chat messages
        ep = Episode(episode_id, group_id, group_size, task, seed, self.codec.prompt_ids(task),
                     policy_version=policy_version)
        payload = {"task_id": task.task_id, "prompt_ids": ep.prompt_ids, "seed": seed, "group_size": group_size,
                   "difficulty": task.difficulty, "schedule": self.schedule.order}
        if self.latency.active:
            payload["latency"] = self.latency.as_dict()      # the injected latency model, so runs can be compared
        self._event(ep, "CREATED", step=0, state="CREATED", payload=payload | (extra or {}))
        return ep

    def next_turn_context(self, ep: Episode) -> list[int]:
        """The token ids the engine continues for ``ep``'s next turn: the prompt,
        every earlier turn and every observation, in order. The one place a turn's
        input is built (a chat-rendering environment changes it here)."""
        return ep.prompt_ids + ep.response_ids

    def observation_ids(self, output: str, last_id: int | None = None) -> list[int]:
        """The observation tokens a tool's output adds to the context (loss_mask 0): the codec's (``<obs>..</obs>``
        in the text protocol, a chat tool message through the template), appended as they are (token-in/out)."""
        return self.codec.observation_ids(output, last_id)

    def run(self, episodes: list[Episode], *, feed: Callable[[int, int], list[Episode] | None] | None = None,
            on_finish: Callable[[Episode], list[Episode]] | None = None,
            tick: Callable[[], None] | None = None) -> list[Episode]:
        """Advance every episode to a terminal state (resumed ones first finish
        what the crash interrupted) and return them, with every episode added on
        the way. ``feed(free, active)`` is asked for more episodes while the run
        goes on (``free``: the in-flight bound left; None = nothing more);
        ``on_finish(ep)`` is told of each terminal episode and may return new ones
        (retries); ``tick()`` runs at every turn of the loop (the worker ships
        finished trajectories there)."""
        return _Scheduler(self, episodes, feed, on_finish, tick).run()

    # -- one turn ------------------------------------------------------------------------
    def _start_turn(self, ep: Episode, version: int) -> None:
        """GENERATING: the turn's context is final (a pending observation joins it first)."""
        if ep.pending is not None and "output" in ep.pending:
            self._observe(ep)
            if ep.done:
                return
        if ep.response_ids and self._past_wall_clock(ep):       # ran out while waiting for the engine
            self._terminal(ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None,
                           {"error": "the wall clock ran out waiting for the engine"})
            return
        if ep.state == "CREATED":
            ep.policy_version = version if ep.turns == 0 else ep.policy_version
        self._event(ep, "GENERATING", step=ep.turns, state="GENERATING", version=version, payload={"turn": ep.turns})

    def _sampling(self, budget: int) -> Sampling:
        return Sampling(self.sampling.temperature, self.sampling.top_p, max(budget, 1),
                        self.sampling.stop_ids if self.codec.char else self.codec.stop_ids)

    def _budget(self, ep: Episode) -> int:
        return max(1, min(self.limits.max_tokens_per_turn, self.limits.max_total_tokens - len(ep.response_ids)))

    def _request(self, ep: Episode) -> Request:
        return Request(tuple(self.next_turn_context(ep)), 1, derive_seed(ep.seed, ep.turns))

    def _end_turn(self, ep: Episode, c: Any, version: int, meta: dict[str, Any]) -> str | None:
        """Record a generated turn; returns ``"tool"`` (an action was committed),
        ``"verify"`` (a final turn) or None (terminal)."""
        turn, lps = list(c.token_ids), [float(x) for x in c.logprobs]
        finish = c.finish
        cut = codecs.cut_at_stop(self.codec, turn, self.codec.stop_strings)
        if cut is not None:        # a stop string, found in the decoded text (BPE may merge it)
            turn, lps, finish = turn[:cut], lps[:cut], "stop"
        ep.response_ids += turn
        ep.logprobs += lps
        ep.mask += [1] * len(turn)
        ep.token_versions += [version] * len(turn)
        ep.turns += 1
        turn_payload = {"turn": ep.turns - 1, "ids": turn, "logprobs": lps, "version": version} | meta
        if self._past_wall_clock(ep):
            self._terminal(ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None, turn_payload)
            return None
        call = parse_call(turn) if self.codec.char else codecs.parse_turn(self.codec, turn)[0]
        if finish == "length":
            self._reject(ep, "max_length", turn_payload)
        elif call is not None and self.env.multi_turn:
            if ep.turns >= self.limits.max_turns:
                self._reject(ep, "max_steps", turn_payload)
            elif len(ep.response_ids) >= self.limits.max_total_tokens:
                self._reject(ep, "max_length", turn_payload)
            else:
                aid = f"a{ep.turns - 1}"
                ep.pending = {"action_id": aid, "text": call, "step": ep.turns - 1}
                self._event(ep, "ACTION_COMMITTED", step=ep.turns - 1, action_id=aid, state="TOOL_WAITING",
                            version=version, payload=turn_payload | {"tool": self.env.name, "args": call,
                                                                     "key": f"{ep.episode_id}/{aid}"})
                return "tool"
        else:
            ep.final_turn = turn
            self._event(ep, "VERIFYING", step=ep.turns - 1, state="VERIFYING", version=version,
                        payload=turn_payload | {"stop": "eos" if turn[-1] == self.codec.eos_id else "stop_sequence"})
            return "verify"
        return None

    def _reject(self, ep: Episode, stop_reason: str, turn_payload: dict[str, Any]) -> None:
        v = self.env.verify(ep.task, None, ep.tool_calls)   # components of a failed format
        self._terminal(ep, "REJECTED", "FAIL", stop_reason, 0.0, v.components, turn_payload)

    def _past_wall_clock(self, ep: Episode, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) - ep.started > self.limits.wall_clock_s

    # -- tools ---------------------------------------------------------------------------
    def _tool_timeout(self) -> float:
        """The per-call deadline: the run's ``tool_timeout_s`` when set (> 0), else the
        environment's declared ``tool_timeout_s``, else none."""
        return float(self.limits.tool_timeout_s or getattr(self.env, "tool_timeout_s", 0) or DEFAULT_TOOL_TIMEOUT_S)

    def draw_key(self, ep: Episode, call: str) -> str:
        """The key the injected faults and latencies of one call are drawn from: the
        episode id without its run id (``g<k>-<j>``, ``g<k>-r<n>``) and the call, so two
        runs of the same plan (another run id, schedule or --workers) draw the same."""
        eid = ep.episode_id
        if eid.startswith(self.run_id + "-"):
            eid = eid[len(self.run_id) + 1:]
        return f"{eid}/{call}"

    def _draw(self, kind: str, ep: Episode, step: int) -> random.Random:
        """The fault draws of one call: a function of (seed, call key), so the same
        faults land whatever the order calls run in and whatever the workers."""
        return random.Random(derive_seed(self.faults.seed, "fault", kind, self.draw_key(ep, str(step))))

    def _tool_fault(self, ep: Episode) -> Exception | None:
        rng = self._draw("tool", ep, ep.call["step"])
        if rng.random() < self.faults.tool_timeout:
            return ToolTimeout("injected tool timeout")
        if rng.random() < self.faults.env_crash:
            return ToolError("injected environment crash")
        return None

    def _tool_call(self, ep: Episode, pause_s: float) -> Any:
        """Runs in a tool thread: the injected latency, then the environment's tool."""
        if pause_s > 0:
            time.sleep(pause_s)
        p = ep.call
        return self.env.step(ep.task, p["text"], key=f"{ep.episode_id}/{p['action_id']}")

    def _tool_result(self, ep: Episode, out: Any, meta: dict[str, Any]) -> None:
        """Record a tool call's outcome (main thread). An executed call's
        observation joins the context when its next turn starts (``_start_turn``)."""
        p = ep.call
        if isinstance(out, ToolTimeout):
            naive_reward = getattr(self.env, "infra_failure_reward", None)
            if naive_reward is not None:
                # ablation only (benchmarks/bench_gates.py): the naive harness that scores a
                # timeout as the policy's failure instead of recording "no valid evaluation"
                v = self.env.verify(ep.task, None, ep.tool_calls)
                self._terminal(ep, "REJECTED", "FAIL", "env_timeout", float(naive_reward), v.components,
                               {"error": str(out)})
                return
            self._terminal(ep, "INFRA_FAILED", "ENV_ERROR", "env_timeout", None, None, {"error": str(out)})
            return
        if isinstance(out, BaseException):   # any environment failure is an infra failure
            self._terminal(ep, "INFRA_FAILED", "ENV_ERROR", "stop_sequence", None, None,
                           {"error": f"{type(out).__name__}: {out}"})
            return
        self.tool_executions += 1
        p["output"] = out
        self._event(ep, "ACTION_EXECUTED", step=p["step"], action_id=p["action_id"], state="TOOL_WAITING",
                    payload={"output": out} | meta)
        self._executed += 1
        if self.faults.kill_after_executed and self._executed == self.faults.kill_after_executed:
            self.spool.sync()
            os.kill(os.getpid(), signal.SIGKILL)   # the crash test: executed, observation not persisted
        if self.faults.hold_after_executed and self._executed == self.faults.hold_after_executed:
            self.spool.sync()
            _hold(self.faults.hold_file)

    def _observe(self, ep: Episode) -> None:
        """OBSERVATION_PERSISTED: the executed call's output joins the context."""
        p = ep.call
        obs = self.observation_ids(p["output"], ep.response_ids[-1] if ep.response_ids else None)
        ep.response_ids += obs
        ep.logprobs += [0.0] * len(obs)
        ep.mask += [0] * len(obs)
        ep.token_versions += [-1] * len(obs)
        ep.tool_calls += 1
        ep.pending = None
        self._event(ep, "OBSERVATION_PERSISTED", step=p["step"], action_id=p["action_id"], state="GENERATING",
                    payload={"obs": obs})
        if self._past_wall_clock(ep):
            self._terminal(ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None, None)
        elif len(ep.response_ids) >= self.limits.max_total_tokens:
            self._reject(ep, "max_length", {})

    # -- verification ----------------------------------------------------------------------
    def _verify_call(self, ep: Episode, pause_s: float) -> Verification:
        """Runs in a verifier thread: the injected latency, then the environment's verifier."""
        if pause_s > 0:
            time.sleep(pause_s)
        return self.env.verify(ep.task, self._answer(ep), ep.tool_calls)

    def _answer(self, ep: Episode) -> str | None:
        turn = ep.final_turn or []
        return parse_answer(turn) if self.codec.char else codecs.parse_turn(self.codec, turn)[1]

    def _final_stop(self, ep: Episode) -> str:
        turn = ep.final_turn or []
        return "eos" if turn and turn[-1] == self.codec.eos_id else "stop_sequence"

    def _verify_fault(self, ep: Episode) -> Exception | None:
        if self._draw("verifier", ep, ep.turns).random() < self.faults.verifier_error:
            return RuntimeError("injected verifier error")
        return None

    def _verified(self, ep: Episode, out: Any, meta: dict[str, Any]) -> None:
        stop = self._final_stop(ep)
        if isinstance(out, VerifierTimeout):
            self._terminal(ep, "INFRA_FAILED", "UNKNOWN", "verifier_timeout", None, None,
                           {"error": f"verifier_timeout: {out}"} | meta)
        elif isinstance(out, BaseException):
            self._terminal(ep, "INFRA_FAILED", "UNKNOWN", stop, None, None,
                           {"error": f"verifier: {type(out).__name__}: {out}"} | meta)
        elif out.verdict == "UNKNOWN" or out.reward is None:
            self._terminal(ep, "INFRA_FAILED", "UNKNOWN", stop, None, out.components or None, meta or None)
        elif not out.format_ok:
            self._terminal(ep, "REJECTED", "FAIL", stop, 0.0, out.components, meta or None)
        else:
            self._terminal(ep, "ACCEPTED", out.verdict, stop, float(out.reward), out.components, meta or None)

    def _terminal(self, ep: Episode, status: str, verdict: str, stop_reason: str, reward: float | None,
                  components: dict[str, float] | None, payload: dict[str, Any] | None) -> None:
        ep.status, ep.verdict, ep.stop_reason, ep.reward, ep.components = status, verdict, stop_reason, reward, components
        ep.pending = None
        finished = _now()
        self.spool.append({"kind": "trajectory", **self.trajectory_row(ep, finished)})
        self._event(ep, "TERMINAL", step=ep.turns, state=status, payload=(payload or {}) | {
            "status": status, "verdict": verdict, "stop_reason": stop_reason, "reward": reward})
        ep.finished_mono = time.monotonic()
        self._ended.append(ep)

    def trajectory_row(self, ep: Episode, finished: datetime) -> dict[str, Any]:
        s = self.sampling
        return {
            "trajectory_id": ep.episode_id, "group_id": ep.group_id, "group_size": ep.group_size,
            "task_id": ep.task.task_id, "task_version": self.env.version, "run_id": self.run_id,
            "policy_version": ep.policy_version, "token_policy_versions": list(ep.token_versions),
            # [i28 rendering] the rendering + chat template that made the prompt
            "tokenizer_rev": self.codec.rev, "prompt_template_rev": self.codec.template_rev(self.env),
            "harness_version": HARNESS_VERSION, "env_version": self.env.env_version,
            "verifier_version": self.env.verifier_version, "temperature": float(s.temperature),
            "top_p": float(s.top_p), "sampling_seed": ep.seed, "status": ep.status, "verdict": ep.verdict,
            "stop_reason": ep.stop_reason, "reward": ep.reward, "reward_components": ep.components,
            "difficulty": ep.task.difficulty, "num_turns": ep.turns, "num_tool_calls": ep.tool_calls,
            "created_at": ep.created_at.isoformat(), "finished_at": max(finished, ep.created_at).isoformat(),
            "queue_wait_ms": 0, "prompt_ids": list(ep.prompt_ids), "response_ids": list(ep.response_ids),
            "response_logprobs": list(ep.logprobs), "loss_mask": list(ep.mask),
            "tool_schema_version": tool_schema_version(self.env),
        }


# -- the scheduler ----------------------------------------------------------------------------
@dataclass
class _Call:
    """A tool or verifier call: queued, then running in a daemon thread under its deadline."""

    kind: str                       # "tool" | "verify"
    ep: Episode
    fault: Exception | None
    queued: float
    started: float = 0.0
    deadline: float = math.inf      # the call's own deadline (tool_timeout_s / verify_timeout_s)
    pause_s: float = 0.0            # injected latency (Latency)
    token: int = 0
    finished: bool = False          # answered (its slot is free; the loop has yet to record it)


class _Scheduler:
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

    def __init__(self, h: Harness, episodes: list[Episode], feed, on_finish, tick) -> None:
        self.h = h
        self.eps: list[Episode] = []
        self.ready: list[tuple[int, Episode, float]] = []      # (order, episode, ready since)
        self.queues: dict[str, deque[_Call]] = {"tool": deque(), "verify": deque()}
        self.running: dict[int, _Call] = {}
        self.staged: list[_Call] = []                          # queued, waiting for the spool sync
        self.lock = threading.Lock()                           # queues + running, shared with the call threads
        self.done: queue.SimpleQueue = queue.SimpleQueue()     # (token, outcome, finished at)
        self.feed, self.on_finish, self.tick = feed, on_finish, tick
        self.exhausted = feed is None
        crash = bool(h.faults.kill_after_executed or h.faults.hold_after_executed)
        self.barrier = h.schedule.order == "waves"
        self.tool_barrier = crash
        # call threads start the next queued call themselves, except where the loop must order
        # things: the crash-test faults (an exact crash point) and shipping before tools run
        self.chain = not crash and h.before_tools is None
        self.bounds = {"tool": 1 if crash else max(1, int(h.limits.tool_concurrency)),
                       "verify": max(1, int(h.limits.verifier_concurrency))}
        self.inflight_bound = max(1, int(h.schedule.max_inflight)) if h.schedule.max_inflight else 0
        self.active = 0
        self.ship_first = False         # a committed action needs before_tools before its tool runs
        self._order = itertools.count()
        self._token = itertools.count(1)
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
            p = ep.pending
            if p is not None and "output" in p:     # executed before a crash: the observation joins next turn
                self.ready.append((next(self._order), ep, now))
            elif p is not None:
                if not p.get("waiting"):
                    h._event(ep, "TOOL_WAITING", step=p["step"], action_id=p["action_id"], state="TOOL_WAITING")
                if p.get("unconfirmed") and not h.env.idempotent:
                    h._terminal(ep, "INFRA_FAILED", "ENV_ERROR", "stop_sequence", None, None,
                                {"error": "tool outcome unknown after a restart; the tool is not idempotent"})
                else:
                    self._queue("tool", ep, now)
            elif ep.state == "VERIFYING":
                self._queue("verify", ep, now)
            else:
                self.ready.append((next(self._order), ep, now))
        self._finished()

    def _queue(self, kind: str, ep: Episode, now: float) -> None:
        """Stage a call; it becomes runnable once the spool is synced (``_publish``)."""
        h = self.h
        if kind == "tool":
            fault = h._tool_fault(ep)
            key = h.draw_key(ep, ep.call["action_id"])
            self.ship_first = self.ship_first or h.before_tools is not None
        else:
            fault = h._verify_fault(ep)
            key = h.draw_key(ep, f"verify{ep.turns}")
        pause = 0.0 if fault is not None else h.latency.draw(kind, key)
        self.staged.append(_Call(kind, ep, fault, now, pause_s=pause))

    def _publish(self) -> None:
        """Make the staged calls runnable: the spool first (every ACTION_COMMITTED and
        TOOL_WAITING is durable before its tool can run), then the queues."""
        if not self.staged:
            return
        self.h.spool.sync()
        with self.lock:
            for c in self.staged:
                self.queues[c.kind].append(c)
        self.staged.clear()

    def _finished(self) -> None:
        """Hand the episodes that just ended to ``on_finish`` (retries come back as new episodes)."""
        while self.h._ended:
            ep = self.h._ended.pop(0)
            self.active -= 1
            if self.on_finish is not None:
                more = self.on_finish(ep)
                if more:
                    self._add(more)

    def _calls(self) -> list[_Call]:
        with self.lock:
            return list(self.running.values())

    def _inflight(self) -> bool:
        with self.lock:
            return bool(self.running or self.queues["tool"] or self.queues["verify"] or self.staged)

    # -- calls -----------------------------------------------------------------------------
    def _next(self, kind: str) -> _Call | None:
        """Under ``lock``: the next queued call of ``kind`` if a slot is free, registered as running."""
        q = self.queues[kind]
        if not q or sum(1 for c in self.running.values() if c.kind == kind and not c.finished) >= self.bounds[kind]:
            return None
        c = q.popleft()
        c.token = next(self._token)
        c.started = time.monotonic()
        timeout = self.h._tool_timeout() if kind == "tool" else float(self.h.limits.verify_timeout_s or math.inf)
        c.deadline = c.started + timeout
        self.running[c.token] = c
        return c

    def _dispatch(self) -> None:
        h = self.h
        self._publish()
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
                    out = (self.h._tool_call(c.ep, c.pause_s) if c.kind == "tool"
                           else self.h._verify_call(c.ep, c.pause_s))
                except BaseException as exc:  # noqa: BLE001 - handed to the harness as the call's outcome
                    out = exc
            self.done.put((c.token, out, time.monotonic()))
            if not self.chain:
                return
            with self.lock:
                c.finished = True
                c = self._next(c.kind)

    def _collect(self, timeout: float | None) -> None:
        """Record finished calls (waiting up to ``timeout`` for the first), then end overdue ones."""
        h = self.h
        try:
            item = self.done.get(timeout=timeout) if timeout is None or timeout > 0 else self.done.get_nowait()
        except queue.Empty:
            item = None
        while item is not None:
            token, out, at = item
            with self.lock:
                c = self.running.pop(token, None)
            if c is not None and not c.ep.done:     # None: abandoned at its deadline, a late answer
                self._resolved(c, out, at)
            try:
                item = self.done.get_nowait()
            except queue.Empty:
                item = None
        now = time.monotonic()
        wall_s = h.limits.wall_clock_s
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
        for c in expired:
            h._terminal(c.ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None,
                        {"error": f"the wall clock ran out while the {c.kind} call was queued "
                                  f"(wall_clock_s={wall_s:g})", "waited_ms": round((now - c.queued) * 1000, 3)})
        for c in overdue:
            if c.kind == "tool":
                h.tools_abandoned += 1
            else:
                h.verifiers_abandoned += 1
            meta = {"waited_ms": round((now - c.queued) * 1000, 3)}
            if c.ep.started + wall_s <= c.deadline:     # the episode's wall clock ran out during the call
                h._terminal(c.ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None,
                            {"error": f"{c.kind} call outlived the episode's wall clock "
                                      f"(wall_clock_s={wall_s:g})"} | meta)
            elif c.kind == "tool":
                h._tool_result(c.ep, ToolTimeout(f"tool call exceeded its deadline of {c.deadline - c.started:g}s "
                                                 f"(harness tool_timeout_s)"), meta)
            else:
                h._verified(c.ep, VerifierTimeout(f"verifier exceeded its deadline of "
                                                  f"{c.deadline - c.started:g}s (verify_timeout_s)"), meta)
        self._finished()

    def _resolved(self, c: _Call, out: Any, at: float) -> None:
        h = self.h
        waited = (at - c.queued) * 1000
        h.stats.sample(c.kind, waited)
        meta = {"waited_ms": round(waited, 3), "injected_ms": round(c.pause_s * 1000, 3)}
        if c.kind == "tool":
            h._tool_result(c.ep, out, meta)
            if not c.ep.done:
                self.ready.append((next(self._order), c.ep, time.monotonic()))
        else:
            h._verified(c.ep, out, meta)

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
        inflight = self._inflight()
        if self.barrier:
            return not inflight
        if self.tool_barrier and (self.queues["tool"] or self.staged or any(c.kind == "tool" for c in self._calls())):
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
            h._start_turn(ep, self.version)
            if not ep.done:
                batch.append((ep, since))
        self._finished()
        h.spool.sync()
        if not batch:
            return
        if self.continuous:
            for ep, since in batch:
                rid = f"{ep.episode_id}/t{ep.turns}"
                self.engine.add_request(rid, h._request(ep), h._sampling(h._budget(ep)))
                self.generating[rid] = (ep, since, now)
            return
        self._batch += 1
        by_budget: dict[int, list[int]] = {}
        for i, (ep, _) in enumerate(batch):
            by_budget.setdefault(h._budget(ep), []).append(i)
        outs: dict[int, Any] = {}
        t0 = time.perf_counter()
        for b, idx in by_budget.items():          # one engine call per distinct budget (usually one)
            reqs = [h._request(batch[i][0]) for i in idx]
            for i, comps in zip(idx, self.engine.generate(reqs, h._sampling(b))):
                outs[i] = comps[0]
        busy = time.perf_counter() - t0
        h.stats.busy(busy, len(batch))
        meta = {"batch": f"{h.worker_id}:{self._batch}", "gen_ms": round(busy * 1000, 3)}
        calls = []
        for i, (ep, since) in enumerate(batch):
            queued = (now - since) * 1000
            h.stats.sample("engine_queue", queued)
            calls.append((ep, h._end_turn(ep, outs[i], self.version, meta | {"queue_ms": round(queued, 3)})))
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
            calls.append((ep, h._end_turn(ep, comp, self.version, meta)))
        self._after_turns(calls)

    def _after_turns(self, calls: list[tuple[Episode, str | None]]) -> None:
        h = self.h
        now = time.monotonic()
        for ep, nxt in calls:
            if nxt == "tool":
                p = ep.call
                h._event(ep, "TOOL_WAITING", step=p["step"], action_id=p["action_id"], state="TOOL_WAITING")
                self._queue("tool", ep, now)
            elif nxt == "verify":
                self._queue("verify", ep, now)
        h.spool.sync()          # every ACTION_COMMITTED is durable before any tool runs
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
            self._dispatch()
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
            calls = self._calls()
            with self.lock:
                queued = [c for q in self.queues.values() for c in q]
            for c in calls:
                wait = min(wait, max(0.0, min(c.deadline, c.ep.started + h.limits.wall_clock_s) - now))
            for c in queued:
                wait = min(wait, max(0.0, c.ep.started + h.limits.wall_clock_s - now))
            if not calls and not queued and not self.ready and not self.staged and self.active and self.exhausted:
                raise RuntimeError(f"harness: {self.active} episodes are active but none can advance")
            self._collect(wait if calls else min(wait, 0.05))
        h.spool.sync()
        return self.eps


def _hold(marker: str) -> None:
    """Crash-test hook: announce the critical point (``<marker>.<pid>``) and wait to be killed."""
    tmp = f"{marker}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, f"{marker}.{os.getpid()}")
    while True:
        time.sleep(3600)


# -- recovery ---------------------------------------------------------------------------------
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
        ep = Episode(eid, group_id, group_size, task, int(cp["seed"]), list(cp["prompt_ids"]),
                     policy_version=int(created["policy_version"]))
        ep.written = set(evs)
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
        out[eid] = ep
    return out
