"""``pipeline rollout``: sample N groups of G trajectories and land them.

    pipeline rollout --env arithmetic-tool --engine hf --groups 32 --group-size 8 --seed 0
    pipeline rollout --env reverse-digits --engine vllm --policy 0 --groups 8 --workers 2

Each worker (a process when ``workers > 1``) owns the groups ``k`` with
``k % workers == w``, runs them in waves of ``groups_per_wave`` through the
harness, and ships its spool to Delta in batches (app id = worker id,
transaction version = batch sequence). Task seeds, episode ids and sampling
seeds are functions of ``(run_id, seed, group, member)``, so a restarted
run knows exactly which episodes it owes.

One owner per run. ``run_rollout`` holds a lease in the lake
(``rollout-<run_id>`` in pipeline/lake/lease.py, the jobs' lease: put-if-absent
generations, renewed in the background); a second invocation with the same ``run_id`` refuses while
it is fresh and naming its owner, and takes the run over once it expired (at
once when the owner provably died on this host). Workers die with the owner:
a parent-death signal (``prctl(PR_SET_PDEATHSIG)`` on Linux) plus a watchdog
thread that polls the parent pid (for kernels or sandboxes without it), so no
worker of a dead owner works beside the next one.

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

import dataclasses
import os
import socket
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pipeline.config import config_dict
from pipeline.lake.ref import as_lake
from pipeline.rollout.engine import Sampling, derive_seed

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake
    from pipeline.lake.lease import Lease
    from pipeline.rollout.engine import Engine


@dataclass(frozen=True)
class RolloutConfig:
    config_section: ClassVar[str] = "rollout"   # its section in an experiment file (pipeline.config.SECTIONS)

    env: str = field(default="arithmetic-tool", metadata={"help": "environment name (or module:Class)"})
    engine: Literal["hf", "vllm"] = field(default="hf", metadata={"help": "generation engine"})
    policy: str = field(default="latest", metadata={
        "help": "policy version number, checkpoint id, 'latest', or a local HF directory"})
    groups: int = field(default=8, metadata={"ge": 1, "help": "groups to sample (N)"})
    group_size: int = field(default=8, metadata={"ge": 1, "help": "samples per group (G)"})
    seed: int = field(default=0, metadata={"ge": 0, "help": "task and sampling seed"})
    workers: int = field(default=1, metadata={"ge": 1, "help": "worker processes"})
    run_id: str = field(default="", metadata={"help": "experiment id (default: rollout-<seed>-<utc time>); "
                                                     "rerun with the same id to resume a crashed run"})
    group_offset: int = field(default=0, metadata={"ge": 0, "help": "first group index (iterations of a loop use new groups)"})
    follow_latest: bool = field(default=False, metadata={
        "help": "re-resolve the newest published policy between waves (and turns, see follow_every_turn)"})
    follow_every_turn: bool = field(default=False, metadata={
        "help": "with follow_latest: also between turns (trajectories may then span policy versions)"})
    temperature: float = field(default=1.0, metadata={"ge": 0, "help": "sampling temperature (0 = greedy)"})
    top_p: float = field(default=1.0, metadata={"gt": 0, "le": 1, "help": "nucleus sampling p"})
    max_turns: int = field(default=4, metadata={"ge": 1, "help": "model turns per trajectory (stop_reason max_steps)"})
    max_tokens_per_turn: int = field(default=16, metadata={"ge": 1, "help": "tokens per model turn (max_length)"})
    max_total_tokens: int = field(default=64, metadata={"ge": 1, "help": "response tokens in total (max_length)"})
    wall_clock_s: float = field(default=120.0, metadata={"gt": 0, "help": "per trajectory (EXPIRED, wall_clock)"})
    tool_timeout_s: float = field(default=0.0, metadata={"ge": 0, "help":
        "deadline per tool call, enforced by the harness (the call runs in a thread; past the deadline the episode "
        "ends INFRA_FAILED / env_timeout and the worker moves on); 0 = the environment's declared tool_timeout_s, "
        "else 30s"})
    tool_concurrency: int = field(default=8, metadata={"ge": 1, "help": "tool calls of a wave running at once"})
    retry_group_budget: int = field(default=0, metadata={"ge": 0, "help":
        "resample up to this many INFRA_FAILED / UNKNOWN members per group (new trajectory ids <group>-r<n>, same "
        "group, only while the group's policy version is still the one served); 0 = no retries"})
    retry_run_budget: int = field(default=64, metadata={"ge": 0, "help":
        "retries in the whole run (split across workers); once spent, failed members stay failed"})
    groups_per_wave: int = field(default=32, metadata={"ge": 1, "help":
        "groups in flight at once: with schedule=stream a new group starts as soon as there is room; with "
        "schedule=waves the next wave starts when the last one ended"})
    flush_rows: int = field(default=256, metadata={"ge": 1, "help": "ship the spool after this many finished trajectories"})
    flush_seconds: float = field(default=10.0, metadata={"ge": 0, "help":
        "... or once the oldest unshipped finished trajectory is this many seconds old (shipped while other "
        "episodes still run)"})
    schedule: Literal["stream", "waves"] = field(default="stream", metadata={"help":
        "stream: every episode advances on its own and the engine serves whatever is ready; waves: the lockstep "
        "baseline (a turn for every episode, then every tool, then the next turn)"})
    max_batch: int = field(default=256, metadata={"ge": 1, "help":
        "rows of one engine call (transformers micro-batch; vLLM batches continuously)"})
    max_wait_ms: float = field(default=20.0, metadata={"ge": 0, "help":
        "a partial micro-batch waits this long for more ready episodes (transformers)"})
    verify_timeout_s: float = field(default=30.0, metadata={"gt": 0, "help":
        "deadline per verifier call (INFRA_FAILED / verifier_timeout, null reward, past it)"})
    verifier_concurrency: int = field(default=8, metadata={"ge": 1, "help": "verifier calls running at once"})
    tool_latency_ms: float = field(default=0.0, metadata={"ge": 0, "help":
        "injected tool latency: mean of a lognormal, ms (0 = none); seeded by `seed`, recorded in the events"})
    tool_latency_sigma: float = field(default=0.0, metadata={"ge": 0, "help": "log-sd of the tool latency lognormal"})
    slow_tool_p: float = field(default=0.0, metadata={"ge": 0, "le": 1, "help": "share of tool calls that take 10x"})
    verifier_latency_ms: float = field(default=0.0, metadata={"ge": 0, "help":
        "injected verifier latency: mean of a lognormal, ms (0 = none)"})
    verifier_latency_sigma: float = field(default=0.0, metadata={"ge": 0, "help": "log-sd of the verifier latency"})
    slow_verifier_p: float = field(default=0.0, metadata={"ge": 0, "le": 1, "help": "share of verifier calls that take 10x"})
    weight_switch: Literal["in_place", "rebuild"] = field(default="in_place", metadata={"help":
        "following a newer policy: load its weights into the running engine (in_place) or build a new engine"})
    spool_dir: str = field(default="", metadata={"help": "worker spools (default: <lake>/_spool/<run_id>)"})
    spool_fsync: bool = field(default=True, metadata={"help": "fsync the spool at every commit point"})
    tool_timeout_p: float = field(default=0.0, metadata={"ge": 0, "le": 1, "help": "fault injection: tool timeout probability"})
    env_crash_p: float = field(default=0.0, metadata={"ge": 0, "le": 1, "help": "fault injection: environment crash probability"})
    verifier_error_p: float = field(default=0.0, metadata={"ge": 0, "le": 1, "help": "fault injection: verifier error probability"})
    kill_after_executed: int = field(default=0, metadata={"ge": 0,
        "help": "fault injection: SIGKILL the worker after its Nth tool execution is recorded (crash tests)"})
    hold_after_executed: int = field(default=0, metadata={
        "help": "fault injection: after the Nth recorded tool execution write <hold_file>.<pid> and wait to be "
                "killed (crash tests)"})
    hold_file: str = field(default="", metadata={"help": "readiness marker prefix for hold_after_executed"})
    lease_s: float = field(default=60.0, metadata={
        "help": "run lease: renewed every lease_s/4 while the run is owned; another invocation may take the run "
                "over once the owner has not renewed it for this long"})
    ship_before_tools: Literal["auto", "always", "never"] = field(default="auto", metadata={
        "help": "ship committed actions to the lake before tools run (auto: when the environment is not "
                "idempotent, so a lost spool never hides an execution)"})
    tool_log: str = field(default="", metadata={"help": "append one line per real tool execution to this file"})
    threads: int = field(default=1, metadata={"ge": 1, "help": "torch threads per worker"})
    render: Literal["auto", "text", "chat"] = field(default="auto", metadata={
        "help": "how tasks become tokens: chat (the environment's chat messages through the policy's chat "
                "template), text (the <call>/<ans> protocol), auto (chat when the policy's tokenizer has a chat "
                "template and the environment a chat rendering)"})
    progress: bool = field(default=False, metadata={"help": "print one line per wave to stderr"})


@dataclass
class RolloutSummary:
    run_id: str
    env: str
    engine: str
    trajectories: int = 0                       # finished by this invocation
    landed: int = 0                             # rows landed in the trajectories table
    events: int = 0
    quarantined: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)
    reward_mean: float | None = None
    success_rate: float | None = None           # PASS / trajectories with a verdict PASS or FAIL
    policy_versions: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    seconds: float = 0.0                        # wall time, engine start included
    rollout_seconds: float = 0.0                # time in the harness (generation, tools, verification, spool)
    tokens_per_s: float = 0.0                   # generated (policy) tokens / rollout_seconds
    tool_executions: int = 0
    tools_abandoned: int = 0                    # tool calls past their deadline (threads left behind)
    retries: int = 0                            # retry episodes started by this invocation
    retries_denied: int = 0                     # failed members not retried: a budget was spent or the policy moved on
    resumed: int = 0
    workers: int = 1
    schedule: str = "stream"
    engine_busy_s: float = 0.0                  # time the engine was generating (all workers)
    engine_busy_share: float = 0.0              # engine_busy_s / (rollout_seconds of the engines)
    engine_steps: int = 0
    verifiers_abandoned: int = 0                # verifier calls past their deadline
    waits_ms: dict[str, dict[str, float]] = field(default_factory=dict)   # stage -> {p50, p95, n}
    weight_switches: list[dict[str, Any]] = field(default_factory=list)   # {version, mode, seconds}
    samples: dict[str, list[float]] = field(default_factory=dict, repr=False)   # raw waits, merged across workers

    def as_dict(self, samples: bool = False) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not samples:
            d.pop("samples")
        return d


def _percentiles(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """stage -> {p50, p95, n} (nearest-rank) of the wait samples."""
    out = {}
    for stage, xs in samples.items():
        if not xs:
            continue
        ys = sorted(xs)

        def rank(q: float, ys=ys) -> float:
            return round(ys[min(len(ys) - 1, max(0, int(q * len(ys) + 0.999999) - 1))], 3)

        out[stage] = {"p50": rank(0.5), "p95": rank(0.95), "n": len(ys)}
    return out


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
                    self.engine, rec = switch_weights(self.engine, hf_dir, mode=self.cfg.weight_switch,
                                                      threads=self.cfg.threads)
                    self.switches.append(rec | {"version": version})
                self.codec = codec.load(hf_dir, env=self.env, render=self.cfg.render)
                self.checkpoint_id = ckpt
                self.version = version
        self.versions.add(self.version)
        return self.engine, self.version

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def plan(cfg: RolloutConfig, env, worker: int) -> list[tuple[int, str, Any, list[tuple[str, int]]]]:
    """This worker's groups: (group index, group_id, task, [(episode_id, sampling seed)])."""
    out = []
    for k in range(cfg.group_offset, cfg.group_offset + cfg.groups):
        if k % cfg.workers != worker:
            continue
        task = env.reset(derive_seed(cfg.seed, "task", k), "train")
        gid = f"{cfg.run_id}-g{k}"
        out.append((k, gid, task, [(f"{gid}-{j}", derive_seed(cfg.seed, "sample", k, j))
                                   for j in range(cfg.group_size)]))
    return out


def reconcile(lake: Lake, cfg: RolloutConfig, tasks: dict[str, Any], spool_records: list[dict[str, Any]]) -> dict:
    """The state of this worker's planned episodes (``tasks``) from everything on
    record for the run: its spool, the run's events in the lake (whichever worker
    shipped them) and the trajectory ids already landed (an episode whose row
    landed is finished even when its last events were lost with a spool)."""
    import pyarrow.dataset as ds

    from pipeline.rollout.harness import rebuild

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
    from pipeline.rollout.harness import Faults, Harness, Latency, Limits, Schedule
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

    def _ship() -> None:
        guard()
        _add_ship(summary, ship(lake, spool))
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
                                    verifier_concurrency=cfg.verifier_concurrency),
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
    tasks = {eid: (task, gid, cfg.group_size) for _, gid, task, members in groups for eid, _ in members}
    for _, gid, task, _ in groups:         # possible retries: known ids, so a restart resumes them too
        tasks.update({retry_id(gid, n): (task, gid, cfg.group_size) for n in range(cfg.retry_group_budget)})
    state = reconcile(lake, cfg, tasks, spool.records())
    budget = [_worker_share(cfg.retry_run_budget, cfg.workers, worker)
              - sum(1 for _, gid, _, _ in groups for n in range(cfg.retry_group_budget) if retry_id(gid, n) in state)]
    index = {gid: (k, task) for k, gid, task, _ in groups}
    todo = deque(groups)
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

    def feed(free: int, active: int) -> list | None:
        out: list = []
        while todo:
            items = group_items(todo[0])
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
            free -= len(items)
        started.extend(out)
        return out if out or todo else None

    def on_finish(ep) -> list:
        unshipped.append(ep)
        extra, budget[0] = _retries(cfg, harness, lambda: (None, holder.version), {ep.group_id: index[ep.group_id]},
                                    state, [ep], started, budget[0], summary)
        started.extend(extra)
        return extra

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
    t_run = time.perf_counter()
    harness.run([], feed=feed, on_finish=on_finish, tick=tick)
    summary.rollout_seconds = time.perf_counter() - t_run
    _ship()
    spool.close()
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


def retry_id(group_id: str, n: int) -> str:
    """The trajectory id of a group's ``n``-th retry (deterministic: a restart finds it)."""
    return f"{group_id}-r{n}"


def _worker_share(total: int, workers: int, worker: int) -> int:
    return total // workers + (1 if worker < total % workers else 0)


def needs_retry(ep) -> bool:
    """A member without a valid evaluation for infrastructure reasons (INFRA_FAILED, or verdict UNKNOWN)."""
    return ep.status == "INFRA_FAILED" or ep.verdict == "UNKNOWN"


def _retries(cfg: RolloutConfig, harness, holder, index, state, last, wave, budget: int, summary):
    """New episodes for the failed members of ``last`` (this wave's previous round):
    one per failed member while its group has retries left (``retry_group_budget``,
    counting those already on record) and the worker's share of ``retry_run_budget``
    lasts, and only while the served policy is still the group's version (a retry
    from a newer policy would not be comparable with its group). Their CREATED
    event says ``retry_of`` (the failed trajectory) and ``retry`` (n)."""
    if cfg.retry_group_budget <= 0:     # retries off
        return [], budget
    ids = {e.episode_id for e in wave}
    used = {gid: sum(1 for n in range(cfg.retry_group_budget)      # every retry id on record or run counts
                     if retry_id(gid, n) in state or retry_id(gid, n) in ids) for gid in index}
    _, version = holder()
    out = []
    for e in last:
        if not needs_retry(e):
            continue
        gid = e.group_id
        group_version = min((m.policy_version for m in wave if m.group_id == gid), default=version)
        if used.get(gid, 0) >= cfg.retry_group_budget or budget <= 0 or version != group_version:
            summary.retries_denied += 1
            continue
        n = used[gid]
        used[gid] = n + 1
        budget -= 1
        k, task = index[gid]
        ep = harness.new_episode(episode_id=retry_id(gid, n), group_id=gid, group_size=cfg.group_size, task=task,
                                 seed=derive_seed(cfg.seed, "retry", k, n), policy_version=version,
                                 extra={"retry_of": e.episode_id, "retry": n})
        out.append(ep)
        summary.retries += 1
    return out, budget


def _add_ship(summary: RolloutSummary, rep) -> None:
    summary.landed += rep.trajectories
    summary.events += rep.events
    summary.quarantined += rep.quarantined


# -- one owner per run -------------------------------------------------------------------------
WATCHDOG_S = 0.5
_PARENT: int | None = None
_LEASE: tuple[Any, float] | None = None     # (the owner's shared "lease valid until", lease_s)


def _die_with_parent(parent_pid: int, pdeathsig: bool = True, valid_until=None, lease_s: float = 0.0) -> None:
    """Worker-process initializer: never outlive the run's owner. The kernel sends
    SIGKILL when the parent dies (PR_SET_PDEATHSIG, Linux); a watchdog thread
    polling the parent pid covers kernels and sandboxes without it and the window
    before the prctl (a parent that died first leaves us reparented).
    ``valid_until``: the owner's lease expiry in shared memory, moved on by each
    renewal; the worker stops writing when it runs low (an owner that is alive
    but stalled, e.g. SIGSTOPped, whose lease another invocation may take)."""
    import signal
    import threading

    global _PARENT, _LEASE
    _PARENT = parent_pid
    _LEASE = (valid_until, lease_s) if valid_until is not None else None
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(WATCHDOG_S)

    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="owner-watchdog", daemon=True).start()


def _parent_alive() -> None:
    from pipeline.errors import ConflictError

    if _PARENT is not None and os.getppid() != _PARENT:
        raise ConflictError("the run's owner is gone; this worker stops writing")
    if _LEASE is not None and not _lease_fresh(_LEASE[0].value, _LEASE[1]):
        raise ConflictError("the run's owner has not renewed its lease in time; this worker stops writing")


def _lease_fresh(valid_until: float, lease_s: float) -> bool:
    """Fresh while at least a quarter of the lease is left (renewals come every
    quarter, so one missed renewal is tolerated, two are not)."""
    return time.time() < valid_until - lease_s / 4


def _worker_main(lake_uri: str, cfg_dict: dict[str, Any], worker: int) -> dict[str, Any]:
    from pipeline.lake.delta import Lake

    cfg = RolloutConfig(**cfg_dict)
    return run_worker(Lake(lake_uri), cfg, worker, guard=_parent_alive).as_dict(samples=True)


def _lock_name(run_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)


class RunOwner:
    """The run lease (``rollout-<run_id>``, pipeline/lake/lease.py): taken before anything is
    written, renewed by a background thread every ``lease_s / 4``, released at
    the end. Losing it (the owner stalled past its lease and another invocation
    took the run over) calls ``on_lost`` and makes ``check`` raise."""

    def __init__(self, lake: Lake, cfg: RolloutConfig, on_lost=None) -> None:
        import multiprocessing as mp
        import threading

        self.lake, self.cfg = lake, cfg
        self.name = f"rollout-{_lock_name(cfg.run_id)}"[:200]
        self.lease: Lease | None = None
        self.on_lost = on_lost
        self.lost = False
        # the lease's expiry as last written, shared with the worker processes (guard)
        self.valid_until = mp.get_context("spawn").RawValue("d", 0.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        import threading

        from pipeline.errors import ConflictError
        from pipeline.lake.lease import try_acquire

        self.lease, held = try_acquire(
            self.lake, self.name, ttl=self.cfg.lease_s,
            owner=f"pipeline rollout pid {os.getpid()} on {socket.gethostname()} ({self.cfg.workers} workers)",
            info={"run_id": self.cfg.run_id, "workers": self.cfg.workers, "pid_bound": True})
        if self.lease is None:
            held = held or {}
            left = float(held.get("expires", time.time())) - time.time()
            raise ConflictError(
                f"run {self.cfg.run_id} is owned by a live `pipeline rollout`: pid {held.get('pid', '?')} on host "
                f"{held.get('host', '?')} ({held.get('workers', '?')} workers); its lease runs {max(0, left):.0f}s "
                "more and is renewed while it runs",
                hint="two owners would run the same actions twice: wait for it to finish, or stop that process "
                     f"(its workers stop with it) and rerun; a dead owner's lease is taken over once it expires "
                     f"(lease_s={self.cfg.lease_s:g}), at once when it ran on this host")
        self.valid_until.value = self.lease.expires
        self._thread = threading.Thread(target=self._beat, args=(self.lease,), name="run-lease", daemon=True)
        self._thread.start()

    def _beat(self, lease: Lease) -> None:
        from pipeline.lake.lease import LeaseLostError

        renewed = time.monotonic()
        while not self._stop.wait(self.cfg.lease_s / 4):
            try:
                lease.renew()
                ok = True
            except LeaseLostError:
                ok = False
            except Exception:  # noqa: BLE001 - a flaky store: try again at the next beat, while the lease lasts
                ok = time.monotonic() - renewed < self.cfg.lease_s * 0.75
            else:
                renewed = time.monotonic()
                self.valid_until.value = lease.expires
            if not ok:
                self.lost = True
                if self.on_lost is not None:
                    self.on_lost()
                return

    def check(self) -> None:
        from pipeline.errors import ConflictError

        if self.lost or not _lease_fresh(self.valid_until.value, self.cfg.lease_s):
            raise ConflictError(f"run {self.cfg.run_id}: this process lost its lease or could not renew it in time "
                                f"(stalled for about lease_s={self.cfg.lease_s:g}s); another owner may take the run "
                                "over, so it stops", hint="raise lease_s if the machine or the store stalls that long")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lease is not None and not self.lost:
            self.lease.release()        # a no-op when it is no longer ours


def _merge(cfg: RolloutConfig, parts: list[dict[str, Any]], seconds: float) -> RolloutSummary:
    s = RolloutSummary(cfg.run_id, cfg.env, cfg.engine, workers=cfg.workers, schedule=cfg.schedule)
    n_reward = 0
    reward_sum = 0.0
    pass_n = judged = 0
    for p in parts:
        for k in ("trajectories", "landed", "events", "quarantined", "generated_tokens", "tool_executions", "resumed",
                  "rollout_seconds", "tools_abandoned", "retries", "retries_denied", "engine_busy_s", "engine_steps",
                  "verifiers_abandoned", "weight_switches"):
            setattr(s, k, getattr(s, k) + p[k])
        for stage, xs in p.get("samples", {}).items():
            s.samples.setdefault(stage, []).extend(xs)
        for k in ("statuses", "verdicts"):
            for name, v in p[k].items():
                getattr(s, k)[name] = getattr(s, k).get(name, 0) + v
        if p["reward_mean"] is not None:
            n = sum(v for st, v in p["statuses"].items() if st in ("ACCEPTED", "REJECTED"))
            reward_sum += p["reward_mean"] * n
            n_reward += n
        pass_n += p["verdicts"].get("PASS", 0)
        judged += p["verdicts"].get("PASS", 0) + p["verdicts"].get("FAIL", 0)
        s.policy_versions = sorted(set(s.policy_versions) | set(p["policy_versions"]))
    s.reward_mean = reward_sum / n_reward if n_reward else None
    s.success_rate = pass_n / judged if judged else None
    s.seconds = seconds
    # workers run in parallel: aggregate throughput = tokens / the slowest worker's harness time
    slowest = max((p["rollout_seconds"] for p in parts), default=0.0)
    s.tokens_per_s = s.generated_tokens / slowest if slowest else 0.0
    s.engine_busy_share = s.engine_busy_s / s.rollout_seconds if s.rollout_seconds else 0.0   # per engine
    s.waits_ms = _percentiles(s.samples)
    return s


def run_rollout(lake: Lake | str | os.PathLike[str], cfg: RolloutConfig | None = None, **overrides: Any) -> RolloutSummary:
    """Sample ``cfg.groups`` groups of ``cfg.group_size`` and land them (see module doc)."""
    lake = as_lake(lake)
    if cfg is None:
        from pipeline.config import load_config

        cfg = load_config(RolloutConfig, None, overrides)
    elif overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    _check(cfg)
    if not cfg.run_id:
        cfg = dataclasses.replace(cfg, run_id=f"rollout-{cfg.seed}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}")
    from pipeline import lineage

    with lineage.rollout_run(lake, cfg) as run:
        summary = _run_rollout(lake, cfg)
        lineage.rollout_done(run, lake, summary)
    return summary


def _run_rollout(lake: Lake, cfg: RolloutConfig) -> RolloutSummary:
    import multiprocessing as mp

    def kill_workers() -> None:
        for p in mp.active_children():
            p.kill()

    owner = RunOwner(lake, cfg, on_lost=kill_workers)
    owner.acquire()
    try:
        from pipeline.rollout.spool import ship_all

        # recovery per run: whatever any former worker spooled is in the lake before anyone reads it
        ship_all(lake, _spool_dir(lake, cfg), fsync=cfg.spool_fsync)
        owner.check()
        if cfg.workers == 1:
            return run_worker(lake, cfg, 0, guard=owner.check)
        return _run_pool(lake, cfg, owner)
    finally:
        owner.release()


def _run_pool(lake: Lake, cfg: RolloutConfig, owner: RunOwner) -> RolloutSummary:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from pipeline.errors import PipelineError

    t0 = time.perf_counter()
    # spawn: no forked torch/OpenMP state; a killed worker raises instead of hanging the pool
    with ProcessPoolExecutor(cfg.workers, mp_context=mp.get_context("spawn"), initializer=_die_with_parent,
                             initargs=(os.getpid(), True, owner.valid_until, cfg.lease_s)) as pool:
        futures = [pool.submit(_worker_main, lake.uri, config_dict(cfg), w) for w in range(cfg.workers)]
        try:
            parts = [f.result() for f in futures]
        except BrokenProcessPool:
            owner.check()
            raise PipelineError(f"a rollout worker of run {cfg.run_id} died",
                                hint=f"rerun with --run-id {cfg.run_id} (any --workers) to resume: finished "
                                     "trajectories are kept, interrupted ones are completed from the spools "
                                     "and the lake") from None
    return _merge(cfg, parts, time.perf_counter() - t0)


def _check(cfg: RolloutConfig) -> None:
    from pipeline.errors import ConfigError

    if cfg.groups < 1 or cfg.group_size < 1 or cfg.workers < 1:
        raise ConfigError("groups, group_size and workers must be >= 1")
    for name in ("tool_timeout_p", "env_crash_p", "verifier_error_p"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ConfigError(f"{name} must be a probability in [0, 1]")
    if cfg.max_tokens_per_turn < 1 or cfg.max_total_tokens < cfg.max_tokens_per_turn:
        raise ConfigError("need 1 <= max_tokens_per_turn <= max_total_tokens")
    if cfg.lease_s <= 0:
        raise ConfigError("lease_s must be > 0")
    if cfg.hold_after_executed and not cfg.hold_file:
        raise ConfigError("hold_after_executed needs hold_file (the readiness marker prefix)")
