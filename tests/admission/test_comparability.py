"""Comparability across the batch (issue 19, item 3): the wider per-group key
(top_p, task_version, harness_version, tool_schema_version, prompt identity)
and one configuration per snapshot, with the explicit opt-in to mix."""

from __future__ import annotations

import pyarrow as pa
import pytest

from admission_rows import NOW, land, traj
from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit
from pipeline.errors import ConfigError
from pipeline.lake.delta import Lake
from pipeline.lake.ingest import prompt_hashes
from pipeline.sim.gate import ACCEPTED, Decision, GateRules, batch_config, decide_group


def _group(gid: str, **kw) -> list[dict]:
    return [traj(f"{gid}-{k}", gid, reward=float(k % 2), **kw) for k in range(4)]


def _receipts(lake: Lake) -> dict[str, dict]:
    return {r["group_id"]: r for r in lake.read("receipts").to_pylist()}


def test_prompt_hash_is_the_prompt_identity():
    h = prompt_hashes(pa.array([[1, 2], [1, 2], [2, 1], [], None], pa.list_(pa.int32()))).to_pylist()
    assert h[0] == h[1] and h[0] != h[2] and h[3] == h[4] and len(h[0]) == 32
    import hashlib
    import struct

    assert h[0] == hashlib.sha256(struct.pack("<2i", 1, 2)).hexdigest()[:32]


@pytest.mark.parametrize("field,value,reason", [
    ("top_p", 0.9, "top_p_mismatch"),
    ("task_version", "v2", "task_version_mismatch"),
    ("harness_version", "h-2", "harness_mismatch"),
    ("tool_schema_version", "calc/2", "tool_schema_mismatch"),
    ("prompt_ids", [9, 9, 9], "prompt_mismatch"),
    ("env_state_hash", "b" * 64, "env_state_mismatch"),
])
def test_member_differing_in_a_new_key_field_is_excluded(tmp_path, field, value, reason):
    lake = Lake(tmp_path)
    rows = [traj(f"g-{k}", "g", reward=float(k % 2), tool_schema_version="calc/1") for k in range(4)]
    rows[3][field] = value
    land(lake, rows)
    admit(lake, AdmissionConfig(quality=False), now=NOW)
    r = _receipts(lake)["g"]
    assert dict(r["excluded_members"]) == {"g-3": reason}
    assert r["ref_tool_schema_version"] == "calc/1" and r["ref_top_p"] == 1.0 and r["ref_task_version"] == "v1"
    assert r["ref_prompt_hash"] == prompt_hashes(pa.array([[1, 2]], pa.list_(pa.int32())))[0].as_py()


def test_group_from_two_database_states_is_refused(tmp_path):
    """Issue 41: members of a stateful environment's group that started from two
    different snapshots are not comparable: only one state's members can be kept
    (the others excluded, env_state_mismatch), and two of four left is below a
    group minimum of three: the group is refused."""
    lake = Lake(tmp_path)
    rows = [traj(f"g-{k}", "g", reward=float(k % 2)) | {"env_state_hash": ("a" if k < 2 else "b") * 64}
            for k in range(4)]
    same = [traj(f"h-{k}", "h", reward=float(k % 2)) | {"env_state_hash": "a" * 64} for k in range(4)]
    land(lake, rows + same)
    admit(lake, AdmissionConfig(quality=False, min_valid_members=3), now=NOW)
    rec = _receipts(lake)
    assert sorted(dict(rec["g"]["excluded_members"]).values()) == ["env_state_mismatch"] * 2
    assert rec["g"]["decision"] != "admit" and rec["g"]["snapshot_id"] is None
    assert rec["h"]["decision"] == "admit" and rec["h"]["ref_env_state_hash"] == "a" * 64


def test_unrecorded_tool_schema_equals_unrecorded(tmp_path):
    lake = Lake(tmp_path)
    land(lake, _group("g"))
    admit(lake, AdmissionConfig(quality=False), now=NOW)
    r = _receipts(lake)["g"]
    assert r["decision"] == "admit" and r["ref_tool_schema_version"] == ""


def test_mixed_verifier_batch_is_refused(tmp_path):
    lake = Lake(tmp_path)
    land(lake, _group("a") + _group("b") + _group("c", verifier_version="ver-2"))
    res = admit(lake, AdmissionConfig(quality=False), now=NOW)
    rec = _receipts(lake)
    assert rec["a"]["decision"] == rec["b"]["decision"] == "admit"
    assert rec["c"]["decision"] == "batch_config_mismatch" and rec["c"]["snapshot_id"] is None
    assert dict(rec["c"]["checks"])["batch_config"] == "fail:verifier_version ver-2 != ver-1"
    assert dict(rec["a"]["checks"])["batch_config"] == "pass"
    members = lake.read("snapshot_members").column("group_id").to_pylist()
    assert set(members) == {"a", "b"} and res.counts == {"admit": 2, "batch_config_mismatch": 1}


def test_mixing_is_an_explicit_opt_in(tmp_path):
    lake = Lake(tmp_path)
    land(lake, _group("a") + _group("c", verifier_version="ver-2"))
    cfg = AdmissionConfig(quality=False, mix_batch_fields=("verifier_version",))
    res = admit(lake, cfg, now=NOW)
    rec = _receipts(lake)
    assert rec["a"]["decision"] == rec["c"]["decision"] == "admit" and res.counts == {"admit": 2}
    # the other fields still hold: an environment change is refused even with verifiers mixing
    lake2 = Lake(tmp_path / "2")
    land(lake2, _group("a") + _group("a2") + _group("c", env_version="env-2", verifier_version="ver-2"))
    admit(lake2, cfg, now=NOW)
    assert _receipts(lake2)["c"]["decision"] == "batch_config_mismatch"
    # the opt-in changes the config hash; the default keeps the hash of configs written before it existed
    from pipeline.admission.config import admission_config_hash

    assert admission_config_hash(cfg) != admission_config_hash(AdmissionConfig(quality=False))
    assert "mix_batch_fields" not in AdmissionConfig().decision_dict()
    with pytest.raises(ConfigError):
        AdmissionConfig(mix_batch_fields=("temperature",))
    with pytest.raises(ConfigError):  # token ids of two tokenizers never share a step
        AdmissionConfig(mix_batch_fields=("tokenizer_rev",))


def test_sim_gate_follows_the_wider_key_and_the_batch_rule():
    base = ("tok", "tmpl", "env", "ver", 1.0, 1.0, "v1", "h", "", "p")
    odd = base[:9] + ("q",)
    d = decide_group([3] * 4, [ACCEPTED] * 4, [1.0, 0.0, 1.0, 0.0], [0] * 4, 3, GateRules(),
                     configs=[base, base, base, odd])
    assert d.reasons == ("", "", "", "prompt_mismatch") and d.decision == "admit"
    ok = Decision("admit", ("",) * 2)
    cfgs = [dict(tokenizer_rev="t", prompt_template_rev="p", env_version="e", verifier_version=v)
            for v in ("v1", "v1", "v2")]
    out = batch_config([ok, ok, ok], cfgs)
    assert [o.decision for o in out] == ["admit", "admit", "batch_config_mismatch"]
    assert [o.decision for o in batch_config([ok, ok, ok], cfgs, mix_fields=("verifier_version",))] == ["admit"] * 3
