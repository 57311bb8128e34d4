"""Live training metrics: the per-step rows reach the ``metrics`` table while
the run goes on, and experiment trackers mirror exactly those rows.

Commit rate is bounded: rank 0 appends the rows computed since the last
commit once ``metrics_every_steps`` steps or ``metrics_every_s`` seconds have
passed (and at publish), so a long run costs a few commits per minute, not one
per step. Each commit is exactly once per (checkpoint, step): the application
transaction ``metrics:<checkpoint_id>`` records how many steps have landed (its
version is the count), and a commit only carries steps at or after that count.
A run killed after a commit and restarted (recomputing the same steps) adds
only the steps that had not landed.

Trackers (``trackers = "tensorboard,mlflow,wandb"``, off by default, like
verl's ``trainer.logger``) receive the same rows right after they land, with
``global_step`` as the step: TensorBoard event files under
``<tracker_dir>/tensorboard/<checkpoint_id>``; MLflow at ``MLFLOW_TRACKING_URI``
or a local file store ``<tracker_dir>/mlruns`` (experiment
``trajectory-lakehouse``, run name = checkpoint id); wandb in offline mode
unless ``WANDB_MODE`` says otherwise, files under ``<tracker_dir>/wandb``.
The resident trainer opens one tracker run for all its versions
(``Trackers(resident=True)``: ``follow-<head>-<start>``, steps monotonic
across versions, the version a scalar and a tag).
``tracker_dir`` defaults to ``<lake>/_trackers`` (a cache directory for an
object-store lake).
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import ConfigError
from pipeline.train.config import TRACKERS, parse_trackers  # noqa: F401 - TRACKERS: re-exported

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake
    from pipeline.train.config import TrainConfig

# Columns of a metrics row that are not numbers to plot.
NOT_SCALARS = {"checkpoint_id", "snapshot_id", "run_id", "global_step", "created_at"}
EXPERIMENT = "trajectory-lakehouse"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a row (None left out), as tracker scalars."""
    return {k: float(v) for k, v in row.items()
            if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}


def tracker_dir(lake: Lake, cfg: TrainConfig) -> Path:
    if getattr(cfg, "tracker_dir", ""):
        return Path(cfg.tracker_dir)
    if lake.is_local:
        return Path(lake.uri) / "_trackers"
    from pipeline.policy_store import local_checkpoint_dir

    return local_checkpoint_dir(lake, "_trackers")


class Trackers:
    """The configured trackers of one training run (rank 0), or of a resident trainer
    (``resident=True``, named ``run_name``): one tracker run over every version it
    publishes, its step monotonic across versions (each version's steps follow the
    previous one's), the version a scalar (``train/policy_version``) and a tag per
    version (``v<N>`` = checkpoint id); ``close`` after a version keeps it open,
    ``finish`` ends it."""

    def __init__(self, lake: Lake, cfg: TrainConfig, *, checkpoint_id: str, config: dict[str, Any],
                 run_name: str | None = None, resident: bool = False) -> None:
        self.names = parse_trackers(getattr(cfg, "trackers", ""))
        self.sinks: list[Any] = []
        self.resident = resident
        self.offset = self.next_step = 0
        self.version: int | None = None
        if not self.names:
            return
        root = tracker_dir(lake, cfg)
        for name in self.names:
            self.sinks.append(_OPEN[name](root, run_name or checkpoint_id, config))

    def begin(self, checkpoint_id: str, policy_version: int) -> None:
        """A resident trainer's next version: its steps start after the last one logged."""
        self.offset, self.version = self.next_step, policy_version
        for sink in self.sinks:
            sink.tag(f"v{policy_version}", checkpoint_id, self.offset)

    def log(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            step = self.offset + int(r["global_step"])
            values = scalars(r) | ({} if self.version is None else {"policy_version": float(self.version)})
            for sink in self.sinks:
                sink.log(values, step)
            self.next_step = max(self.next_step, step + 1)

    def close(self) -> None:
        if not self.resident:
            self.finish()

    def finish(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:  # pragma: no cover - a tracker never fails the run at the end
                pass
        self.sinks = []


class _TensorBoard:
    def __init__(self, root: Path, checkpoint_id: str, config: dict[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("trackers=tensorboard needs the tensorboard package",
                              hint="pip install tensorboard") from exc
        self.w = SummaryWriter(log_dir=str(root / "tensorboard" / checkpoint_id))
        self.w.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(config.items())), 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.w.add_scalar(f"train/{k}", v, step)
        self.w.flush()

    def tag(self, key: str, value: str, step: int) -> None:
        self.w.add_text(f"versions/{key}", value, step)

    def close(self) -> None:
        self.w.close()


class _MLflow:
    def __init__(self, root: Path, checkpoint_id: str, config: dict[str, Any]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError("trackers=mlflow needs mlflow (or mlflow-skinny)", hint="pip install mlflow-skinny") from exc
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # the local file store (MLflow 3 keeps it in maintenance mode behind this opt-in);
            # set MLFLOW_TRACKING_URI (sqlite:///..., http://...) for any other backend
            uri = (root / "mlruns").absolute().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(EXPERIMENT)
        # one MLflow run per checkpoint: a restarted run continues the same one
        found = self.client.search_runs([exp_id], filter_string=f"tags.checkpoint_id = '{checkpoint_id}'",
                                        max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            self.run_id = self.client.create_run(exp_id, run_name=checkpoint_id,
                                                 tags={"checkpoint_id": checkpoint_id}).info.run_id
            for k, v in sorted(config.items()):
                self.client.log_param(self.run_id, k, str(v)[:500])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"train/{k}", v, now, step) for k, v in values.items()])

    def tag(self, key: str, value: str, step: int) -> None:
        self.client.set_tag(self.run_id, key, value)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Wandb:
    def __init__(self, root: Path, checkpoint_id: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError("trackers=wandb needs the wandb package", hint="pip install wandb") from exc
        (root / "wandb").mkdir(parents=True, exist_ok=True)
        # a plain string: wandb validates it (its settings accept more modes than the Literal of init's stub)
        mode: Any = os.environ.get("WANDB_MODE", "offline")
        # silent: wandb's banner, sync hints and run summary (~30 lines a run) go nowhere, like the other
        # libraries' noise; the run's own files still hold everything (WANDB_SILENT=false brings them back)
        quiet = os.environ.get("WANDB_SILENT", "true").lower() not in ("0", "false", "no")
        settings = wandb.Settings(silent=True, quiet=True, console="off") if quiet else None
        if settings is not None:
            # wandb's own terminal messages follow its process-wide setup, not init's settings: silence that
            # too, and its suggestion to install Weave whenever an LLM library (openai: vLLM imports it) is loaded
            os.environ.setdefault("WANDB_SILENT", "true")
            os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
            wandb.termsetup(settings, None)
        self.run = wandb.init(project=EXPERIMENT, name=checkpoint_id, id=checkpoint_id, resume="allow",
                              dir=str(root), config=config, mode=mode, settings=settings)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({f"train/{k}": v for k, v in values.items()}, step=step)

    def tag(self, key: str, value: str, step: int) -> None:
        self.run.tags = (*(self.run.tags or ()), f"{key}={value}")

    def close(self) -> None:
        self.run.finish()


_OPEN = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _Wandb}


class LiveMetrics:
    """Rank 0's writer of per-step metrics rows: bounded, exactly-once commits."""

    def __init__(self, lake: Lake, cfg: TrainConfig, *, checkpoint_id: str, command: str, config_hash: str,
                 trackers: Trackers | None = None) -> None:
        self.lake = lake
        self.every_steps = int(getattr(cfg, "metrics_every_steps", 0) or 0)
        self.every_s = float(getattr(cfg, "metrics_every_s", 0.0) or 0.0)
        self.app_id = f"metrics:{checkpoint_id}"
        self.command = command
        self.config_hash = config_hash
        self.trackers = trackers
        self.last_commit = time.monotonic()
        self.pending_steps = 0

    def landed_steps(self) -> int:
        """Steps of this checkpoint already in the table (the app transaction's version)."""
        if not self.lake.exists("metrics"):
            return 0
        return int(self.lake.transaction_version("metrics", self.app_id) or 0)

    def step_done(self, rows: list[dict[str, Any]]) -> None:
        """After each optimizer step: commit when N steps or S seconds have passed."""
        self.pending_steps += 1
        due = ((self.every_steps and self.pending_steps >= self.every_steps)
               or (self.every_s and time.monotonic() - self.last_commit >= self.every_s))
        if due:
            self.flush(rows)

    def flush(self, rows: list[dict[str, Any]]) -> int:
        """Append every row at or after the landed count; returns rows written."""
        import pyarrow as pa

        from pipeline.schema import arrow_schema

        self.pending_steps = 0
        self.last_commit = time.monotonic()
        if not rows:
            return 0
        landed = self.landed_steps()
        done = max(int(r["global_step"]) for r in rows) + 1
        new = [r for r in rows if int(r["global_step"]) >= landed]
        if not new or done <= landed:
            return 0
        mrows = [dict(r, created_at=datetime.fromisoformat(r["created_at"]) if isinstance(r["created_at"], str)
                      else r["created_at"]) for r in new]
        table = pa.Table.from_pylist(mrows, schema=arrow_schema("metrics"))
        res = self.lake.append("metrics", table, command=self.command, config_hash=self.config_hash,
                               app_id=self.app_id, txn_version=done)
        if res.landed and self.trackers is not None:
            self.trackers.log(new)
        return len(new) if res.landed else 0
