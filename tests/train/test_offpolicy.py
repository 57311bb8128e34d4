"""Off-policy safety beyond version counts: the importance-sampling figures of the
policy being trained against the rollout's sampling log-probs (per snapshot and
per step), the trainer's gate on them (min_ess_fraction, max_ratio_p99), and the
learning-rate scale for stale snapshots (stale_lr_scale)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.errors import ConfigError, OffPolicySnapshotError
from pipeline.train.config import TrainConfig, identity_hash
from pipeline.train.freshness import ess_fraction, offpolicy_figures
from pipeline.train.run import train_snapshot

ROOT = Path(__file__).resolve().parents[2]


def test_figures_match_numpy_on_a_hand_built_example():
    seqs = [np.array([0.1, -0.2, 0.3]), np.array([1.5]), np.array([-0.5, -0.5, 0.0, 2.0]), np.array([25.0, 0.0])]
    got = offpolicy_figures(seqs, bound=2.0)
    tok = np.concatenate(seqs)
    r = np.exp(np.clip(tok, -20, 20))                       # the loss's clamp: e^25 counts as e^20
    assert got["ess_token_frac"] == pytest.approx(r.sum() ** 2 / (r.size * (r ** 2).sum()), rel=1e-12)
    w = np.exp(np.array([s.sum() for s in seqs]))           # sequence weight: product of its token ratios
    assert got["ess_seq_frac"] == pytest.approx(w.sum() ** 2 / (w.size * (w ** 2).sum()), rel=1e-12)
    for q in (50, 90, 99):
        assert got[f"behav_ratio_p{q}"] == pytest.approx(np.percentile(r, q), rel=1e-12)
    assert got["behav_ratio_max"] == pytest.approx(np.exp(20.0))
    assert got["behav_ratio_above"] == pytest.approx((r > 2.0).mean())   # e^0.3, e^1.5, e^2, e^20 ... over 10
    # on-policy: every ratio 1, ESS/n exactly 1; one dominant weight: ESS/n -> 1/n
    on = offpolicy_figures([np.zeros(5), np.zeros(3)], bound=2.0)
    assert on["ess_token_frac"] == on["ess_seq_frac"] == 1.0 and on["behav_ratio_max"] == 1.0
    assert ess_fraction(np.array([0.0, -800.0, -900.0, -1000.0])) == pytest.approx(0.25)   # no overflow/underflow
    assert ess_fraction(np.array([800.0, 0.0])) == pytest.approx(0.5)


def test_gate_keys_validate_and_stay_out_of_the_run_identity():
    assert identity_hash(TrainConfig()) == identity_hash(TrainConfig(min_ess_fraction=0.5, max_ratio_p99=3.0))
    assert identity_hash(TrainConfig()) == identity_hash(TrainConfig(ratio_tail_bound=5.0))
    assert identity_hash(TrainConfig()) != identity_hash(TrainConfig(stale_lr_scale=0.5))   # it changes the weights
    for bad in ({"min_ess_fraction": 0.0}, {"min_ess_fraction": 1.5}, {"max_ratio_p99": 1.0}, {"stale_lr_scale": 0.0},
                {"stale_lr_scale": 2.0}):
        with pytest.raises(ConfigError):
            TrainConfig(**bad)


def _behaviour_snapshot(lake, hf_dir: Path, *, seed: int = 41) -> str:
    """A snapshot whose sampling log-probs are exactly those of the policy in
    ``hf_dir`` (transformers, fp32): on-policy data for that policy."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.testing.train_fixtures import publish_payload_snapshot, synthetic_payload

    payload = synthetic_payload(16, seed=seed, median_len=18, prompt_len=6)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    logps = []
    with torch.no_grad():
        for p, r, m in zip(payload.column("prompt_ids").to_pylist(), payload.column("response_ids").to_pylist(),
                           payload.column("loss_mask").to_pylist()):
            ids = torch.tensor([p + r])
            lp = torch.log_softmax(model(ids).logits[0].double(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0]
            logps.append([x if keep else 0.0 for x, keep in zip(lp[len(p) - 1:].float().tolist(), m)])  # 0 off the mask
    i = payload.schema.get_field_index("response_logprobs")
    payload = payload.set_column(i, "response_logprobs", pa.array(logps, type=payload.schema.field(i).type))
    return publish_payload_snapshot(lake, payload)


GATES = dict(max_steps=2, micro_batch_tokens=256, grad_accum=2, lr=1e-3, min_ess_fraction=0.5, max_ratio_p99=1.5)


def test_a_far_policy_is_refused_and_the_behaviour_policy_trains(tlake):
    from pipeline.policy_store import resolve_policy
    from pipeline.testing.train_fixtures import publish_tiny_policy

    lake, _ = tlake
    sid = _behaviour_snapshot(lake, resolve_policy(lake, "tiny-v0").hf_dir)     # sampled by v0, exactly
    publish_tiny_policy(lake, checkpoint_id="tiny-far", seed=3, initializer_range=0.5, parent="tiny-v0")   # v1: peaked, far from v0
    with pytest.raises(OffPolicySnapshotError, match=r"too far off-policy for v1 \(tiny-far\): sequence-level ESS/n "
                                                     r"\S+ < min_ess_fraction=0.5; token ratio p99 \S+ > max_ratio_p99"):
        train_snapshot(lake, sid, TrainConfig(**GATES), progress=False)            # the newest policy: tiny-far
    assert not lake.exists("metrics")                                              # nothing trained, nothing published
    from pipeline.policy_store import local_checkpoint_dir

    runs = local_checkpoint_dir(lake, "_runs")
    assert not runs.exists() or not any(runs.iterdir())                            # and no work directory left
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--lake", lake.uri, "--batch-snapshot", sid,
                           "--set", "max_steps=1", "--set", "min_ess_fraction=0.5"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr                  # the stale snapshot's exit code
    msg = [ln for ln in proc.stderr.splitlines() if "too far off-policy" in ln]
    assert len(msg) == 1 and "min_ess_fraction=0.5" in msg[0], proc.stderr[-2000:]

    # the same snapshot from the policy that sampled it passes the same gate
    res = train_snapshot(lake, sid, TrainConfig(**GATES), from_checkpoint="tiny-v0", progress=False)
    assert res.metrics["snapshot_ess_seq_frac"] > 0.999 and res.metrics["snapshot_behav_ratio_p99"] < 1.001
    assert res.metrics["lr_scale"] == 1.0
    ck = next(r for r in lake.read("checkpoints").to_pylist() if r["checkpoint_id"] == res.checkpoint_id)
    assert json.loads(ck["metrics_json"])["snapshot_ess_token_frac"] > 0.999
    # the per-step rows land in the metrics table, queryable with SQL
    from pipeline.query.duck import query

    rows = query(lake, "SELECT global_step, ess_token_frac, ess_seq_frac, behav_ratio_p50, behav_ratio_p90, "
                       "behav_ratio_p99, behav_ratio_max, behav_ratio_above FROM metrics ORDER BY global_step"
                 ).to_pylist()
    assert [r["global_step"] for r in rows] == [0, 1]
    first, second = rows
    assert first["ess_seq_frac"] > 0.999 and first["behav_ratio_max"] < 1.001   # step 0: the behaviour weights
    assert second["ess_seq_frac"] < first["ess_seq_frac"]                         # step 1: one update away
    for r in rows:
        assert 0 < r["ess_seq_frac"] <= 1 and 0 < r["ess_token_frac"] <= 1 and 0 <= r["behav_ratio_above"] <= 1
        assert r["behav_ratio_p50"] <= r["behav_ratio_p90"] <= r["behav_ratio_p99"] <= r["behav_ratio_max"]


def test_stale_lr_scale_scales_the_learning_rate_per_version_of_lag(tlake):
    from pipeline.testing.train_fixtures import publish_tiny_policy

    lake, sid = tlake                       # the snapshot: sampled by version 0
    publish_tiny_policy(lake, checkpoint_id="tiny-v1", seed=1, parent="tiny-v0")
    publish_tiny_policy(lake, checkpoint_id="tiny-v2", seed=2, parent="tiny-v1")   # lag 2 from the newest policy
    res = train_snapshot(lake, sid, TrainConfig(max_steps=2, micro_batch_tokens=256, lr=1e-3, stale_lr_scale=0.5),
                         progress=False)
    assert res.metrics["train_lag_max"] == 2 and res.metrics["lr_scale"] == 0.25
    lrs = [r["lr"] for r in lake.read("metrics").to_pylist()]
    assert lrs == pytest.approx([2.5e-4, 2.5e-4])


def test_follow_skips_an_off_policy_snapshot_with_its_reason_recorded(tlake):
    from pipeline.policy_store import resolve_policy
    from pipeline.train.follow import follow, pending_snapshots

    lake, far = tlake         # the template snapshot: made-up sampling log-probs (~ -Exp(1)), far from v0's (~ -5.5)
    fresh = _behaviour_snapshot(lake, resolve_policy(lake, "tiny-v0").hf_dir)
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=256, max_steps=1, min_ess_fraction=0.5)
    res = follow(lake, cfg, stop_after=1, progress=False)
    assert [s["snapshot_id"] for s in res.skipped] == [far] and res.skipped[0]["reason"] == "off_policy"
    assert "min_ess_fraction=0.5" in res.skipped[0]["message"]
    assert [v["snapshot_id"] for v in res.versions] == [fresh]
    row = [r for r in lake.read("checkpoints").to_pylist() if r["checkpoint_id"] == res.head_checkpoint_id][0]
    skipped = json.loads(row["train_config_json"])["skipped_snapshots"]
    assert [s["snapshot_id"] for s in skipped] == [far] and skipped[0]["reason"] == "off_policy"
    assert pending_snapshots(lake) == [far]           # never consumed; the line's lineage says why


def test_gated_lag_scaled_stratified_training_stays_byte_reproducible(tlake, tlake2):
    from pipeline.testing.train_fixtures import publish_tiny_policy

    # ESS/n >= 1/n always: 0.01 passes for 48 members, so the gate runs and lets it through
    cfg = TrainConfig(lr=3e-3, micro_batch_tokens=256, grad_accum=3, epochs=2, seed=9, max_steps=4,
                      stale_lr_scale=0.5, min_ess_fraction=0.01)
    out = []
    for lake, sid in (tlake, tlake2):
        publish_tiny_policy(lake, checkpoint_id="tiny-v1", seed=1, parent="tiny-v0")   # lag 1: LR x 0.5
        res = train_snapshot(lake, sid, cfg, progress=False)
        ck = next(r for r in lake.read("checkpoints").to_pylist() if r["checkpoint_id"] == res.checkpoint_id)
        rows = sorted(lake.read("metrics").to_pylist(), key=lambda r: r["global_step"])
        out.append((res.checkpoint_id, dict(ck["file_sha256"])["hf/model.safetensors"],
                    [(r["lr"], r["ess_seq_frac"], r["behav_ratio_p99"]) for r in rows]))
        assert res.metrics["lr_scale"] == 0.5 and all(r["lr"] == pytest.approx(1.5e-3) for r in rows)
    assert out[0] == out[1]
    # the order is part of the run: another order names another checkpoint
    assert identity_hash(cfg) != identity_hash(TrainConfig(**{**cfg.__dict__, "step_order": "length"}))
