"""The admission rules' single definitions (docs/admission-rules.md): reason
names and their order, the comparability key, the tie-breaks, the
freshness and spread tests, one member or group at a time in plain Python.

Everything that decides like admission reads these: the engines' shared core
(decide.py, checks.py, candidates.py), the Dask engine's column order and
reasons, the simulator's gate (pipeline/sim/gate.py, which calls the
functions below per group) and the synthetic report lake
(pipeline/testing/health_lake.py, which runs the real engine). The DuckDB SQL
(sql/admission_*.sql) spells the same order out in SQL; a test checks it
against ``COMPARABILITY`` and the reasons here. reference.py is the test
oracle and stays an independent copy on purpose.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Sequence

# -- 1. member exclusions (failures never count as policy failures) ----------------------------
INFRA_FAILED, EXPIRED = "INFRA_FAILED", "EXPIRED"          # trajectories.status values
NO_REWARD_VERDICTS = ("UNKNOWN", "ENV_ERROR")              # verdicts without a valid evaluation
STATUS_REASONS = ((INFRA_FAILED, "infra_failed"), (EXPIRED, "expired"))   # tried in this order
NO_REWARD = "no_reward"
OUT_OF_VOCABULARY = "out_of_vocabulary"                    # a token id >= the policy's vocab_size
TRUNCATED = "truncated"                                    # truncation=filter only (truncation.py)
QUALITY_PREFIX = "quality:"
EXCLUSION_REASONS = tuple(r for _, r in STATUS_REASONS) + (NO_REWARD, OUT_OF_VOCABULARY, TRUNCATED)

# -- 2. comparability: the reference configuration's fields, each with its mismatch reason -----
COMPARABILITY = (
    ("policy_version", "policy_mismatch"), ("tokenizer_rev", "tokenizer_mismatch"),
    ("prompt_template_rev", "template_mismatch"), ("env_version", "env_mismatch"),
    ("verifier_version", "verifier_mismatch"), ("temperature", "temperature_mismatch"),
    ("top_p", "top_p_mismatch"), ("task_version", "task_version_mismatch"),
    ("harness_version", "harness_mismatch"), ("tool_schema_version", "tool_schema_mismatch"),
    ("prompt_hash", "prompt_mismatch"), ("env_state_hash", "env_state_mismatch"),
)
REF_FIELDS = tuple(f for f, _ in COMPARABILITY)
MISMATCH_REASONS = tuple(r for _, r in COMPARABILITY)
# comparability fields that may be null (unrecorded, or rows landed before the
# column existed): compared as "" so that unrecorded equals unrecorded
NULLABLE_KEYS = ("tool_schema_version", "prompt_hash", "env_state_hash")

# -- 3. freshness ------------------------------------------------------------------------------
STALE_POLICY, STALE_WAIT = "stale_policy", "stale_wait"
FRESHNESS_REASONS = (STALE_POLICY, STALE_WAIT)

# -- per snapshot: the configuration one snapshot holds ---------------------------------------
BATCH_FIELDS = ("tokenizer_rev", "prompt_template_rev", "env_version", "verifier_version")


def member_exclusion(status: str, verdict: str | None, reward: float | None, *,
                     max_token_id: int | None = None, vocab_size: int | None = None) -> str | None:
    """Step 1 for one member (quality and truncation aside): the reason, or None."""
    for value, reason in STATUS_REASONS:
        if status == value:
            return reason
    if verdict in NO_REWARD_VERDICTS or reward is None or (isinstance(reward, float) and math.isnan(reward)):
        return NO_REWARD
    if vocab_size is not None and max_token_id is not None and max_token_id >= vocab_size:
        return OUT_OF_VOCABULARY
    return None


def reference_config(keys: Iterable[tuple]) -> tuple | None:
    """Step 2: the most common key (COMPARABILITY order, policy_version first);
    ties to the higher policy_version, then to the lexicographically smaller rest."""
    counts = Counter(keys)
    if not counts:
        return None
    return sorted(counts.items(), key=lambda kv: (-kv[1], -kv[0][0], kv[0][1:]))[0][0]


def first_mismatch(key: Sequence, ref: Sequence) -> str | None:
    """Step 2: the mismatch reason of the first field where ``key`` differs from ``ref``."""
    for (_, reason), a, b in zip(COMPARABILITY, key, ref):
        if a != b:
            return reason
    return None


def freshness(policy_lag: int, queue_wait_ms: float | None, *, max_policy_lag: int,
              max_queue_wait_ms: float | None) -> str | None:
    """Step 3: stale_policy, then stale_wait (when a wait limit is set), else None."""
    if policy_lag > max_policy_lag:
        return STALE_POLICY
    if max_queue_wait_ms is not None and queue_wait_ms is not None and queue_wait_ms > max_queue_wait_ms:
        return STALE_WAIT
    return None


def has_spread(rewards: Sequence[float], min_reward_std: float) -> bool:
    """The reward_spread check: exactly max > min first (variance functions return
    1e-9..1e-8 for equal rewards), then the population std reaches ``min_reward_std``."""
    if not rewards or not max(rewards) > min(rewards):
        return False
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) >= min_reward_std


def snapshot_config(keys: Iterable[tuple]) -> tuple | None:
    """Per snapshot: the most common BATCH_FIELDS tuple among the admitted groups
    (ties: the lexicographically smaller)."""
    counts = Counter(keys)
    if not counts:
        return None
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
