"""Truncation policy: how admission scores a response cut by a length limit.

A truncated trajectory lands as the environment recorded it (REJECTED / FAIL /
``max_length`` / reward 0.0): that is a fact of the rollout and stays in the
lake. What its reward *means for the update* is a training decision, so it
is chosen here, per admission run, and recorded in the admission config hash
(hence in the snapshot id). Admission is the right stage: it is where group
baselines are formed, both engines share the candidate extraction below, and
a different policy needs no new rollouts (the same trajectories can be
re-admitted under another policy for an ablation).

- ``score_zero`` (default; what the harness recorded): a truncated member
  keeps reward 0 and counts in its group's baseline. Known length bias: long
  correct-looking reasoning cut at the limit is scored as a wrong answer.
- ``filter``: truncated members (``stop_reason = max_length``) are excluded
  with reason ``truncated``: never in a baseline, never trained on (DAPO's
  overlong filtering).
- ``soft_penalty``: DAPO's soft overlong punishment added to every valid
  member's reward, by response length L (response tokens, observations
  included: the length the harness limit counts), with L_max =
  ``overlong_max_len`` and the interval L_cache = ``overlong_interval``::

      0                              L <= L_max - L_cache
      ((L_max - L_cache) - L) / L_cache   L_max - L_cache < L <= L_max
      -1                             L > L_max

  (Yu et al. 2025, DAPO, eq. 13). Set ``overlong_max_len`` to the rollout's
  ``max_total_tokens``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from pipeline.admission.config import AdmissionConfig

POLICIES = ("score_zero", "filter", "soft_penalty")
TRUNCATED = "max_length"        # the harness's stop_reason for a length limit
REASON = "truncated"


def overlong_penalty(length: np.ndarray, max_len: int, interval: int) -> np.ndarray:
    """DAPO's soft overlong penalty per response length (float64 [N], in [-1, 0])."""
    length = np.asarray(length, np.float64)
    start = max_len - interval
    return np.where(length <= start, 0.0, np.where(length <= max_len, (start - length) / interval, -1.0))


def shaped_reward(reward: pa.ChunkedArray | pa.Array, response_len: pa.ChunkedArray | pa.Array, cfg: AdmissionConfig) -> pa.Array:
    """The reward admission uses under ``cfg.truncation`` (null stays null)."""
    if cfg.truncation != "soft_penalty" or len(reward) == 0:
        return reward
    pen = overlong_penalty(np.asarray(pc.fill_null(response_len, 0).to_numpy(zero_copy_only=False)),
                           cfg.overlong_max_len, cfg.overlong_interval)
    return pc.add(reward, pa.array(pen, pa.float64()))


def truncated_rejects(cands: pa.Table, cfg: AdmissionConfig) -> pa.Table:
    """(trajectory_id, reason) of the members ``filter`` excludes; empty otherwise."""
    empty = pa.table({"trajectory_id": pa.array([], pa.string()), "reason": pa.array([], pa.string())})
    if cfg.truncation != "filter" or cands.num_rows == 0:
        return empty
    hit = cands.filter(pc.fill_null(pc.equal(cands.column("stop_reason"), TRUNCATED), False))
    ids = sorted(hit.column("trajectory_id").to_pylist())
    return pa.table({"trajectory_id": pa.array(ids, pa.string()), "reason": pa.array([REASON] * len(ids), pa.string())})
