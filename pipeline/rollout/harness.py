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

A restarted worker rebuilds its episodes from these records
(pipeline/rollout/recovery.py, ``rebuild``).

Terminal outcomes (status / verdict / stop_reason / reward):

- final ``<ans>…<eos>``, verifier PASS/FAIL     ACCEPTED / PASS|FAIL / eos / reward
- hard format failure (no ``<ans>N<eos>``)      REJECTED / FAIL / eos|stop_sequence / 0.0
- per-turn or total token limit                 REJECTED / FAIL / max_length / 0.0
- past a token budget through tool output alone INFRA_FAILED / ENV_ERROR / obs_budget / null
- turn limit (a tool call on the last turn)     REJECTED / FAIL / max_steps / 0.0
- wall-clock limit                              EXPIRED / UNKNOWN / wall_clock / null
- tool timeout (injected, or past the deadline) INFRA_FAILED / ENV_ERROR / env_timeout / null
- environment crash                             INFRA_FAILED / ENV_ERROR / stop_sequence / null
- verifier past ``verify_timeout_s``            INFRA_FAILED / UNKNOWN / verifier_timeout / null
- verifier error or UNKNOWN                     INFRA_FAILED / UNKNOWN / eos / null
- cancelled straggler (``group_redundancy``)    EXPIRED / UNKNOWN / cancelled / null

(An environment that sets ``infra_failure_reward`` to a number gets the naive
scoring instead: a tool timeout ends REJECTED / FAIL / env_timeout with that
reward. It exists for the gate ablations in benchmarks/bench_gates.py.)

Tool output has its own budget when ``Limits`` sets one (per turn and per
episode, cut to fit with a marker the policy sees; pipeline/rollout/observe.py):
a verbose tool is an environment outcome, never the policy's failure.

A null reward is "no valid evaluation" and never 0.0: admission drops those
members from group baselines instead of counting them as policy failures.

A cancelled straggler (``cancel``: the worker over-provisioned its groups and
has the ones it needs) keeps what it generated, with its per-token policy
versions, in its trajectory row; status EXPIRED makes admission exclude it
(reason ``expired``), never a policy failure. One cancelled before its first
token has no row to land (a trajectory needs a response): its TERMINAL event
alone records it.

A carried straggler (``straggler_policy=carry``: the worker's round closed
without it) is not ended: it goes on, and when the worker takes a newer policy
meanwhile its later turns are sampled by it (``token_versions`` records the
version of every token; ``policy_version`` stays the one that started it).

The settings a harness runs under (``Limits``, ``Schedule``, ``Latency``,
``Faults``) are in pipeline/rollout/settings.py; the loop that advances the
episodes, their tool and verifier calls and the engine is the scheduler
(pipeline/rollout/scheduler.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from datetime import datetime, timezone
from typing import Any, Callable

from pipeline import vocab
from pipeline.rollout import codec as codecs
from pipeline.rollout import observe
from pipeline.rollout.engine import Engine, Request, Sampling, derive_seed
from pipeline.rollout.envs import Environment, Stateful, Task, ToolError, ToolTimeout, Verification
from pipeline.rollout.envs.base import tool_schema_version
from pipeline.rollout.episode import TERMINAL_STATES, Episode, EpisodeState, Status, StopReason, Verdict
from pipeline.rollout.scheduler import EngineStats, Scheduler, VerifierTimeout
from pipeline.rollout.settings import Faults, Latency, Limits, Schedule

HARNESS_VERSION = "harness/3"   # 3: tool output past a budget is an environment outcome (obs_budget), issue 41
DEFAULT_TOOL_TIMEOUT_S = 30.0

# Episode and TERMINAL_STATES live in episode.py (the scheduler reads them too); their old paths here still work
__all__ = ["DEFAULT_TOOL_TIMEOUT_S", "HARNESS_VERSION", "TERMINAL_STATES", "Episode", "Harness", "parse_answer",
           "parse_call"]


def _now() -> datetime:
    return datetime.now(timezone.utc)


def parse_answer(turn: list[int]) -> str | None:
    """The answer text of a final turn ``<ans>…<eos>``, None when the format is broken."""
    if len(turn) >= 2 and turn[0] == vocab.ANS_ID and turn[-1] == vocab.EOS_ID:
        body = turn[1:-1]
        if all(t >= len(vocab.SPECIAL) for t in body):
            return vocab.decode(body)
    return None


def scripted_turns(env: Environment) -> int:
    """An environment's ``scripted_tool_turns``: its first N turns are tool calls whose argument is
    the turn's text, whatever the policy wrote (a load generator: envs/relay.py); 0 = none."""
    return int(getattr(env, "scripted_tool_turns", 0) or 0)


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
        self.cancel_rest = False          # set by a worker that has its groups: the active episodes end cancelled
        self.cancelled = 0                # episodes ended cancelled (``cancel``)
        self.pool_bounds: dict[str, int] = {}   # the tool / verifier pool sizes the scheduler ran with
        self._ended: list[Episode] = []   # terminal since the scheduler last looked

    # -- events ------------------------------------------------------------------------
    def _event(self, ep: Episode, event_type: str, *, step: int, action_id: str = "", state: EpisodeState | None = None,
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

    def tool_waiting(self, ep: Episode) -> None:
        """TOOL_WAITING: the committed action is handed to its tool (the scheduler queues the call)."""
        p = ep.call
        self._event(ep, "TOOL_WAITING", step=p["step"], action_id=p["action_id"], state="TOOL_WAITING")

    def next_ended(self) -> Episode | None:
        """The oldest episode that became terminal and was not handed on yet (None: none); the scheduler
        hands each to the worker."""
        return self._ended.pop(0) if self._ended else None

    # -- episodes ------------------------------------------------------------------------
    def new_episode(self, *, episode_id: str, group_id: str, group_size: int, task: Task, seed: int,
                    policy_version: int, extra: dict[str, Any] | None = None) -> Episode:
        # [i28 rendering] the codec renders the prompt: text protocol, or the env's chat messages
        ep = Episode(episode_id=episode_id, group_id=group_id, group_size=group_size, task=task, seed=seed,
                     prompt_ids=self.codec.prompt_ids(task), policy_version=policy_version)
        if isinstance(self.env, Stateful):       # the episode's own state, from the task's snapshot
            ep.env_state_hash = self.env.open(episode_id, task)
            extra = (extra or {}) | {"env_state_hash": ep.env_state_hash}
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
        return Scheduler(self, episodes, feed, on_finish, tick).run()

    def restore(self, ep: Episode) -> None:
        """A stateful episode rebuilt after a crash: its state again from the recorded
        snapshot, with the actions it had executed re-applied (``Stateful.open``);
        the scheduler calls it as it takes the episode in. One that cannot be
        restored ends INFRA_FAILED / ENV_ERROR."""
        if ep.replay is None or ep.done or not isinstance(self.env, Stateful):
            return
        replay, ep.replay = ep.replay, None
        try:
            state = self.env.open(ep.episode_id, ep.task, replay)
        except ToolError as exc:
            state, err = None, str(exc)
        else:
            err = f"the snapshot is {state}, the episode started from {ep.env_state_hash}"
        if state is None or state != ep.env_state_hash:
            self.terminal(ep, "INFRA_FAILED", "ENV_ERROR", "stop_sequence", None, None,
                           {"error": f"cannot restore the episode's state: {err}"})

    # -- one turn ------------------------------------------------------------------------
    def start_turn(self, ep: Episode, version: int) -> None:
        """GENERATING: the turn's context is final (a pending observation joins it first)."""
        if ep.pending is not None and "output" in ep.pending:
            self._observe(ep)
            if ep.done:
                return
        if ep.response_ids and self._past_wall_clock(ep):       # ran out while waiting for the engine
            self.terminal(ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None,
                           {"error": "the wall clock ran out waiting for the engine"})
            return
        if ep.state == "CREATED":
            ep.policy_version = version if ep.turns == 0 else ep.policy_version
        self._event(ep, "GENERATING", step=ep.turns, state="GENERATING", version=version, payload={"turn": ep.turns})

    def turn_sampling(self, budget: int) -> Sampling:
        return Sampling(self.sampling.temperature, self.sampling.top_p, max(budget, 1),
                        self.sampling.stop_ids if self.codec.char else self.codec.stop_ids)

    def turn_budget(self, ep: Episode) -> int:
        return max(1, min(self.limits.max_tokens_per_turn, self.limits.max_total_tokens - self._spent(ep)))

    def _spent(self, ep: Episode) -> int:
        """Tokens counted against ``max_total_tokens``: every response token, or the
        policy's alone when observations have their own budget."""
        return sum(ep.mask) if self.limits.obs_budget else len(ep.response_ids)

    def turn_request(self, ep: Episode) -> Request:
        return Request(tuple(self.next_turn_context(ep)), 1, derive_seed(ep.seed, ep.turns))

    def end_turn(self, ep: Episode, c: Any, version: int, meta: dict[str, Any]) -> str | None:
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
            self.terminal(ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None, turn_payload)
            return None
        if ep.turns <= scripted_turns(self.env):   # the environment takes the turn's text as its call, whatever it is
            call, finish = self.codec.decode(turn), "stop"
        elif scripted_turns(self.env):            # ... and the turn after the last one as the final turn
            call, finish = None, "stop"
        else:
            call = parse_call(turn) if self.codec.char else codecs.parse_turn(self.codec, turn)[0]
        if finish == "length":
            self._reject(ep, "max_length", turn_payload)
        elif call is not None and self.env.multi_turn:
            if ep.turns >= self.limits.max_turns:
                self._reject(ep, "max_steps", turn_payload)
            elif self._spent(ep) >= self.limits.max_total_tokens:
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

    def _reject(self, ep: Episode, stop_reason: StopReason, turn_payload: dict[str, Any]) -> None:
        v = self.env.verify(ep.task, None, ep.tool_calls)   # components of a failed format
        self.terminal(ep, "REJECTED", "FAIL", stop_reason, 0.0, v.components, turn_payload)

    def _past_wall_clock(self, ep: Episode, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) - ep.started > self.limits.wall_clock_s

    # -- tools ---------------------------------------------------------------------------
    def tool_timeout(self) -> float:
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

    def tool_fault(self, ep: Episode) -> Exception | None:
        rng = self._draw("tool", ep, ep.call["step"])
        if rng.random() < self.faults.tool_timeout:
            return ToolTimeout("injected tool timeout")
        if rng.random() < self.faults.env_crash:
            return ToolError("injected environment crash")
        return None

    def call_tool(self, ep: Episode, pause_s: float) -> Any:
        """Runs in a tool thread: the injected latency, then the environment's tool."""
        if pause_s > 0:
            time.sleep(pause_s)
        p = ep.call
        return self.env.step(ep.task, p["text"], key=f"{ep.episode_id}/{p['action_id']}")

    def record_tool_result(self, ep: Episode, out: Any, meta: dict[str, Any]) -> None:
        """Record a tool call's outcome (main thread). An executed call's
        observation joins the context when its next turn starts (``start_turn``)."""
        p = ep.call
        if isinstance(out, ToolTimeout):
            naive_reward = getattr(self.env, "infra_failure_reward", None)
            if naive_reward is not None:
                # ablation only (benchmarks/bench_gates.py): the naive harness that scores a
                # timeout as the policy's failure instead of recording "no valid evaluation"
                v = self.env.verify(ep.task, None, ep.tool_calls)
                self.terminal(ep, "REJECTED", "FAIL", "env_timeout", float(naive_reward), v.components,
                               {"error": str(out)})
                return
            self.terminal(ep, "INFRA_FAILED", "ENV_ERROR", "env_timeout", None, None, {"error": str(out)})
            return
        if isinstance(out, BaseException):   # any environment failure is an infra failure
            self.terminal(ep, "INFRA_FAILED", "ENV_ERROR", "stop_sequence", None, None,
                           {"error": f"{type(out).__name__}: {out}"})
            return
        self.tool_executions += 1
        try:
            out, cut = self._fit_observation(ep, out)
        except observe.BudgetSpent as exc:   # the episode's observation budget is spent: the environment's doing
            self.terminal(ep, "INFRA_FAILED", "ENV_ERROR", "obs_budget", None, None, {"error": str(exc)})
            return
        p["output"] = out
        self._event(ep, "ACTION_EXECUTED", step=p["step"], action_id=p["action_id"], state="TOOL_WAITING",
                    payload={"output": out} | ({"truncated": cut} if cut else {}) | meta)
        self._executed += 1
        if self.faults.kill_after_executed and self._executed == self.faults.kill_after_executed:
            self.spool.sync()
            os.kill(os.getpid(), signal.SIGKILL)   # the crash test: executed, observation not persisted
        if self.faults.hold_after_executed and self._executed == self.faults.hold_after_executed:
            self.spool.sync()
            _hold(self.faults.hold_file)

    def _fit_observation(self, ep: Episode, out: Any) -> tuple[Any, dict | None]:
        """A tool's output cut to the observation budget left (pipeline/rollout/observe.py):
        (output, the cut's record or None). ``ValueError`` when nothing fits."""
        lim = self.limits
        if not lim.obs_budget or not isinstance(out, str):
            return out, None
        caps = [c for c in (lim.max_obs_tokens_per_turn,) if c > 0]
        if lim.max_obs_tokens > 0:
            caps.append(lim.max_obs_tokens - (len(ep.mask) - sum(ep.mask)))
        last = ep.response_ids[-1] if ep.response_ids else None
        return observe.fit(out, lambda text: self.observation_ids(text, last), min(caps), lim.obs_keep)

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
            self.terminal(ep, "EXPIRED", "UNKNOWN", "wall_clock", None, None, None)
        elif self._spent(ep) >= self.limits.max_total_tokens:
            # past the budget through the tool's output alone: an environment outcome, never the
            # policy's failure (it was REJECTED / max_length with reward 0 before issue 41)
            self.terminal(ep, "INFRA_FAILED", "ENV_ERROR", "obs_budget", None, None,
                           {"error": f"the observation took the episode past max_total_tokens "
                                     f"({len(ep.response_ids)} >= {self.limits.max_total_tokens})"})

    # -- verification ----------------------------------------------------------------------
    def call_verifier(self, ep: Episode, pause_s: float) -> Verification:
        """Runs in a verifier thread: the injected latency, then the environment's verifier."""
        if pause_s > 0:
            time.sleep(pause_s)
        return self.env.verify(ep.task, self._answer(ep), ep.tool_calls)

    def _answer(self, ep: Episode) -> str | None:
        turn = ep.final_turn or []
        return parse_answer(turn) if self.codec.char else codecs.parse_turn(self.codec, turn)[1]

    def _final_stop(self, ep: Episode) -> StopReason:
        turn = ep.final_turn or []
        return "eos" if turn and turn[-1] == self.codec.eos_id else "stop_sequence"

    def verifier_fault(self, ep: Episode) -> Exception | None:
        if self._draw("verifier", ep, ep.turns).random() < self.faults.verifier_error:
            return RuntimeError("injected verifier error")
        return None

    def record_verdict(self, ep: Episode, out: Any, meta: dict[str, Any]) -> None:
        stop = self._final_stop(ep)
        if not isinstance(out, BaseException):
            bad = self._verifier_extras(ep, out)
            if bad:   # the environment broke its own contract: its verdict is not trusted (null reward)
                out = RuntimeError(bad)
        if isinstance(out, VerifierTimeout):
            self.terminal(ep, "INFRA_FAILED", "UNKNOWN", "verifier_timeout", None, None,
                           {"error": f"verifier_timeout: {out}"} | meta)
        elif isinstance(out, BaseException):
            self.terminal(ep, "INFRA_FAILED", "UNKNOWN", stop, None, None,
                           {"error": f"verifier: {type(out).__name__}: {out}"} | meta)
        elif out.verdict == "UNKNOWN" or out.reward is None:
            self.terminal(ep, "INFRA_FAILED", "UNKNOWN", stop, None, out.components or None, meta or None)
        elif not out.format_ok:
            self.terminal(ep, "REJECTED", "FAIL", stop, 0.0, out.components, meta or None)
        else:
            self.terminal(ep, "ACCEPTED", out.verdict, stop, float(out.reward), out.components, meta or None)

    @staticmethod
    def _verifier_extras(ep: Episode, out: Any) -> str | None:
        """Record the verifier's evidence, confidence and per-turn rewards with the reward (columns
        verifier_evidence, verifier_confidence, turn_rewards; none is in the content hash). Per-turn rewards
        must number the policy turns (the contract's length: runs of loss_mask 1s), never truncated or padded:
        otherwise the reason, and nothing is recorded."""
        turns = getattr(out, "turn_rewards", None)
        if turns is not None:
            runs = sum(1 for i, m in enumerate(ep.mask) if m == 1 and (i == 0 or ep.mask[i - 1] != 1))
            if len(turns) != runs:
                return (f"{len(turns)} turn rewards for {runs} policy turns (give one per turn, runs of "
                        "loss_mask 1s, or None)")
        conf = getattr(out, "confidence", None)
        if conf is not None and not (isinstance(conf, (int, float)) and 0.0 <= float(conf) <= 1.0):
            return f"confidence {conf!r} is not a number in [0, 1]"
        ep.turn_rewards = None if turns is None else [float(x) for x in turns]
        ep.evidence = getattr(out, "evidence", None)
        ep.confidence = None if conf is None else float(conf)
        return None

    def terminal(self, ep: Episode, status: Status, verdict: Verdict, stop_reason: StopReason, reward: float | None,
                 components: dict[str, float] | None, payload: dict[str, Any] | None) -> None:
        """End ``ep``: its trajectory row, then its TERMINAL event (status / verdict / stop_reason / reward)."""
        ep.status, ep.verdict, ep.stop_reason, ep.reward, ep.components = status, verdict, stop_reason, reward, components
        ep.pending = None
        finished = _now()
        self.spool.append({"kind": "trajectory", **self.trajectory_row(ep, finished)})
        self._event(ep, "TERMINAL", step=ep.turns, state=status, payload=(payload or {}) | {
            "status": status, "verdict": verdict, "stop_reason": stop_reason, "reward": reward})
        ep.finished_mono = time.monotonic()
        self._ended.append(ep)
        self._close(ep)

    def _close(self, ep: Episode) -> None:
        if isinstance(self.env, Stateful):
            self.env.close(ep.episode_id)

    def cancel(self, ep: Episode) -> None:
        """End an over-provisioned straggler: EXPIRED / UNKNOWN / cancelled, null reward.
        Before its first token there is no trajectory to land: the TERMINAL event alone."""
        if ep.pending is not None and "output" in ep.pending:
            self._observe(ep)        # an executed call's output joins the record first: nothing is lost
            if ep.done:
                return
        self.cancelled += 1
        payload = {"error": "cancelled: the run had the groups it needed (group_redundancy)"}
        if ep.response_ids:
            self.terminal(ep, "EXPIRED", "UNKNOWN", "cancelled", None, None, payload)
            return
        ep.status, ep.verdict, ep.stop_reason, ep.reward, ep.components = "EXPIRED", "UNKNOWN", "cancelled", None, None
        ep.pending = None
        self._event(ep, "TERMINAL", step=ep.turns, state="EXPIRED", payload=payload | {
            "status": "EXPIRED", "verdict": "UNKNOWN", "stop_reason": "cancelled", "reward": None, "row": False})
        ep.finished_mono = time.monotonic()
        self._ended.append(ep)
        self._close(ep)

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
            "tool_schema_version": tool_schema_version(self.env), "env_state_hash": ep.env_state_hash,
            "turn_rewards": ep.turn_rewards, "verifier_confidence": ep.confidence, "verifier_evidence": ep.evidence,
        }


def _hold(marker: str) -> None:
    """Crash-test hook: announce the critical point (``<marker>.<pid>``) and wait to be killed."""
    tmp = f"{marker}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, f"{marker}.{os.getpid()}")
    while True:
        time.sleep(3600)
