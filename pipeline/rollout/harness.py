"""The rollout harness: one state machine per episode, advanced in waves.

States: CREATED -> GENERATING -> (TOOL_WAITING -> GENERATING)* -> VERIFYING
-> ACCEPTED | REJECTED | INFRA_FAILED | EXPIRED.

Every state change and side effect is an event (``events`` table, key
``(episode_id, step_id, action_id, event_type)``), written to the worker's
spool and fsynced *before* the harness acts on it:

    GENERATING(step k)                      a model turn starts
    ACTION_COMMITTED(step k, action a<k>)   the turn's tokens + the tool call (before the tool runs)
    TOOL_WAITING                            handed to the tool
    ACTION_EXECUTED                         the tool ran; its output is in the payload
    OBSERVATION_PERSISTED                   the observation tokens joined the context (last)
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
- verifier error or UNKNOWN                     INFRA_FAILED / UNKNOWN / eos / null

(An environment that sets ``infra_failure_reward`` to a number gets the naive
scoring instead: a tool timeout ends REJECTED / FAIL / env_timeout with that
reward. It exists for the gate ablations in benchmarks/bench_gates.py.)

A null reward is "no valid evaluation" and never 0.0: admission drops those
members from group baselines instead of counting them as policy failures.

Tools run under a deadline and concurrently: the wave's tool calls run in
daemon threads, at most ``Limits.tool_concurrency`` at once, each bounded by
``Limits.tool_timeout_s`` (else the environment's ``tool_timeout_s``, else
30s). A call past its deadline ends its episode INFRA_FAILED / env_timeout
and its thread is abandoned, so a hung tool never stalls the wave or keeps the
worker alive. Outcomes are recorded in episode order, whatever order the calls
finish in.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from pipeline.rollout import codec as codecs, vocab
from pipeline.rollout.engine import Engine, Request, Sampling, derive_seed
from pipeline.rollout.envs import Environment, Task, ToolError, ToolTimeout, Verification
from pipeline.rollout.envs.base import tool_schema_version

HARNESS_VERSION = "harness/1"
DEFAULT_TOOL_TIMEOUT_S = 30.0
TERMINAL_STATES = ("ACCEPTED", "REJECTED", "INFRA_FAILED", "EXPIRED")


@dataclass(frozen=True)
class Limits:
    max_turns: int = 4
    max_tokens_per_turn: int = 16
    max_total_tokens: int = 64       # response tokens, policy + observation
    wall_clock_s: float = 120.0      # per trajectory
    tool_timeout_s: float = 0.0      # per tool call (0: the environment's tool_timeout_s, else 30s)
    tool_concurrency: int = 8        # tool calls of a wave running at once


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
                 codec=None) -> None:
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
        self._rng = random.Random(derive_seed(faults.seed, worker_id))
        self._executed = 0
        self.tool_executions = 0
        self.tools_abandoned = 0          # tool threads left behind past their deadline

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

    # -- the wave ------------------------------------------------------------------------
    def new_episode(self, *, episode_id: str, group_id: str, group_size: int, task: Task, seed: int,
                    policy_version: int, extra: dict[str, Any] | None = None) -> Episode:
        # [i28 rendering] the codec renders the prompt: text protocol, or the env's chat messages
        ep = Episode(episode_id, group_id, group_size, task, seed, self.codec.prompt_ids(task),
                     policy_version=policy_version)
        self._event(ep, "CREATED", step=0, state="CREATED", payload={
            "task_id": task.task_id, "prompt_ids": ep.prompt_ids, "seed": seed, "group_size": group_size,
            "difficulty": task.difficulty} | (extra or {}))
        return ep

    def run(self, episodes: list[Episode]) -> list[Episode]:
        """Advance every episode to a terminal state (resumed ones first finish
        what the crash interrupted)."""
        self.spool.sync()
        self._finish_pending([e for e in episodes if e.pending is not None and not e.done])
        self._verify([e for e in episodes if e.state == "VERIFYING"])
        engine, version = self.engine_fn()
        first = True
        while True:
            gen = [e for e in episodes if not e.done and e.state in ("CREATED", "GENERATING")]
            if not gen:
                break
            if self.follow_every_turn and not first:
                engine, version = self.engine_fn()     # a newer policy samples the next turns
            first = False
            self._generate(engine, version, gen)
            self._finish_pending([e for e in gen if e.pending is not None and not e.done])
            self._verify([e for e in gen if e.state == "VERIFYING"])
        self.spool.sync()
        return episodes

    def _generate(self, engine: Engine, version: int, active: list[Episode]) -> None:
        for ep in active:
            if ep.state == "CREATED":
                ep.policy_version = version if ep.turns == 0 else ep.policy_version
            self._event(ep, "GENERATING", step=ep.turns, state="GENERATING", version=version,
                        payload={"turn": ep.turns})
        self.spool.sync()
        budget = [min(self.limits.max_tokens_per_turn, self.limits.max_total_tokens - len(e.response_ids))
                  for e in active]
        # one engine call per distinct budget (usually one)
        by_budget: dict[int, list[int]] = {}
        for i, b in enumerate(budget):
            by_budget.setdefault(max(b, 1), []).append(i)
        outs: dict[int, Any] = {}
        for b, idx in by_budget.items():
            sampling = Sampling(self.sampling.temperature, self.sampling.top_p, b,
                                self.sampling.stop_ids if self.codec.char else self.codec.stop_ids)
            reqs = [Request(tuple(active[i].prompt_ids + active[i].response_ids), 1,
                            derive_seed(active[i].seed, active[i].turns)) for i in idx]
            for i, comps in zip(idx, engine.generate(reqs, sampling)):
                outs[i] = comps[0]
        for i, ep in enumerate(active):
            c = outs[i]
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
            turn_payload = {"turn": ep.turns - 1, "ids": turn, "logprobs": lps, "version": version}
            if time.monotonic() - ep.started > self.limits.wall_clock_s:
                self._terminal(ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None, turn_payload)
                continue
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
            else:
                ep.final_turn = turn
                self._event(ep, "VERIFYING", step=ep.turns - 1, state="VERIFYING", version=version,
                            payload=turn_payload | {"stop": "eos" if turn[-1] == self.codec.eos_id else "stop_sequence"})
        self.spool.sync()   # every ACTION_COMMITTED is durable before any tool runs

    def _reject(self, ep: Episode, stop_reason: str, turn_payload: dict[str, Any]) -> None:
        v = self.env.verify(ep.task, None, ep.tool_calls)   # components of a failed format
        self._terminal(ep, "REJECTED", "FAIL", stop_reason, 0.0, v.components, turn_payload)

    def _finish_pending(self, eps: list[Episode]) -> None:
        if not eps:
            return
        for ep in eps:
            p = ep.call
            if "output" not in p and not p.get("waiting"):
                self._event(ep, "TOOL_WAITING", step=p["step"], action_id=p["action_id"], state="TOOL_WAITING")
        self.spool.sync()
        if self.before_tools is not None and any(
                "output" not in e.call and (self.env.idempotent or not e.call.get("unconfirmed")) for e in eps):
            self.before_tools()
        executed: list[Episode] = []
        calls: list[tuple[Episode, Exception | None]] = []   # (episode, injected fault or None), in order
        for ep in eps:
            p = ep.call
            if "output" in p:          # executed before a crash: use the recorded output
                executed.append(ep)
                continue
            if p.get("unconfirmed") and not self.env.idempotent:
                self._terminal(ep, "INFRA_FAILED", "ENV_ERROR", "stop_sequence", None, None,
                               {"error": "tool outcome unknown after a restart; the tool is not idempotent"})
                continue
            fault: Exception | None = None     # drawn here, in episode order: the same faults at any concurrency
            if self._rng.random() < self.faults.tool_timeout:
                fault = ToolTimeout("injected tool timeout")
            elif self._rng.random() < self.faults.env_crash:
                fault = ToolError("injected environment crash")
            calls.append((ep, fault))
        for ep, out in self._run_tools(calls):
            p = ep.call
            if isinstance(out, ToolTimeout):
                naive_reward = getattr(self.env, "infra_failure_reward", None)
                if naive_reward is not None:
                    # ablation only (benchmarks/bench_gates.py): the naive harness that scores a
                    # timeout as the policy's failure instead of recording "no valid evaluation"
                    v = self.env.verify(ep.task, None, ep.tool_calls)
                    self._terminal(ep, "REJECTED", "FAIL", "env_timeout", float(naive_reward),
                                   v.components, {"error": str(out)})
                    continue
                self._terminal(ep, "INFRA_FAILED", "ENV_ERROR", "env_timeout", None, None, {"error": str(out)})
                continue
            if isinstance(out, BaseException):   # any environment failure is an infra failure
                self._terminal(ep, "INFRA_FAILED", "ENV_ERROR", "stop_sequence", None, None,
                               {"error": f"{type(out).__name__}: {out}"})
                continue
            self.tool_executions += 1
            p["output"] = out
            self._event(ep, "ACTION_EXECUTED", step=p["step"], action_id=p["action_id"], state="TOOL_WAITING",
                        payload={"output": out})
            executed.append(ep)
            self._executed += 1
            if self.faults.kill_after_executed and self._executed == self.faults.kill_after_executed:
                self.spool.sync()
                os.kill(os.getpid(), signal.SIGKILL)   # the crash test: executed, observation not persisted
            if self.faults.hold_after_executed and self._executed == self.faults.hold_after_executed:
                self.spool.sync()
                _hold(self.faults.hold_file)
        self.spool.sync()
        for ep in executed:
            p = ep.call
            # [i28 rendering] the codec's observation ids (<obs>..</obs>, or a chat tool message), appended as is
            obs = self.codec.observation_ids(p["output"], ep.response_ids[-1] if ep.response_ids else None)
            ep.response_ids += obs
            ep.logprobs += [0.0] * len(obs)
            ep.mask += [0] * len(obs)
            ep.token_versions += [-1] * len(obs)
            ep.tool_calls += 1
            ep.pending = None
            self._event(ep, "OBSERVATION_PERSISTED", step=p["step"], action_id=p["action_id"], state="GENERATING",
                        payload={"obs": obs})
            if time.monotonic() - ep.started > self.limits.wall_clock_s:
                self._terminal(ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None, None)
            elif len(ep.response_ids) >= self.limits.max_total_tokens:
                self._reject(ep, "max_length", {})
        self.spool.sync()

    def _tool_timeout(self) -> float:
        """The per-call deadline: the run's ``tool_timeout_s`` when set (> 0), else the
        environment's declared ``tool_timeout_s``, else none."""
        return float(self.limits.tool_timeout_s or getattr(self.env, "tool_timeout_s", 0) or DEFAULT_TOOL_TIMEOUT_S)

    def _run_tools(self, calls: list[tuple[Episode, Exception | None]]):
        """Run the wave's tool calls, at most ``tool_concurrency`` at once, each in a
        daemon thread under the deadline; yield ``(episode, output or exception)``
        in episode order, each as soon as it and every earlier call are resolved
        (so the caller records them in a fixed order). A call past its deadline
        yields ``ToolTimeout`` and its thread is abandoned (a thread cannot be
        killed; it is a daemon, so it never keeps the worker alive, and it stops
        holding a concurrency slot): a hung tool costs one episode, not the wave.
        The crash-test faults (kill/hold after the Nth execution) run the calls one
        at a time so the crash point is exact."""
        if not calls:
            return
        deadline_s = self._tool_timeout()
        bound = max(1, int(self.limits.tool_concurrency))
        if self.faults.kill_after_executed or self.faults.hold_after_executed:
            bound = 1
        cond = threading.Condition()
        results: dict[int, Any] = {}
        started: dict[int, float] = {}
        running: set[int] = set()
        nxt = emitted = 0

        def work(i: int, ep: Episode) -> None:
            p = ep.call
            try:
                out: Any = self.env.step(ep.task, p["text"], key=f"{ep.episode_id}/{p['action_id']}")
            except BaseException as exc:  # noqa: BLE001 - handed to the harness as the call's outcome
                out = exc
            with cond:
                if i in running:          # not abandoned: its result counts
                    results[i] = out
                    running.discard(i)
                cond.notify_all()

        while emitted < len(calls):
            with cond:
                while nxt < len(calls) and len(running) < bound:
                    ep, fault = calls[nxt]
                    if fault is not None:
                        results[nxt] = fault
                    else:
                        running.add(nxt)
                        started[nxt] = time.monotonic()
                        threading.Thread(target=work, args=(nxt, ep), name=f"tool-{ep.episode_id}",
                                         daemon=True).start()
                    nxt += 1
                if emitted not in results:
                    wait = None
                    if deadline_s > 0 and running:
                        wait = max(0.0, min(started[i] for i in running) + deadline_s - time.monotonic())
                    cond.wait(wait)
                    now = time.monotonic()
                    for i in list(running):
                        if deadline_s > 0 and now - started[i] >= deadline_s:
                            running.discard(i)            # abandoned: a late answer is ignored
                            self.tools_abandoned += 1
                            results[i] = ToolTimeout(f"tool call exceeded its deadline of {deadline_s:g}s "
                                                     f"(harness tool_timeout_s)")
                ready = []
                while emitted in results:
                    ready.append((calls[emitted][0], results.pop(emitted)))
                    emitted += 1
            for item in ready:      # recorded outside the lock, in order (may SIGKILL: crash tests)
                yield item

    def _verify(self, eps: list[Episode]) -> None:
        for ep in eps:
            turn = ep.final_turn or []
            stop = "eos" if turn and turn[-1] == self.codec.eos_id else "stop_sequence"
            answer = parse_answer(turn) if self.codec.char else codecs.parse_turn(self.codec, turn)[1]
            try:
                if self._rng.random() < self.faults.verifier_error:
                    raise RuntimeError("injected verifier error")
                v: Verification = self.env.verify(ep.task, answer, ep.tool_calls)
            except Exception as exc:  # noqa: BLE001
                self._terminal(ep, "INFRA_FAILED", "UNKNOWN", stop, None, None,
                               {"error": f"verifier: {type(exc).__name__}: {exc}"})
                continue
            if v.verdict == "UNKNOWN" or v.reward is None:
                self._terminal(ep, "INFRA_FAILED", "UNKNOWN", stop, None, v.components or None, None)
            elif not v.format_ok:
                self._terminal(ep, "REJECTED", "FAIL", stop, 0.0, v.components, None)
            else:
                self._terminal(ep, "ACCEPTED", v.verdict, stop, float(v.reward), v.components, None)
        self.spool.sync()

    def _terminal(self, ep: Episode, status: str, verdict: str, stop_reason: str, reward: float | None,
                  components: dict[str, float] | None, payload: dict[str, Any] | None) -> None:
        ep.status, ep.verdict, ep.stop_reason, ep.reward, ep.components = status, verdict, stop_reason, reward, components
        ep.pending = None
        finished = _now()
        self.spool.append({"kind": "trajectory", **self.trajectory_row(ep, finished)})
        self._event(ep, "TERMINAL", step=ep.turns, state=status, payload=(payload or {}) | {
            "status": status, "verdict": verdict, "stop_reason": stop_reason, "reward": reward})

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
