"""The records one training run passes between its named steps (pipeline.train.run):
who the run is (``Run``), what it trains on (``Data``), what the pre-pass resolved
(``Plan``), how far it got (``State``), and what it published (``TrainResult``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.policy_store import PolicyRef
    from pipeline.train.config import TrainConfig
    from pipeline.train.data import Members
    from pipeline.train.live import LiveMetrics, Trackers
    from pipeline.train.packing import Step


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    checkpoint_id: str
    policy_version: int
    parent_checkpoint_id: str | None
    snapshot_id: str
    global_step: int
    samples_seen: int
    metrics: dict[str, Any]                 # summary over the run's steps
    weight_sha256: dict[str, str]           # hf/ weight files (an anchor) or its delta file -> sha256
    path: str                               # local checkpoint directory
    world_size: int = 1
    resumed_from_step: int | None = None
    already_published: bool = False
    seconds: float = 0.0
    lineage_run_id: str | None = None
    worker_exit_codes: list[int] | None = None   # --nproc N: the launcher's exit code when it was not 0
    published_by: str | None = None         # already_published: who published it (a racing run, an earlier one)
    rebuilt_hf: str | None = None           # a delta-only version: its full weights in this machine's cache

    @property
    def hf_dir(self) -> Path:
        """The exported policy (what rollout engines load): ``hf/``, or for a delta-only
        version the copy of its weights its writer left in this machine's cache."""
        return Path(self.rebuilt_hf) if self.rebuilt_hf else Path(self.path) / "hf"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)



@dataclass(kw_only=True)
class Run:
    """One training run: who it is, where its files go, its lineage (step 1)."""

    lake: Lake
    snapshot_id: str
    cfg: TrainConfig
    world_size: int
    rank: int
    parent: PolicyRef
    run_key: str
    checkpoint_id: str
    generation: int
    work: Path                      # resumable state of the interrupted run
    final: Path                     # this run's checkpoint directory (the row names it if this run publishes)
    lineage_run_id: str
    inputs: list[Any]               # OpenLineage input datasets
    ol: dict[str, Any]              # the other OpenLineage run-event arguments
    live: LiveMetrics | None = None  # rank 0, once the step loop starts
    trackers: Trackers | None = None  # a resident trainer's tracker run, shared by its versions (rank 0)
    final_rel: str = ""             # ``final`` relative to the lake: this run's own directory


@dataclass
class Data:
    """The verified snapshot and the parent model (step 2)."""

    members: Members
    lm: Any                         # the parent's transformers model
    lineage_cfg: dict[str, Any]     # tokenizer / template revisions recorded with the checkpoint
    freshness: dict[str, Any]       # check_freshness figures + consumed_at, snapshot_wait_ms


@dataclass(kw_only=True)
class Plan:
    """What the pre-pass resolved: the loss, the step plan, the length normaliser (step 4)."""

    loss_kind: Literal["ppo", "reinforce"]   # cfg.policy_loss with "auto" resolved (steps.plan_run)
    optimizer_from: str | None
    steps: list[Step]
    norm_len: float
    prepass_seconds: float = 0.0    # old / reference log-probs under the frozen starting weights
    offpolicy: dict[str, Any] = dataclasses.field(default_factory=dict)  # snapshot_* figures, lr_scale


@dataclass
class State:
    """Progress through the steps; restored on resume (step 5), advanced by the loop (step 6)."""

    start: int = 0
    samples_seen: int = 0
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    resumed_from: int | None = None


