"""SimConfig: every knob of the simulated fleet, one frozen dataclass.

YAML files (``pipeline/sim/configs/*.yaml``) name experiments; ``--set k=v``
and ``--sweep k=v1,v2`` override single keys. ``task_mix`` maps a class name to
its parameters; dotted keys (``task_mix.slow.median_s=300``) reach into it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

TASK_CLASS_KEYS = {
    "weight": "share of new groups drawn from this class (normalized over classes)",
    "median_s": "median wall time of one trajectory, seconds (lognormal)",
    "sigma": "lognormal sigma of the duration (0 = every trajectory takes median_s)",
    "pass_rate": "probability that a finished trajectory earns reward 1 (else 0)",
    "n_tasks": "distinct task ids in the class",
}


def _default_mix() -> dict[str, dict[str, Any]]:
    return {
        "fast": {"weight": 0.8, "median_s": 60.0, "sigma": 0.5, "pass_rate": 0.6, "n_tasks": 400},
        "slow": {"weight": 0.2, "median_s": 600.0, "sigma": 0.5, "pass_rate": 0.35, "n_tasks": 100},
    }


@dataclass(frozen=True, kw_only=True)
class TaskClass:
    name: str
    weight: float
    median_s: float
    sigma: float
    pass_rate: float
    n_tasks: int


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    mode: Literal["sync", "async"] = field(default="async", metadata={
        "help": "sync: dispatch one batch with policy v, wait for every group, train, publish v+1, repeat "
                "(workers idle while the trainer runs). async: workers generate continuously, the trainer "
                "trains whenever admission has given it a batch"})
    duration_h: float = field(default=24.0, metadata={"help": "simulated fleet time, hours"})
    workers: int = field(default=256, metadata={"help": "rollout workers (one trajectory at a time each)"})
    group_size: int = field(default=8, metadata={"help": "G: trajectories sampled per group (same task, same prompt)"})
    batch_groups: int = field(default=32, metadata={"help": "groups per trainer step (sync: groups dispatched per step)"})
    trainer_step_s: float = field(default=120.0, metadata={"help": "wall time of one trainer step, seconds"})
    weight_sync_s: float = field(default=15.0, metadata={
        "help": "time from the end of a step until the new version is published to workers and admission; "
                "the trainer is blocked meanwhile"})
    max_policy_lag: int = field(default=1, metadata={
        "help": "admission: members with current_policy_version - policy_version above this are stale_policy"})
    max_queue_wait_ms: int | None = field(default=None, metadata={
        "help": "admission: members that waited longer than this between finishing and the decision are "
                "stale_wait (null: no limit)"})
    min_valid_members: int = field(default=2, metadata={"help": "admission: fewer valid members -> insufficient_valid"})
    min_reward_std: float = field(default=1e-6, metadata={"help": "admission: population reward std below this -> zero_variance"})
    admission_interval_s: float = field(default=30.0, metadata={
        "help": "async: admission runs when the trainer needs data, at most once per this many seconds "
                "(the scheduled admission job); 0 = after every completed group"})
    max_outstanding_groups: int = field(default=96, metadata={
        "help": "async back-pressure: workers start no new group while this many groups are generating, "
                "waiting for admission or admitted but not yet trained"})
    infra_failure_rate: float = field(default=0.01, metadata={
        "help": "probability that a trajectory dies of an infrastructure fault part-way (INFRA_FAILED)"})
    worker_crash_per_h: float = field(default=0.0, metadata={
        "help": "crashes per worker per hour (Poisson); the in-flight trajectory becomes INFRA_FAILED"})
    worker_restart_s: float = field(default=120.0, metadata={"help": "downtime of a crashed worker, seconds"})
    max_trajectory_s: float | None = field(default=None, metadata={
        "help": "wall-clock limit of one trajectory; longer ones stop there as EXPIRED (null: none)"})
    task_mix: dict[str, dict[str, Any]] = field(default_factory=_default_mix, metadata={
        "help": "class name -> {weight, median_s, sigma, pass_rate, n_tasks}; the class with the largest "
                "median_s is reported as 'slow'"})
    seed: int = field(default=0, metadata={"help": "random seed (same seed + config = same run)"})
    run_id: str = field(default="sim", metadata={"help": "run_id stamped on landed trajectories (--land)"})
    start_time: str = field(default="2026-11-01T00:00:00+00:00", metadata={
        "help": "UTC wall-clock time of simulated second 0 (timestamps of landed rows)"})

    def __post_init__(self) -> None:
        problems = []
        for name in ("workers", "group_size", "batch_groups", "max_outstanding_groups"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        for name in ("duration_h", "trainer_step_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        for name in ("weight_sync_s", "admission_interval_s", "worker_crash_per_h", "worker_restart_s"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0")
        if self.max_policy_lag < 0:
            problems.append("max_policy_lag must be >= 0")
        if not 0 <= self.infra_failure_rate < 1:
            problems.append("infra_failure_rate must be in [0, 1)")
        if self.min_valid_members > self.group_size:
            problems.append(f"min_valid_members ({self.min_valid_members}) > group_size ({self.group_size}): "
                            f"no group could ever be admitted")
        if self.max_outstanding_groups < self.batch_groups and self.mode == "async":
            problems.append(f"max_outstanding_groups ({self.max_outstanding_groups}) < batch_groups "
                            f"({self.batch_groups}): the trainer could never fill a batch")
        if not self.task_mix:
            problems.append("task_mix is empty")
        for name, params in self.task_mix.items():
            unknown = sorted(set(params) - set(TASK_CLASS_KEYS))
            if unknown:
                problems.append(f"task_mix.{name}: unknown key(s) {unknown} (known: {sorted(TASK_CLASS_KEYS)})")
            missing = sorted({"weight", "median_s"} - set(params))
            if missing:
                problems.append(f"task_mix.{name}: missing {missing}")
        if problems:
            raise ConfigError("invalid simulator config: " + "; ".join(problems),
                              hint="fix the YAML file or the --set/--sweep value")
        classes = self.classes()  # validates the numbers
        if sum(c.weight for c in classes) <= 0:
            raise ConfigError("task_mix weights sum to 0", hint="give at least one class a positive weight")

    def classes(self) -> list[TaskClass]:
        out = []
        for name, p in self.task_mix.items():
            tc = TaskClass(name=name, weight=float(p["weight"]), median_s=float(p["median_s"]),
                           sigma=float(p.get("sigma", 0.5)), pass_rate=float(p.get("pass_rate", 0.5)),
                           n_tasks=int(p.get("n_tasks", 100)))
            if tc.weight < 0 or not tc.median_s > 0 or tc.sigma < 0 or not 0 <= tc.pass_rate <= 1 or tc.n_tasks < 1:
                raise ConfigError(f"task_mix.{name}: need weight >= 0, median_s > 0, sigma >= 0, "
                                  f"0 <= pass_rate <= 1, n_tasks >= 1 (got {p})")
            if not all(math.isfinite(v) for v in (tc.weight, tc.median_s, tc.sigma, tc.pass_rate)):
                raise ConfigError(f"task_mix.{name}: values must be finite (got {p})")
            out.append(tc)
        return out

    @property
    def slow_class(self) -> str:
        """The class reported as 'slow': the largest median duration."""
        return max(self.classes(), key=lambda c: c.median_s).name

    @property
    def duration_s(self) -> float:
        return self.duration_h * 3600.0


def resolve_config_path(name: str | Path) -> Path:
    """A path, or the name of a packaged config (``slow_tasks`` -> configs/slow_tasks.yaml)."""
    p = Path(name)
    if p.is_file():
        return p
    packaged = CONFIG_DIR / (p.name if p.suffix else f"{p.name}.yaml")
    if packaged.is_file():
        return packaged
    known = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config {name} not found", hint=f"give a YAML path or a packaged config: {', '.join(known)}")


def apply_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Apply ``key=value`` overrides to a config mapping; dotted keys reach into
    mappings (``task_mix.slow.median_s``)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"override {key}: {part!r} is not a mapping in the config")
            node = node[part]
        node[parts[-1]] = value
    return out


def load_sim_config(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> SimConfig:
    """Defaults <- YAML file <- overrides (dotted keys allowed)."""
    from pipeline.config import config_dict, load_config, yaml_load

    values: dict[str, Any] = config_dict(SimConfig())
    if file is not None:
        path = resolve_config_path(file)
        loaded = yaml_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of key: value")
        if "task_mix" in loaded:  # a file's task_mix replaces the default mix, it does not merge into it
            values["task_mix"] = {}
        values = apply_overrides(values, {k: v for k, v in loaded.items() if k != "task_mix"})
        values["task_mix"] = loaded.get("task_mix", values["task_mix"])
    values = apply_overrides(values, overrides or {})
    return load_config(SimConfig, None, values)
