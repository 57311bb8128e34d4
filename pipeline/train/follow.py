"""``follow``: the resident trainer (``pipeline train --follow``).

    pipeline train --follow                              # one process; runs until SIGTERM
    pipeline train --follow --stop-after 4               # ... or until it published 4 versions
    pipeline train --follow --nproc 2                    # torchrun, gloo on CPU / nccl on GPUs

One long-lived process (or N under torchrun) keeps the model, the DeepSpeed
engine and the optimizer in memory and consumes, in admission order, every
snapshot that no published version has consumed, training each exactly as
``pipeline train --batch-snapshot`` would from the version before it: the same
named steps (pipeline.train.steps), the same seed at the start of every
version, the same LR schedule restarted per version, the optimizer moments
carried (in memory instead of through the parent's files). So ``--follow``
over S1..Sk and the chain ``--batch-snapshot S1`` ... ``--batch-snapshot Sk``
publish byte-identical weights under the same checkpoint ids.

Publishing is cheap: each version writes its weights (``hf/`` at an anchor, else
its sparse delta) and publishes its checkpoints row; the full DeepSpeed state goes with every
``full_checkpoint_every``-th version and with the last one at shutdown.

Recovery is replay (``recovery_plan``): a restarted trainer walks its line back
from the newest version to the last one with a full state (or to a version
whose optimizer started fresh), loads it, re-trains the snapshots consumed
since in lineage order, and checks that every replayed version's weight files
(or, for a delta-only version, its weights' digest) hash to what is published
before it trains anything new. The rules (order,
staleness, what makes replay bitwise) are in docs/resident-trainer.md.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline.errors import (ConfigError, ForeignSnapshotError, IntegrityError, OffPolicySnapshotError, PipelineError,
                             StaleSnapshotError)
from pipeline.train.config import TrainConfig
from pipeline.train.line import Recovery, pending_snapshots, recorded_skips, recovery_plan, superseded

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.policy_store import PolicyRef
    from pipeline.train.records import Run

__all__ = ["FollowResult", "Recovery", "follow", "pending_snapshots", "recovery_plan", "superseded"]


@dataclass(kw_only=True)
class FollowResult:
    versions: list[dict[str, Any]] = field(default_factory=list)   # TrainResult.to_dict() per published version
    replayed: list[str] = field(default_factory=list)              # checkpoint ids re-trained and verified
    skipped: list[dict[str, Any]] = field(default_factory=list)    # {snapshot_id, reason, message}
    full_state: list[str] = field(default_factory=list)            # checkpoint ids given their full state here
    stopped_by: str = ""                                           # stop_after | signal | stop_file | idle_timeout
    head_checkpoint_id: str = ""
    head_policy_version: int = -1
    world_size: int = 1
    startup_seconds: float = 0.0                                   # model load + engine build + replay
    seconds: float = 0.0
    worker_exit_codes: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- the loop ---------------------------------------------------------------------------


def follow(lake: Lake, cfg: TrainConfig | None = None, *, from_checkpoint: str | int | None = None, nproc: int = 1,
           stop_after: int | None = None, idle_timeout_s: float | None = None, stop_file: str | None = None,
           progress: bool | None = None, on_version: Callable[[dict[str, Any]], None] | None = None) -> FollowResult:
    """Run the resident trainer until ``stop_after`` versions are published, SIGTERM,
    ``stop_file`` appears, or (``idle_timeout_s``) no snapshot arrived for that long.

    ``from_checkpoint`` names the line's head (default: the newest published
    version). ``on_version`` is called on rank 0 with each published version's
    TrainResult dict (the demo prints and evaluates there)."""
    cfg = cfg or TrainConfig()
    if not cfg.carry_optimizer:
        raise ConfigError("--follow keeps the optimizer in memory; carry_optimizer=false asks for a fresh optimizer "
                          "per version", hint="train each snapshot with pipeline train --batch-snapshot instead")
    if stop_after is not None and stop_after < 1:
        raise ConfigError(f"--stop-after {stop_after}: must be >= 1")
    if nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        from pipeline.train.hold import hold_line

        with hold_line(lake, "follow", ""):
            return _launch(lake, cfg, from_checkpoint=from_checkpoint, nproc=nproc, stop_after=stop_after,
                           idle_timeout_s=idle_timeout_s, stop_file=stop_file, progress=progress)
    from pipeline.train.ds_adapter import single_process_scope
    from pipeline.train.hold import hold_line

    with hold_line(lake, "follow", ""), single_process_scope():   # one trainer on the line at a time
        return _Follower(lake, cfg, from_checkpoint, stop_after, idle_timeout_s, stop_file, progress,
                         on_version).run()


WAIT_NOTE_EVERY_S = 60.0   # a waiting resident trainer says so this often


class _Follower:
    """The state kept between versions: engine, model, head, counters."""

    def __init__(self, lake: Lake, cfg: TrainConfig, from_checkpoint: str | int | None, stop_after: int | None,
                 idle_timeout_s: float | None, stop_file: str | None, progress: bool | None,
                 on_version: Callable[[dict[str, Any]], None] | None) -> None:
        self.lake, self.cfg, self.from_checkpoint = lake, cfg, from_checkpoint
        self.stop_after, self.idle_timeout_s, self.stop_file = stop_after, idle_timeout_s, stop_file
        self.progress, self.on_version = progress, on_version
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.rank = int(os.environ["RANK"])
        self.signalled = False
        self.out = FollowResult(world_size=self.world_size)
        self.skipped: set[str] = set()
        self.unrecorded_skips: list[dict[str, Any]] = []   # skips not yet in a published version's lineage
        self.since_full = 0                                # versions since the head last had a full state
        self.trained = False
        self.trackers: Any = None                          # rank 0: the tracker run of every version (trackers=)

    # -- start-up ----------------------------------------------------------------------
    def run(self) -> FollowResult:
        import torch

        t0 = time.perf_counter()
        torch.set_num_threads(self.cfg.threads)
        previous = self._install_sigterm()
        try:
            self._say("starting: loading the policy and building the training engine")
            self._start()
            self.out.startup_seconds = time.perf_counter() - t0
            self._say(f"ready in {self.out.startup_seconds:.1f}s at policy v{self.head.policy_version} "
                      f"({self.head.checkpoint_id})")
            self._open_trackers()
            self._loop()
            self._shutdown()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if self.trackers is not None:
                self.trackers.finish()
        self.out.head_checkpoint_id, self.out.head_policy_version = self.head.checkpoint_id, self.head.policy_version
        self.out.seconds = time.perf_counter() - t0
        return self.out

    def _open_trackers(self) -> None:
        """One tracker run for this resident trainer (rank 0, with ``trackers`` set): named after the
        head it started from and the start time, every version it publishes logged into it."""
        if self.rank != 0 or not self.cfg.trackers:
            return
        from datetime import datetime, timezone

        from pipeline.config import config_dict
        from pipeline.train.live import Trackers

        name = f"follow-{self.head.checkpoint_id}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}"
        self.trackers = Trackers(self.lake, self.cfg, checkpoint_id=name, config=config_dict(self.cfg),
                                 run_name=name, resident=True)

    def _say(self, msg: str) -> None:
        """A progress line on stderr (rank 0; off with progress=False, i.e. --no-progress): plain
        lines, so a piped or logged run (CI, a job's log) shows the start-up and the waits too."""
        if self.rank == 0 and self.progress is not False:
            print(f"resident trainer: {msg}", file=sys.stderr, flush=True)

    def _install_sigterm(self) -> Any:
        """SIGTERM: finish the current version, write the full state, exit 0. Under a
        launcher that asks for a stop through ``stop_file`` (ours), a worker's SIGTERM
        is the launcher tearing the group down: the default action (die) stays."""
        if self.stop_file is not None and self.world_size > 1:
            return None

        def handler(signum: int, frame: Any) -> None:
            self.signalled = True

        try:
            return signal.signal(signal.SIGTERM, handler)
        except ValueError:   # not the main thread: only stop_file / stop_after / idle_timeout stop it
            return None

    def _start(self) -> None:
        """Resolve the head, load the start of the recovery plan, build the engine once, replay."""
        from pipeline.policy_store import resolve_policy
        from pipeline.train import checkpoint as ck
        from pipeline.train.ds_adapter import ds_config, init_distributed
        from pipeline.train.model import load_causal_lm
        from pipeline.train.steps import build_engine

        init_distributed()
        head = resolve_policy(self.lake, self.from_checkpoint, verify=False, weights=False)
        plan = self._broadcast(recovery_plan(self.lake, head.checkpoint_id) if self.rank == 0 else None)
        start = resolve_policy(self.lake, plan.start)                        # hash-verified
        cfg = self.cfg
        self.lm = load_causal_lm(start.hf_dir, activation_checkpointing=cfg.activation_checkpointing,
                                 ds_config=ds_config(zero_stage=cfg.zero_stage, precision=cfg.precision,
                                                     offload=cfg.offload, max_grad_norm=cfg.max_grad_norm))
        self.strategy = build_engine(cfg, self.lm)
        self.optimizer_from: str | None = None
        if plan.load_state:
            self.strategy.load(start.path / "ds", ck.FINAL_TAG, scheduler=False)
            self.optimizer_from = start.checkpoint_id
        self.head = start
        self.skipped = recorded_skips(self.lake, head.checkpoint_id) if self.rank == 0 else set()
        for row in plan.replay:
            self._replay(row)
        self.since_full = len(plan.replay)
        if plan.replay and self.rank == 0:
            print(f"note: replayed {len(plan.replay)} version(s) after {plan.start}, every weight hash equal to the "
                  f"published one; continuing from v{self.head.policy_version}", file=sys.stderr)

    def _replay(self, row: dict[str, Any]) -> None:
        """Re-train a published version from the in-memory state; its checkpoint id
        and weight hashes must be the published ones."""
        from pipeline.policy_store import hash_dir, resolve_policy
        from pipeline.policy_store.delta import ensure_rebuilt
        from pipeline.train import checkpoint as ck
        from pipeline.train.checkpoint import weight_hashes
        from pipeline.train.identity import new_run
        from pipeline.train.steps import prepare_data

        sid = row["snapshot_ids"][0]
        if int(row["world_size"]) != self.world_size:
            raise ConfigError(f"checkpoint {row['checkpoint_id']} was trained by {row['world_size']} process(es); "
                              f"replaying it with {self.world_size} would not give the same bytes",
                              hint=f"restart with --nproc {row['world_size']}")
        run = new_run(self.lake, sid, self.cfg, self.head, world_size=self.world_size, rank=self.rank)
        if run.checkpoint_id != row["checkpoint_id"]:
            raise ConfigError(f"replaying snapshot {sid} from {self.head.checkpoint_id} names checkpoint "
                              f"{run.checkpoint_id}, but {row['checkpoint_id']} was published: the config differs "
                              "from the one this line was trained with",
                              hint="restart with the line's --config/--set (recorded in its checkpoints rows)")
        data = prepare_data(run, lm=self.lm)
        self._train(run, data, replay=True)   # the weights it leaves in memory are what is compared
        published = resolve_policy(self.lake, row["checkpoint_id"], verify=False)
        with tempfile.TemporaryDirectory(prefix="pipeline-replay-") as tmp:
            out = Path(tmp) / "v"
            state_dict = self.strategy.consolidated_state_dict(self.lm)
            if self.rank == 0:
                ck.export_hf(self.lm, ensure_rebuilt(self.lake, self.head), out / "hf", state_dict,
                             dtype=self.cfg.publish_dtype)
                got = weight_hashes({f"hf/{k}": v for k, v in hash_dir(out / "hf").items()})
                want = weight_hashes(published.file_sha256)
                if any(k.startswith("delta/") for k in want):    # delta-only: the digest of the rebuilt weights
                    got, want = {"weights": _digest(out / "hf")}, {"weights": _digest(published.hf_dir)}
                if got != want:
                    raise IntegrityError(f"replaying snapshot {sid} did not reproduce checkpoint {row['checkpoint_id']} "
                                         f"(weights {got} != published {want})",
                                         hint="docs/resident-trainer.md, 'What makes replay bitwise': same world "
                                              "size, config, code and hardware as the line was trained with")
        self.strategy.barrier()
        self.head = resolve_policy(self.lake, row["checkpoint_id"])
        self.optimizer_from = self.head.checkpoint_id
        self.trained = True
        self.out.replayed.append(row["checkpoint_id"])

    # -- one version ---------------------------------------------------------------------
    def _plan(self, run: Run, data: Any, *, replay: bool) -> Any:
        """Step 4 from the in-memory state, as the chain does it from files: reseed,
        restart the LR schedule, pre-pass, off-policy gate (not on replay: the
        version passed it when first trained), step plan."""
        from pipeline.train import checkpoint as ck
        from pipeline.train.steps import plan_run

        ck.seed_everything(self.cfg.seed)
        self.strategy.reset_lr()
        return plan_run(run, self.strategy, data.members, optimizer_from=self.optimizer_from,
                        train_lag=data.freshness["train_lag_max"], gate=not replay)

    def _train(self, run: Run, data: Any, *, replay: bool, plan: Any = None) -> tuple[Any, Any]:
        """Steps 4 (unless ``plan``) and 6 from the in-memory state."""
        from pipeline.train.records import State
        from pipeline.train.steps import step_loop

        plan = plan if plan is not None else self._plan(run, data, replay=replay)
        state = State()
        step_loop(run, self.strategy, data.members, plan, state, self.progress, live=not replay)
        return plan, state

    def _version(self, sid: str) -> None:
        """Train ``sid`` from the head and publish the next version (or record a skip)."""
        from pipeline.errors import ConflictError
        from pipeline.lake.delta import pause_point
        from pipeline.train.identity import identify
        from pipeline.train.publish import checkpoint_and_publish, lineage_run
        from pipeline.train.records import TrainResult
        from pipeline.train.steps import prepare_data

        t0 = time.perf_counter()
        n = len(self.out.versions) + 1
        try:
            run = identify(self.lake, sid, self.cfg, from_checkpoint=None, resume=False, force=False, parent=self.head)
        except ConflictError as exc:      # consumed meanwhile by another trainer: not ours to train
            self._skip(sid, "consumed", exc.message, record=False)
            return
        if isinstance(run, TrainResult):  # another trainer of this very line published it: two followers
            raise ConflictError(f"checkpoint {run.checkpoint_id} (snapshot {sid} from {self.head.checkpoint_id}) was "
                                "published by another trainer while this one held the line",
                                hint="run one resident trainer per line; restart this one to replay and continue")
        try:
            data = prepare_data(run, lm=self.lm)
        except ForeignSnapshotError as exc:   # sampled by a version not on this line: lineage, not lag
            self._skip(sid, "other_line", exc.message)
            return
        except StaleSnapshotError as exc:
            self._skip(sid, "stale", exc.message)
            return
        except PipelineError as exc:      # not trainable by this line (other tokenizer, damaged files, ...)
            self._skip(sid, type(exc).__name__, exc.message)
            return
        try:
            plan = self._plan(run, data, replay=False)
        except OffPolicySnapshotError as exc:   # measured against the head's weights: refused like a stale one
            self._skip(sid, "off_policy", exc.message)
            return
        if self.trackers is not None:    # rank 0: this version's steps follow the previous version's
            run.trackers = self.trackers
            from pipeline.policy_store import next_policy_version

            self.trackers.begin(run.checkpoint_id, next_policy_version(self.lake))   # the version it will publish
        with lineage_run(run):
            plan, state = self._train(run, data, replay=False, plan=plan)
            full = self._broadcast(self._full_now(n) if self.rank == 0 else None)
            extra = {"trainer": "follow", "skipped_snapshots": self.unrecorded_skips}
            result = checkpoint_and_publish(run, self.strategy, data, plan, state, crash_at=None, t_start=t0,
                                            full=full, extra_config=extra, pause_prefix=f"follow:v{n}:",
                                            exclusive=True)
            self.strategy.barrier()
            result = self.strategy.broadcast_object(result)
        self.unrecorded_skips = []
        self.head = _published_ref(result)
        self.optimizer_from = self.head.checkpoint_id
        self.since_full = 0 if full else self.since_full + 1
        self.trained = True
        if full:
            self.out.full_state.append(result.checkpoint_id)
        root = Path(result.path)
        d = result.to_dict() | {"full_state": full,
                                "bytes_written": sum(p.stat().st_size for p in root.rglob("*") if p.is_file())}
        self.out.versions.append(d)
        if self.rank == 0:
            pause_point(f"follow:v{n}:published")
            if self.on_version is not None:
                self.on_version(d)

    def _full_now(self, n: int) -> bool:
        last = self.stop_after is not None and n >= self.stop_after
        return last or self._stop_requested() or self.since_full + 1 >= self.cfg.full_checkpoint_every

    def _skip(self, sid: str, reason: str, message: str, *, record: bool = True) -> None:
        self.skipped.add(sid)
        entry = {"snapshot_id": sid, "reason": reason, "message": message}
        self.out.skipped.append(entry)
        if record:
            self.unrecorded_skips.append(entry)
        if self.rank == 0:
            print(f"note: skipped snapshot {sid}: {reason}: {message} (recorded in the next version's lineage, "
                  "train_config.skipped_snapshots)", file=sys.stderr)

    # -- waiting and stopping -----------------------------------------------------------------
    def _stop_requested(self) -> bool:
        return self.signalled or (self.stop_file is not None and Path(self.stop_file).exists())

    def _decide(self, idle_since: float) -> tuple[str, Any]:
        """Rank 0: ("stop", why), ("train", snapshot id), ("skip", (snapshot id, why)) or ("wait", None)."""
        if self.stop_after is not None and len(self.out.versions) >= self.stop_after:
            return "stop", "stop_after"
        if self.signalled:
            return "stop", "signal"
        if self.stop_file is not None and Path(self.stop_file).exists():
            return "stop", "stop_file"
        pending = pending_snapshots(self.lake, self.skipped)
        if pending:
            why = superseded(self.lake, pending[0])
            return ("skip", (pending[0], why)) if why else ("train", pending[0])
        if self.idle_timeout_s is not None and time.monotonic() - idle_since > self.idle_timeout_s:
            return "stop", "idle_timeout"
        return "wait", None

    def _loop(self) -> None:
        idle_since = time.monotonic()
        said = None      # when the last waiting line was printed (None: not waiting yet)
        while True:
            action, arg = self._broadcast(self._decide(idle_since) if self.rank == 0 else None)
            if action == "stop":
                self.out.stopped_by = str(arg)
                self._say(f"stopping ({arg})")
                return
            if action == "wait":
                now = time.monotonic()
                if said is None or now - said >= WAIT_NOTE_EVERY_S:
                    self._say(("waiting for an admitted snapshot (pipeline admit cuts one)" if said is None
                               else f"still waiting: no snapshot for {now - idle_since:.0f}s")
                              + (f"; stops after {self.idle_timeout_s:g}s idle" if self.idle_timeout_s is not None
                                 else "; SIGTERM or Ctrl-C stops it"))
                    said = now
                # every rank waits here, between two broadcasts: a collective never waits
                # longer than a poll (process-group timeouts stay out of reach)
                time.sleep(self.cfg.follow_poll_s)
                continue
            if action == "skip":
                self._skip(arg[0], "superseded", arg[1])
                continue
            assert arg is not None
            self._say(f"training snapshot {arg}")
            self._version(arg)
            idle_since, said = time.monotonic(), None

    def _shutdown(self) -> None:
        """The full state of the head at exit, unless it already has one: the next
        start then loads it and replays nothing."""
        from pipeline.policy_store import published_rel, upload_checkpoint
        from pipeline.train import checkpoint as ck

        if not (self.trained and self.since_full > 0):
            return
        root = self.head.path
        ck.write_full_state(self.strategy, root, {"checkpoint_id": self.head.checkpoint_id, "written_at": "shutdown"})
        if self.rank == 0:
            upload_checkpoint(self.lake, self.head.checkpoint_id, root,   # object-store lakes; no-op when local
                              rel=published_rel(self.lake, self.head.checkpoint_id))
        self.since_full = 0
        self.out.full_state.append(self.head.checkpoint_id)

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's value on every rank (the decisions are rank 0's)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _digest(hf: Path) -> str:
    from pipeline.policy_store.delta import load_hf_weights, weights_digest

    return weights_digest(load_hf_weights(hf))


def _published_ref(result: Any) -> PolicyRef:
    """The version just published, as the next version's parent (its files were
    hashed by the publish a moment ago: no second read of the weights). A delta-only
    version's weights are the copy its writer left in this machine's cache."""
    from pipeline.policy_store import PolicyRef

    return PolicyRef(result.checkpoint_id, int(result.policy_version), Path(result.path), dict(result.weight_sha256),
                     hf_path=Path(result.rebuilt_hf) if result.rebuilt_hf else None)


# -- N processes --------------------------------------------------------------------------------


def _launch(lake: Lake, cfg: TrainConfig, *, from_checkpoint: str | int | None, nproc: int, stop_after: int | None,
            idle_timeout_s: float | None, stop_file: str | None, progress: bool | None) -> FollowResult:
    """N processes via torchrun running pipeline.train.worker in follow mode. SIGTERM to
    this process becomes a stop file the workers' rank 0 polls (torchrun would kill
    the workers 30 s after forwarding a SIGTERM, mid-version)."""
    from pipeline.config import config_dict
    from pipeline.train.launch import launch

    with tempfile.TemporaryDirectory(prefix="pipeline-follow-") as tmp:
        stop = stop_file or str(Path(tmp) / "stop")
        data = launch({"mode": "follow", "lake": lake.uri, "config": config_dict(cfg), "from_checkpoint": from_checkpoint,
                       "stop_after": stop_after, "idle_timeout_s": idle_timeout_s, "stop_file": stop,
                       "progress": progress}, nproc, stop_file=stop,
                      failed=f"{nproc}-process resident trainer failed",
                      hint="see the worker output above; restarting it replays from the last full state")
    return FollowResult(**data)
