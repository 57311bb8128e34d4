"""TrainConfig: every knob of ``pipeline train``, one frozen dataclass.

    pipeline train --batch-snapshot ID --set lr=1e-4 --set agg=seq-mean-token-sum-norm

The resolved config is stored with every checkpoint (``train_config.json`` and
the ``checkpoints`` row); its hash is part of the checkpoint id, so the same
snapshot + parent + config always names the same checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pipeline.errors import ConfigError

# Metric trackers the live metrics may mirror to (pipeline/train/live.py opens them).
TRACKERS = ("tensorboard", "mlflow", "wandb")


def parse_trackers(text: str) -> list[str]:
    names = [t.strip().lower() for t in (text or "").replace(";", ",").split(",") if t.strip()]
    bad = [t for t in names if t not in TRACKERS]
    if bad:
        raise ConfigError(f"unknown tracker(s) {bad}", hint=f"trackers is a comma-separated subset of {list(TRACKERS)}")
    return list(dict.fromkeys(names))


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    config_section: ClassVar[str] = "train"   # its section in an experiment file (pipeline.config.SECTIONS)

    # -- optimisation -------------------------------------------------------
    seed: int = field(default=0, metadata={"ge": 0, "help": "seed for data order, dropout and every RNG"})
    lr: float = field(default=1e-5, metadata={"gt": 0, "help": "AdamW learning rate (constant after warmup)"})
    warmup_steps: int = field(default=0, metadata={"ge": 0, "help": "linear LR warmup over this many optimizer steps"})
    weight_decay: float = field(default=0.0, metadata={"ge": 0, "help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"ge": 0, "help": "gradient clipping (0 = off)"})
    epochs: int = field(default=1, metadata={"ge": 1, "help": "passes over the snapshot"})
    max_steps: int = field(default=0, metadata={"ge": 0, "help": "stop after this many optimizer steps (0 = no cap)"})
    micro_batch_tokens: int = field(default=4096, metadata={"ge": 1,
        "help": "token budget of one micro-batch, padding included (rows x longest row)"})
    grad_accum: int = field(default=1, metadata={"ge": 1,
        "help": "micro-batches per optimizer step (the step's loss is normalized over all of them)"})
    # -- DeepSpeed ----------------------------------------------------------
    zero_stage: int = field(default=0, metadata={
        "help": "DeepSpeed ZeRO stage: 0, 1, 2 or 3 (3 partitions the parameters too; the LM head is gathered "
                "only for the chunked log-prob call)"})
    precision: Literal["fp32", "bf16"] = field(default="fp32", metadata={
        "help": "fp32 or bf16 (fp16 is refused by DeepSpeed on CPU)"})
    offload: bool = field(default=False, metadata={
        "help": "ZeRO-Offload to CPU (zero_stage >= 1): the optimizer state; with zero_stage=3 the parameters too"})
    activation_checkpointing: bool = field(default=False, metadata={
        "help": "recompute decoder activations in backward (less memory, ~30% more compute)"})
    threads: int = field(default=1, metadata={"ge": 1, "help": "torch intra-op threads (1 is fastest for tiny models)"})
    # -- loss ---------------------------------------------------------------
    policy_loss: Literal["auto", "ppo", "reinforce"] = field(default="auto", metadata={
        "help": "ppo (clipped surrogate), reinforce (no ratio), auto = reinforce iff every group has one member"})
    clip_low: float = field(default=0.2, metadata={"ge": 0, "lt": 1, "help": "PPO clip below: ratio >= 1 - clip_low"})
    clip_high: float = field(default=0.2, metadata={"ge": 0,
        "help": "PPO clip above: ratio <= 1 + clip_high (DAPO clip-higher: 0.28)"})
    ratio_level: Literal["token", "sequence"] = field(default="token", metadata={
        "help": "token (PPO/GRPO) or sequence (GSPO: length-normalized sequence ratio; use clips ~3e-4/4e-4)"})
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = field(
        default="token-mean", metadata={"help": "loss aggregation over tokens and sequences"})
    norm_len: int = field(default=0, metadata={"ge": 0,
        "help": "Dr.GRPO constant normalizer for seq-mean-token-sum-norm (0 = longest response of the snapshot)"})
    kl_kind: Literal["k1", "k2", "k3"] = field(default="k3", metadata={"help": "KL estimator (k3: e^u - u - 1)"})
    kl_coef: float = field(default=0.0, metadata={"ge": 0, "help": "KL penalty coefficient (0 = no reference policy)"})
    kl_reference: str = field(default="initial", metadata={
        "help": "frozen reference policy: 'initial' (policy version 0, the warm start: one fixed anchor for the "
                "whole training), 'parent' (this update's starting weights: an anchor that moves every "
                "iteration, a weaker KL), a policy version or a checkpoint id"})
    entropy_coef: float = field(default=0.0, metadata={"ge": 0, "help": "entropy bonus coefficient"})
    old_logprobs: Literal["recompute", "rollout"] = field(default="recompute", metadata={
        "help": "recompute: old log-probs from the frozen starting weights (+ truncated IS vs the rollout's); "
                "rollout: the rollout engine's log-probs"})
    tis_cap: float = field(default=2.0, metadata={"ge": 0,
        "help": "truncated importance-sampling cap for the engine/trainer mismatch (recompute mode; 0 = off)"})
    # -- freshness at use -----------------------------------------------------
    max_train_lag: int | None = field(default=2, metadata={"ge": 0,
        "help": "refuse a snapshot whose oldest sampled token is more than this many versions behind the policy "
                "it would update (parent version - oldest token version); null = no limit. Admission bounds the "
                "lag when it decides (max_policy_lag, default 1); this bounds it when the data is used, after the "
                "queue (default 2: admitted at the limit, then one more publication while it waited)"})
    min_ess_fraction: float | None = field(default=None, metadata={
        "help": "refuse a snapshot whose sequence-level importance-sampling ESS/n, of the policy it would update "
                "against the rollout's sampling log-probs (computed before the first update), is below this "
                "(0 < x <= 1); null = off"})
    max_ratio_p99: float | None = field(default=None, metadata={
        "help": "refuse a snapshot whose token importance ratio pi/mu has a 99th percentile above this (> 1; "
                "same pre-update measurement); null = off"})
    stale_lr_scale: float = field(default=1.0, metadata={"gt": 0, "le": 1,
        "help": "learning rate x stale_lr_scale ** train_lag_max for a snapshot that many versions behind the "
                "policy it updates (1.0 = off; e.g. 0.5 halves the LR per version of lag)"})
    ratio_tail_bound: float = field(default=2.0, metadata={"gt": 0,
        "help": "the token ratio bound of the behav_ratio_above figure (share of tokens with pi/mu above it)"})
    # -- memory / data ------------------------------------------------------
    logprob_chunk: int = field(default=1024, metadata={"ge": 1, "help": "rows per chunk of the log-prob head"})
    vocab_chunk: int = field(default=0, metadata={"ge": 0, "help": "vocabulary columns per chunk (0 = whole vocabulary)"})
    step_order: Literal["stratified", "shuffled", "length"] = field(default="stratified", metadata={
        "help": "which length-packed micro-batches share an optimizer step, seeded by seed and epoch: stratified = "
                "one micro-batch of each of grad_accum length bands per step (every step mixes lengths), shuffled = "
                "a random permutation cut into steps, length = the pack order (each step one length stratum); "
                "the micro-batches, hence the padding, are the same under every order"})
    carry_optimizer: bool = field(default=True, metadata={
        "help": "start from the parent checkpoint's optimizer state (AdamW moments) when it was trained by this "
                "trainer with the same zero_stage, precision, offload and world size; else a fresh optimizer"})
    save_every: int = field(default=0, metadata={"ge": 0,
        "help": "save a resumable state every N optimizer steps (0 = only the final checkpoint)"})
    # -- publication ---------------------------------------------------------
    publish_dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={
        "help": "dtype of the published hf/ weights rollout engines load (bfloat16: half the bytes, what vLLM "
                "serves on GPUs); the trainer's master weights, optimizer and full state stay fp32. Part of a "
                "version's identity when not float32"})
    anchor_every: int = field(default=8, metadata={"ge": 1,
        "help": "every Nth version of a line records its full weights as an anchor; the versions between record "
                "a sparse delta against their parent (changed elements only; pipeline.policy_store.delta). "
                "1 = anchors only"})
    # -- the resident trainer (pipeline train --follow; not part of the run's identity: see PUBLISHING) --
    full_checkpoint_every: int = field(default=16, metadata={"ge": 1,
        "help": "--follow: write the full DeepSpeed state (fp32 weights + AdamW moments) with every Nth published "
                "version and at shutdown; the versions between publish their weights only. A restart after a crash "
                "re-trains at most N-1 snapshots (docs/resident-trainer.md)"})
    follow_poll_s: float = field(default=2.0, metadata={"gt": 0,
        "help": "--follow: seconds between looks for a newly admitted snapshot"})
    # -- observability (not part of the run's identity: see OBSERVABILITY) ----
    metrics_every_steps: int = field(default=10, metadata={
        "help": "append the per-step metrics to the metrics table every N steps during the run (0: by time only)"})
    metrics_every_s: float = field(default=30.0, metadata={
        "help": "... or once this many seconds have passed since the last append (0: by steps only)"})
    trackers: str = field(default="", metadata={
        "help": "mirror the metrics to trackers: comma-separated subset of tensorboard, mlflow, wandb (off by default)"})
    tracker_dir: str = field(default="", metadata={"help": "tracker files (default <lake>/_trackers)"})

    def __post_init__(self) -> None:
        parse_trackers(self.trackers)
        if self.metrics_every_steps < 0 or self.metrics_every_s < 0:
            raise ConfigError("metrics_every_steps and metrics_every_s must be >= 0")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage={self.zero_stage}: DeepSpeed ZeRO stages are 0, 1, 2 and 3")
        if self.offload and self.zero_stage == 0:
            raise ConfigError("offload needs zero_stage >= 1", hint="--set zero_stage=1 --set offload=true")
        for name in ("epochs", "micro_batch_tokens", "grad_accum", "logprob_chunk", "threads", "full_checkpoint_every",
                     "anchor_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "warmup_steps", "norm_len", "vocab_chunk", "save_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            raise ConfigError(f"clip_low={self.clip_low}, clip_high={self.clip_high}: need 0 <= clip_low < 1, clip_high >= 0")
        if self.follow_poll_s <= 0:
            raise ConfigError(f"follow_poll_s must be > 0, got {self.follow_poll_s}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.max_train_lag is not None and self.max_train_lag < 0:
            raise ConfigError(f"max_train_lag must be >= 0 or null, got {self.max_train_lag}")
        if self.min_ess_fraction is not None and not (0 < self.min_ess_fraction <= 1):
            raise ConfigError(f"min_ess_fraction must be in (0, 1] or null, got {self.min_ess_fraction}")
        if self.max_ratio_p99 is not None and not self.max_ratio_p99 > 1:
            raise ConfigError(f"max_ratio_p99 must be > 1 or null, got {self.max_ratio_p99}",
                              hint="the ratio's median is ~1 on fresh data: a bound <= 1 refuses every snapshot")
        if not (0 < self.stale_lr_scale <= 1):
            raise ConfigError(f"stale_lr_scale must be in (0, 1], got {self.stale_lr_scale}")
        if self.ratio_tail_bound <= 0:
            raise ConfigError(f"ratio_tail_bound must be > 0, got {self.ratio_tail_bound}")
        if self.kl_coef < 0 or self.entropy_coef < 0 or self.tis_cap < 0:
            raise ConfigError("kl_coef, entropy_coef and tis_cap must be >= 0")


# How a run reports itself, not what it computes: changing these names the same
# run (same checkpoint id, resumable state) and the same weights.
OBSERVABILITY = ("metrics_every_steps", "metrics_every_s", "trackers", "tracker_dir", "ratio_tail_bound")
# Whether a run may start, not what it computes: a run that passes the gate trains
# the same weights under any bound, so the bound is not part of its identity either.
ADMISSION_GATES = ("max_train_lag", "min_ess_fraction", "max_ratio_p99")
# How the resident trainer publishes and polls, not what it computes: a version
# has the same weights (and checkpoint id) whether or not its full state was written.
# anchor_every decides which files record the weights, not the weights.
PUBLISHING = ("full_checkpoint_every", "follow_poll_s", "anchor_every")


def identity_hash(cfg: TrainConfig) -> str:
    """sha256 of the config without the OBSERVABILITY, ADMISSION_GATES and PUBLISHING fields (the run identity's part).
    ``publish_dtype`` counts only when not float32 (the published bytes differ; ids of fp32 runs stay as they were)."""
    import hashlib
    import json

    from pipeline.config import config_dict

    d = {k: v for k, v in config_dict(cfg).items() if k not in OBSERVABILITY + ADMISSION_GATES + PUBLISHING}
    if d.get("publish_dtype") == "float32":
        del d["publish_dtype"]
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()
