"""``RolloutConfig``: every knob of ``pipeline rollout`` (its section ``rollout``
of an experiment file), and ``check_config``, the checks a run makes before it
starts. The run (pipeline/rollout/run.py), the worker and its helpers read it;
it imports nothing of theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pipeline.errors import ConfigError

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
    max_obs_tokens_per_turn: int = field(default=0, metadata={"ge": 0, "help":
        "observation budget: the most tokens one tool result adds (cut to fit, with a marker the policy sees: "
        "...(truncated N tokens)); with any obs cap set, max_total_tokens counts the policy's tokens only; 0 = off"})
    max_obs_tokens: int = field(default=0, metadata={"ge": 0, "help":
        "observation budget of a whole episode (spent: INFRA_FAILED / obs_budget, never the policy's failure); "
        "0 = off"})
    obs_keep: Literal["head", "tail"] = field(default="head", metadata={"help":
        "which end of an over-long tool output the policy sees"})
    wall_clock_s: float = field(default=120.0, metadata={"gt": 0, "help": "per trajectory (EXPIRED, wall_clock)"})
    tool_timeout_s: float = field(default=0.0, metadata={"ge": 0, "help":
        "deadline per tool call, enforced by the harness (the call runs in a thread; past the deadline the episode "
        "ends INFRA_FAILED / env_timeout and the worker moves on); 0 = the environment's declared tool_timeout_s, "
        "else 30s"})
    tool_concurrency: int = field(default=0, metadata={"ge": 0, "help":
        "tool calls running at once; 0 = sized for I/O: the episodes in flight (groups_per_wave x group_size), at "
        "most 256; an environment's declared max_tool_concurrency bounds it either way"})
    group_redundancy: float = field(default=0.0, metadata={"ge": 0, "help":
        "over-provisioning r: launch ceil(groups x (1 + r)) groups and finish once `groups` of them are complete "
        "(every member ended, none cancelled, one policy version); the stragglers still running are cancelled "
        "(EXPIRED / cancelled, null reward: never a policy failure) or, with straggler_policy=carry, carried into "
        "the next round. 0 = off, the run is exactly as without it"})
    straggler_policy: Literal["cancel", "carry"] = field(default="cancel", metadata={"help":
        "with group_redundancy, the stragglers once a round has its groups: cancel (EXPIRED / cancelled, null "
        "reward, never a policy failure) or carry (continuous mode only: they keep running into the next round "
        "as partial rollouts, a newer policy does not wait for them and samples their later tokens, "
        "token_policy_versions says which version sampled which token, admission judges them by its usual "
        "lag and comparability rules; the last round's stragglers are cancelled). Default cancel: a single "
        "round has no next round, and a trajectory keeps one policy version"})
    retry_group_budget: int = field(default=0, metadata={"ge": 0, "help":
        "resample up to this many INFRA_FAILED / UNKNOWN members per group (new trajectory ids <group>-r<n>, same "
        "group, only while the group's policy version is still the one served); 0 = no retries"})
    retry_run_budget: int = field(default=64, metadata={"ge": 0, "help":
        "retries in the whole run (split across workers); once spent, failed members stay failed"})
    groups_per_wave: int = field(default=32, metadata={"ge": 1, "help":
        "groups in flight at once: with schedule=stream a new group starts as soon as there is room; with "
        "schedule=waves the next wave starts when the last one ended"})
    follow: bool = field(default=False, metadata={"help":
        "continuous mode: after a round of `groups`, keep launching the next round's groups (the next group "
        "indices) with no barrier, so the engine never waits for a round's tail; stops after `rounds` rounds, once "
        "stop_file exists, or on SIGTERM / SIGINT (new groups stop, the episodes in flight finish and ship)"})
    rounds: int = field(default=0, metadata={"ge": 0, "help": "with follow: rounds to run (0 = until stopped)"})
    stop_file: str = field(default="", metadata={"help": "with follow: stop starting new groups once this file exists"})
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
    verifier_concurrency: int = field(default=0, metadata={"ge": 0, "help":
        "verifier calls running at once; 0 = sized like tool_concurrency (max_verifier_concurrency bounds it)"})
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
    ingest_url: str = field(default="", metadata={"help":
        "ship spooled batches to the lake's log at this NATS URL (pipeline serve commits them; "
        "docs/front-door.md); empty: append to the lake directly. The command defaults it to $PIPELINE_INGEST_URL"})
    ingest_stream: str = field(default="lake", metadata={"help": "the lake's stream on that server"})
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
    progress: bool = field(default=False, metadata={"help": "print a progress line to stderr every 5 s (pipeline rollout sets it)"})


def check_config(cfg: RolloutConfig) -> None:
    """Reject a config a run cannot honour, with a reason (``ConfigError``)."""
    if cfg.groups < 1 or cfg.group_size < 1 or cfg.workers < 1:
        raise ConfigError("groups, group_size and workers must be >= 1")
    for name in ("tool_timeout_p", "env_crash_p", "verifier_error_p"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ConfigError(f"{name} must be a probability in [0, 1]")
    if cfg.max_tokens_per_turn < 1 or cfg.max_total_tokens < cfg.max_tokens_per_turn:
        raise ConfigError("need 1 <= max_tokens_per_turn <= max_total_tokens")
    if not cfg.group_redundancy >= 0:
        raise ConfigError(f"group_redundancy must be >= 0 (got {cfg.group_redundancy}): the share of extra groups")
    if cfg.follow and cfg.group_redundancy > 0 and cfg.straggler_policy != "carry":
        raise ConfigError("follow with group_redundancy needs straggler_policy=carry: continuous mode runs the next "
                          "round during a round's tail (cancelling stragglers would cut the next round's episodes)")
    if cfg.straggler_policy == "carry" and not (cfg.follow and cfg.group_redundancy > 0):
        raise ConfigError("straggler_policy=carry needs follow and group_redundancy > 0: stragglers are carried "
                          "into the next round of a continuous run (without them there is none, or no straggler)")
    if cfg.follow and not (cfg.rounds or cfg.stop_file) and cfg.workers > 1:
        raise ConfigError("follow with workers > 1 needs rounds or stop_file (SIGTERM stops a single worker only)")
    if cfg.lease_s <= 0:
        raise ConfigError("lease_s must be > 0")
    if cfg.hold_after_executed and not cfg.hold_file:
        raise ConfigError("hold_after_executed needs hold_file (the readiness marker prefix)")
