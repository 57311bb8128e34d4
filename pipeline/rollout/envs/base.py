"""The environment protocol and the registry (pure Python).

An environment is three methods and a few version strings:

- ``reset(seed, split)`` -> ``Task``: a deterministic prompt for a seed.
  ``split="eval"`` draws from a held-out part of the task space that
  ``split="train"`` never returns (the split is a property of the task itself,
  not of the seed, so training prompts and evaluation prompts are disjoint).
- ``step(task, action, key=...)`` -> observation text: run one tool call (the
  text the policy wrote between ``<call>`` and ``</call>``). Raise ``ToolError``
  for a failed call (the harness records INFRA_FAILED / ENV_ERROR, null
  reward). ``key`` is the action's idempotency key: a tool with side effects
  must return the recorded result when called again with a key it has seen,
  and declare ``idempotent = False`` if it cannot (the harness then never
  re-runs an action whose outcome is unknown after a crash).
  The harness runs a wave's tool calls concurrently (``tool_concurrency``
  threads: ``step`` must be thread-safe, or declare ``max_tool_concurrency = 1``)
  and each under a deadline: an environment may declare ``tool_timeout_s``
  (its own deadline, used unless the run sets one); a call past it ends the
  episode INFRA_FAILED / env_timeout and is abandoned, not waited for.
  The pools are sized for I/O (by default one thread per episode in flight,
  at most 256; pipeline/rollout/settings.py ``pool_size``): an environment
  whose backend allows only so many calls at once declares
  ``max_tool_concurrency`` (and ``max_verifier_concurrency`` for its
  verifier), which bounds the pool whatever the run asks.
- ``verify(task, answer, num_tool_calls)`` -> ``Verification``: the verdict
  (PASS / FAIL / UNKNOWN) and the reward, with named components, and
  optionally its ``evidence`` (text) and ``confidence`` (in [0, 1]), the
  contract's ``verifier_evidence`` / ``verifier_confidence``.

A single-turn environment simply has no tools (``step`` raises). Example,
a complete environment in 25 lines::

    from pipeline.rollout.envs import Task, Verification, ToolError, register_env, split_of

    @register_env
    class EchoDigits:
        name = "echo-digits"
        version = env_version = "1"
        verifier_version = "1"
        prompt_template_rev = "e:{digits}=/1"
        multi_turn = False
        idempotent = True

        def reset(self, seed: int, split: str = "train") -> Task:
            import random
            rng = random.Random(seed)
            while True:
                digits = "".join(rng.choice("0123456789") for _ in range(4))
                if split_of(digits) == split:
                    return Task(f"echo-{digits}", f"e:{digits}=", answer=digits, difficulty="easy")

        def step(self, task: Task, action: str, *, key: str) -> str:
            raise ToolError("echo-digits has no tools")

        def verify(self, task: Task, answer: str | None, num_tool_calls: int) -> Verification:
            if answer is None:                       # the policy broke the answer format: a gate
                return Verification("FAIL", 0.0, {"task_success": 0.0, "format": 0.0}, format_ok=False)
            ok = answer == task.answer
            return Verification("PASS" if ok else "FAIL", float(ok), {"task_success": float(ok), "format": 1.0})

Two optional declarations (read with ``tool_schema_version(env)`` and
``component_tags(env)``; environments without them still work):
``tool_schema_version`` names the tool interface the policy is shown (the
harness records it per trajectory; admission compares it); ``component_tags``
maps each reward component to ``fact`` (observed from the environment, e.g.
the task really succeeded) or ``heuristic`` (a shaping term, e.g. format), so
diagnostics (sql/diag_component_variance.sql) separate the two.

The answer the harness hands to ``verify`` is the text between ``<ans>`` and
``<eos>`` of the final turn, or None when the final turn is not
``<ans>…<eos>`` (a hard format failure; ``answer_format`` below).

Stateful environments (``Stateful``, optional; docs/how-to/stateful-environments.md,
with ``sql-agent`` as the example): ``open(episode_id, task, replay=())``
creates the episode's own state from the task's content-addressed snapshot and
returns the snapshot's hash (the trajectory's ``env_state_hash``: members of a
group share it, admission refuses a group whose members do not); after a crash
the harness calls it again with the actions already executed, in order, which
``open`` re-applies to a fresh copy; ``step`` finds the episode's state by its
key (``<episode_id>/<action_id>``); ``close(episode_id)`` drops it once the
episode has ended.

Chat rendering (``ChatRendering``, optional): for a policy whose tokenizer has
a chat template, the environment renders a task as chat messages
(``chat_messages``: system, user, any worked example turns) and reads the
model's own format back: ``chat_action(name, arguments)`` turns a JSON tool
call of the assistant turn into the ``step`` action text, ``chat_answer(text)``
the final assistant message into the ``verify`` answer (None: no answer, a
format failure). The harness never sees the template: the codec
(pipeline/rollout/codec.py ``ChatCodec``) applies it and appends tool results
as ``tool`` messages (loss mask 0). ``chat_template_rev`` names the rendering
(``<family>/<rev>``); trajectories record it with the template's hash as
their ``prompt_template_rev``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from pipeline.errors import ConfigError, PipelineError

Split = Literal["train", "eval"]
VerdictName = Literal["PASS", "FAIL", "UNKNOWN"]


@dataclass(frozen=True)
class Task:
    task_id: str                    # stable id of this prompt
    prompt: str                     # text after <bos> (vocab characters and markers)
    answer: Any = None              # hidden from the policy; for the verifier
    difficulty: str | None = None   # bucket label
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Verification:
    verdict: VerdictName
    reward: float | None            # None only with UNKNOWN
    components: dict[str, float] = field(default_factory=dict)
    format_ok: bool = True
    # optional, recorded beside the reward components (trajectories.verifier_evidence / verifier_confidence):
    evidence: str | None = None     # what the verdict rests on (parsed answer vs reference, a judge's rationale)
    confidence: float | None = None  # in [0, 1]; None = the verifier does not say
    # per-turn credit (trajectories.turn_rewards): one reward per policy turn, in order; None = the trajectory only
    turn_rewards: list[float] | None = None


class ToolError(PipelineError):
    """A tool call failed for infrastructure reasons (not the policy's fault)."""

    transient = True


class ToolTimeout(ToolError):
    """A tool call did not answer in time."""


@runtime_checkable
class Environment(Protocol):
    name: str
    version: str                    # task_version
    env_version: str
    verifier_version: str
    prompt_template_rev: str
    multi_turn: bool
    idempotent: bool                # step may be re-run safely for the same key

    def reset(self, seed: int, split: Split = "train") -> Task: ...

    def step(self, task: Task, action: str, *, key: str) -> str: ...

    def verify(self, task: Task, answer: str | None, num_tool_calls: int) -> Verification: ...


@runtime_checkable
class Demonstrating(Protocol):
    """An environment that writes a worked answer for a task: ``(text, is_policy_tokens)`` segments
    (the policy init's supervised warm start trains on them)."""

    def demonstration(self, task: Task, rng: random.Random, tool_fraction: float = ...) -> list[tuple[str, bool]]: ...


@runtime_checkable
class ChatRendering(Protocol):
    """An environment that renders its tasks as chat messages (see the module docstring)."""

    chat_template_rev: str

    def chat_messages(self, task: Task) -> list[dict[str, Any]]: ...

    def chat_action(self, name: str, arguments: dict[str, Any]) -> str | None: ...

    def chat_answer(self, text: str) -> str | None: ...


@runtime_checkable
class Stateful(Protocol):
    """An environment whose episodes each start from a recorded state (see the module docstring)."""

    def open(self, episode_id: str, task: Task, replay: Sequence[str] = ()) -> str: ...

    def close(self, episode_id: str) -> None: ...


COMPONENT_TAGS = ("fact", "heuristic")


def tool_schema_version(env: Any) -> str | None:
    """The environment's declared tool-schema version (None when it declares none)."""
    v = getattr(env, "tool_schema_version", None)
    return None if v is None else str(v)


def component_tags(env: Any) -> dict[str, str]:
    """Reward component -> ``fact`` | ``heuristic`` as the environment declares them."""
    tags = dict(getattr(env, "component_tags", None) or {})
    bad = {k: v for k, v in tags.items() if v not in COMPONENT_TAGS}
    if bad:
        raise ConfigError(f"environment {getattr(env, 'name', env)!r}: component_tags {bad} are not fact/heuristic",
                          hint="tag each reward component 'fact' (observed) or 'heuristic' (shaping)")
    return tags


def declared_component_tags() -> list[dict[str, str]]:
    """(env_version, component, tag) of every registered environment (built-ins
    included): the ``component_tags`` view of ``pipeline sql``."""
    rows = []
    for cls in _REGISTRY.values():
        for comp, tag in sorted(component_tags(cls).items()):
            rows.append({"env_version": str(cls.env_version), "component": comp, "tag": tag})
    return sorted(rows, key=lambda r: (r["env_version"], r["component"]))


def component_tags_table():
    """:func:`declared_component_tags` as an Arrow table ``(env_version, component,
    tag)``: the ``component_tags`` view a query gets through ``views=``
    (pipeline/query/duck.py)."""
    import pyarrow as pa

    s = pa.string()
    return pa.Table.from_pylist(declared_component_tags(),
                                schema=pa.schema([("env_version", s), ("component", s), ("tag", s)]))


def split_of(text: str, eval_fraction: int = 10) -> Split:
    """Deterministic train/eval split of a task by its content: 1 in ``eval_fraction``
    tasks is held out for evaluation."""
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")
    return "eval" if h % eval_fraction == 0 else "train"


# name -> class. The built-ins register themselves as their modules load: the package
# (pipeline/rollout/envs/__init__.py) imports each of them, and Python always runs the
# package before any of its modules, so by the time a function below runs they are here.
_REGISTRY: dict[str, type[Environment]] = {}
_E = TypeVar("_E", bound=Environment)


def register_env(cls: type[_E]) -> type[_E]:
    """Class decorator: make ``cls`` available by ``cls.name`` (registering a name twice is an error)."""
    name = getattr(cls, "name", None)
    if not name:
        raise ConfigError(f"{cls.__name__} has no name attribute")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ConfigError(f"environment {name!r} is already registered by {_REGISTRY[name].__name__}")
    _REGISTRY[name] = cls
    return cls


def get_env(name: str, **kwargs: Any) -> Environment:
    """An instance of the environment registered as ``name``; ``module:Class`` also works
    (imports a user's environment without registering it first)."""
    if name not in _REGISTRY and ":" in name:
        import importlib

        mod, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cannot import environment {name!r}: {exc}") from None
        return cls(**kwargs)
    if name not in _REGISTRY:
        raise ConfigError(f"unknown environment {name!r}", hint=f"built-in: {', '.join(sorted(_REGISTRY))}; "
                          "or pass module:Class of your own")
    return _REGISTRY[name](**kwargs)


def list_envs() -> list[str]:
    """The registered environment names (the built-ins and every ``register_env`` so far)."""
    return sorted(_REGISTRY)


def env_class(name: str) -> type[Environment]:
    """The class registered as ``name`` (``ConfigError`` when none is)."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown environment {name!r}", hint=f"built-in: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
