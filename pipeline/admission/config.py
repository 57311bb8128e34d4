"""The admission config: one frozen dataclass, every field documented.

Defaults follow docs/admission-rules.md. Load with
``pipeline.config.load_config(AdmissionConfig, file, parse_set(["k=v"]))``;
``validate()`` holds the cross-field checks with fix-it messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pipeline.admission.rules import BATCH_FIELDS  # the configuration one snapshot holds
from pipeline.errors import ConfigError

# "AGG(component) OP number", e.g. "max(task_success) >= 0.5"
GATE_RE = re.compile(r"^\s*(min|max|mean)\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*(>=|<=|>|<|==)\s*"
                     r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
BUCKET_FIELDS = ("difficulty", "length_bucket", "tool_call_bucket", "reward_std_bucket")


@dataclass(frozen=True)
class Gate:
    """One parsed ``update_if`` expression over the valid members' reward components."""

    agg: str
    component: str
    op: str
    value: float
    text: str


def parse_gate(text: str) -> Gate:
    m = GATE_RE.match(text)
    if not m:
        raise ConfigError(f"update_if {text!r}: expected AGG(component) OP number",
                          hint="e.g. update_if=['max(task_success) >= 0.5']; AGG is min, max or mean")
    return Gate(m.group(1), m.group(2), m.group(3), float(m.group(4)), text.strip())


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    config_section: ClassVar[str] = "admission"   # its section in an experiment file (pipeline.config.SECTIONS)

    max_policy_lag: int = field(default=1, metadata={"ge": 0,
        "help": "Exclude members whose oldest sampled token is more than this many versions behind "
                "the current policy (stale_policy)."})
    max_queue_wait_ms: int | None = field(default=None, metadata={"ge": 0,
        "help": "Exclude members that waited longer than this in the queue (stale_wait); null = no limit."})
    min_valid_members: int = field(default=2, metadata={"ge": 1,
        "help": "Groups with fewer valid members are decided insufficient_valid."})
    min_reward_std: float = field(default=1e-6, metadata={"ge": 0,
        "help": "After max(reward) > min(reward), the population std of valid rewards must reach this "
                "(else zero_variance)."})
    drop_zero_variance: bool = field(default=True, metadata={
        "help": "Decide groups without reward spread zero_variance (dropped). false: admit them with advantage 0 "
                "(they cost training compute and carry no group-relative signal; for ablations)."})
    group_timeout_s: float = field(default=600.0, metadata={"ge": 0,
        "help": "An incomplete group whose oldest member finished this long ago is decided with what arrived."})
    admit_incomplete: bool = field(default=True, metadata={
        "help": "Whether a timed-out incomplete group may be admitted (false: decision incomplete)."})
    advantage: str = field(default="grpo", metadata={
        "help": "Advantage estimator: grpo, dr_grpo, rloo, reinforce_batch_norm, grpo_turn (per-turn credit "
                "from trajectories.turn_rewards, docs/admission-rules.md; registry in advantages.py)."})
    advantage_scaling: Literal["group", "batch", "none"] = field(default="group", metadata={
        "help": "grpo only: divide centred rewards by the group std (group), by the std of all centred "
                "rewards in the snapshot (batch), or not at all (none)."})
    eps: float = field(default=1e-6, metadata={"ge": 0, "help": "Added to the std before dividing."})
    baseline_momentum: float | None = field(default=None, metadata={"ge": 0, "lt": 1,
        "help": "reinforce_batch_norm only: running-mean baseline carried between snapshots, "
                "b = m*b_prev + (1-m)*mean(batch); null = the batch mean."})
    vocab_size: int | None = field(default=None, metadata={"ge": 1,
        "help": "Exclude members holding a token id >= this (out_of_vocabulary); null = the current policy's "
                "vocab_size (its checkpoint's hf/config.json), unchecked when that is unknown."})
    current_policy_version: int | None = field(default=None, metadata={
        "help": "Version freshness is measured against; null = newest published policy, else the newest "
                "policy_version seen in trajectories."})
    update_if: tuple[str, ...] = field(default=(), metadata={
        "help": "Reward-decomposition gates over valid members, each 'AGG(component) OP number' "
                "(AGG: min, max, mean), e.g. 'max(task_success) >= 0.5'; a failing group is decided gated."})
    component_caps: dict[str, float] = field(default_factory=dict, metadata={
        "help": "Caps on heuristic reward components: reward used = reward - sum(max(0, c - cap)) "
                "(e.g. {format: 0.1})."})
    length_edges: tuple[int, ...] = field(default=(256, 1024, 4096), metadata={"ge": 0,
        "help": "Response-length bucket edges (tokens); the group's bucket uses its longest member."})
    tool_call_edges: tuple[int, ...] = field(default=(1, 4, 16), metadata={"ge": 0,
        "help": "Tool-call bucket edges; the group's bucket uses its largest count."})
    reward_std_edges: tuple[float, ...] = field(default=(1e-6, 0.25), metadata={"ge": 0,
        "help": "Reward-std bucket edges over the valid members' population std."})
    bucket_caps: dict[str, int] = field(default_factory=dict, metadata={
        "help": "Max admitted groups per run for a bucket label, keyed 'FIELD:LABEL' "
                "(e.g. {'difficulty:easy': 100}); groups past a cap are decided capped (by group_id order)."})
    truncation: Literal["score_zero", "filter", "soft_penalty"] = field(default="score_zero", metadata={
        "help": "How a response cut by a length limit (stop_reason max_length) is scored (truncation.py): "
                "score_zero = its recorded reward 0 counts in the baseline; filter = excluded (reason "
                "truncated), never in a baseline; soft_penalty = DAPO's overlong penalty added to every valid "
                "reward by response length (needs overlong_max_len and overlong_interval)."})
    overlong_max_len: int = field(default=0, metadata={"ge": 0,
        "help": "soft_penalty: L_max, the length limit in response tokens (the rollout's max_total_tokens)."})
    overlong_interval: int = field(default=0, metadata={"ge": 0,
        "help": "soft_penalty: L_cache, the interval below L_max over which the penalty ramps from 0 to -1."})
    mix_batch_fields: tuple[str, ...] = field(default=(), metadata={
        "help": "Explicit opt-in to mix configurations in one snapshot: the fields among "
                "prompt_template_rev, env_version, verifier_version whose values may differ across the admitted "
                "groups. Default (): a snapshot holds one configuration; groups of any other are decided "
                "batch_config_mismatch."})
    reverify_top: int = field(default=0, metadata={"ge": 0,
        "help": "Re-verify, in every admitted group, this many valid members of largest |advantage| with "
                "`reverifier`; a group whose re-verdict differs is held as verdict_disagreement (0: off)."})
    shadow_sample: float = field(default=0.0, metadata={"ge": 0, "le": 1,
        "help": "Share of admitted groups (chosen by a hash of group_id) whose every member is re-verified "
                "(a shadow verifier's sample; 0: off)."})
    reverifier: str = field(default="", metadata={
        "help": "module:callable re-verifier: called with the selected trajectories rows, returns one verdict "
                "(PASS/FAIL/UNKNOWN) per row (needed when reverify_top or shadow_sample is set)."})
    quality: bool = field(default=True, metadata={
        "help": "Run the great-expectations suites (from schemas/) on candidates and on the snapshot."})
    batch_rows: int = field(default=65536, metadata={"ge": 1,
        "help": "Rows per batch when scanning token columns and materializing payload."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        from pipeline.admission.advantages import ESTIMATORS

        if self.advantage not in ESTIMATORS:
            raise ConfigError(f"advantage {self.advantage!r} is not registered",
                              hint=f"choose one of {sorted(ESTIMATORS)}")
        if self.min_valid_members < 1:
            raise ConfigError("min_valid_members must be >= 1")
        if ESTIMATORS[self.advantage].group_baseline and self.min_valid_members < 2:
            raise ConfigError(f"{self.advantage} needs a group baseline: min_valid_members must be >= 2",
                              hint="use advantage=reinforce_batch_norm for one sample per prompt")
        if self.max_policy_lag < 0:
            raise ConfigError("max_policy_lag must be >= 0")
        if self.eps < 0 or self.min_reward_std < 0:
            raise ConfigError("eps and min_reward_std must be >= 0")
        if self.baseline_momentum is not None and not (0 <= self.baseline_momentum < 1):
            raise ConfigError("baseline_momentum must be in [0, 1)")
        for g in self.update_if:
            parse_gate(g)
        for key in self.bucket_caps:
            fld = key.split(":", 1)[0]
            if ":" not in key or fld not in BUCKET_FIELDS:
                raise ConfigError(f"bucket_caps key {key!r}: expected FIELD:LABEL",
                                  hint=f"FIELD is one of {', '.join(BUCKET_FIELDS)}")
        for name, edges in (("length_edges", self.length_edges), ("tool_call_edges", self.tool_call_edges),
                            ("reward_std_edges", self.reward_std_edges)):
            if list(edges) != sorted(set(edges)):
                raise ConfigError(f"{name} must be strictly increasing")
        for f in self.mix_batch_fields:
            if f == "tokenizer_rev":
                raise ConfigError("mix_batch_fields: tokenizer_rev cannot mix (token ids of two tokenizers mean "
                                  "different text; the snapshot's tokenizer scope holds first)",
                                  hint="mix prompt_template_rev, env_version or verifier_version only")
            if f not in BATCH_FIELDS:
                raise ConfigError(f"mix_batch_fields: {f!r} is not a batch configuration field",
                                  hint=f"choose among {', '.join(BATCH_FIELDS)}")
        if self.batch_rows < 1:
            raise ConfigError("batch_rows must be >= 1")
        if self.reverify_top < 0 or not (0 <= self.shadow_sample <= 1):
            raise ConfigError("reverify_top must be >= 0 and shadow_sample in [0, 1]")
        if (self.reverify_top or self.shadow_sample) and ":" not in self.reverifier:
            raise ConfigError("reverify_top/shadow_sample need a reverifier (module:callable)",
                              hint="e.g. reverifier=mypkg.checks:reverify (docs/admission-rules.md, Re-verification)")
        if self.truncation not in ("score_zero", "filter", "soft_penalty"):
            raise ConfigError(f"truncation {self.truncation!r}: expected score_zero, filter or soft_penalty")
        if self.truncation == "soft_penalty" and not (0 < self.overlong_interval <= self.overlong_max_len):
            raise ConfigError(f"truncation=soft_penalty needs 0 < overlong_interval <= overlong_max_len, got "
                              f"{self.overlong_interval} and {self.overlong_max_len}",
                              hint="e.g. overlong_max_len=<the rollout's max_total_tokens> overlong_interval=16")

    @property
    def gates(self) -> tuple[Gate, ...]:
        return tuple(parse_gate(g) for g in self.update_if)

    @property
    def components(self) -> tuple[str, ...]:
        """Reward components the config reads (gates and caps), sorted."""
        return tuple(sorted({g.component for g in self.gates} | set(self.component_caps)))

    def decision_dict(self) -> dict:
        """The fields that change decisions or advantages (what config_hash covers);
        hash a config whose ``current_policy_version`` is resolved (run.admit does)."""
        from pipeline.config import config_dict

        d = config_dict(self)
        d.pop("batch_rows")
        if self.drop_zero_variance:  # the default: hashes stay those of configs written before the field existed
            d.pop("drop_zero_variance")
        if self.truncation == "score_zero":     # likewise; the interval only matters to soft_penalty
            for k in ("truncation", "overlong_max_len", "overlong_interval"):
                d.pop(k)
        elif self.truncation == "filter":
            d.pop("overlong_max_len")
            d.pop("overlong_interval")
        if not self.mix_batch_fields:  # likewise
            d.pop("mix_batch_fields")
        if not (self.reverify_top or self.shadow_sample):   # likewise: off
            for k in ("reverify_top", "shadow_sample", "reverifier"):
                d.pop(k)
        return d


def admission_config_hash(cfg: AdmissionConfig) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(cfg.decision_dict(), sort_keys=True, separators=(",", ":"),
                                     default=str).encode()).hexdigest()
