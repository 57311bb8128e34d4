"""The freshness bias of straggler handling (docs/concepts/loop.md, **Carried stragglers**):
``straggler_policy=cancel`` (one round) against ``carry`` (continuous, 4 rounds, a newer policy
published 1 s in), both over-provisioned (r = 0.5) with heavy-tailed tool latency. Prints, per
arm (carry per round), the members admission excludes by response-length bucket and the group
rejections by the receipts' ``length_bucket`` (admission dry runs: nothing is written).

    PYTHONPATH=. python scripts/straggler_bias.py [--out /tmp/straggler-bias]

The policy is the rollout tests' weak warm-started one (tests/rollout/conftest.py)."""

from __future__ import annotations

import argparse
import shutil
import threading
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.dataset as ds

from pipeline.admission.config import AdmissionConfig
from pipeline.admission.run import admit
from pipeline.lake.delta import Lake
from pipeline.policy_store import local_checkpoint_dir, publish_checkpoint
from pipeline.rollout.policy import init_policy
from pipeline.rollout.run import RolloutConfig, run_rollout

EDGES = (6, 12)
BUCKETS = ("<6", "6-12", ">=12")
COMMON = dict(env="arithmetic-tool", groups=48, group_size=4, seed=11, group_redundancy=0.5, groups_per_wave=72,
              tool_latency_ms=300.0, tool_latency_sigma=1.0, slow_tool_p=0.05, spool_fsync=False)


def publish(lake: Lake, policy: Path, version: int) -> None:
    cid = f"bias-v{version}"
    shutil.copytree(policy, local_checkpoint_dir(lake, cid) / "hf")
    publish_checkpoint(lake, checkpoint_id=cid, policy_version=version, parent_checkpoint_id=None, snapshot_ids=[],
                       train_config={"kind": "straggler-bias"}, train_config_hash="bias", seed=0)


def bucket(n: int) -> str:
    return BUCKETS[0] if n < EDGES[0] else BUCKETS[1] if n < EDGES[1] else BUCKETS[2]


def report(name: str, lake: Lake, run_id: str, current: int, groups: range | None = None) -> None:
    rows = {r["trajectory_id"]: r for r in lake.read("trajectories", filter=ds.field("run_id") == run_id).to_pylist()
            if groups is None or int(r["group_id"].rsplit("-g", 1)[1]) in groups}
    gids = {r["group_id"] for r in rows.values()}
    span = sum(1 for r in rows.values() if len({v for v in r["token_policy_versions"] if v >= 0}) > 1)
    members = Counter(bucket(len(r["response_ids"])) for r in rows.values())
    res = admit(lake, AdmissionConfig(length_edges=EDGES), current_policy_version=current, dry_run=True,
                command="straggler-bias")
    excluded: dict[str, Counter] = defaultdict(Counter)
    for m in res.receipts.column("excluded_members").to_pylist():
        for eid, why in m or []:
            if eid in rows:
                excluded[why][bucket(len(rows[eid]["response_ids"]))] += 1
    decided, rejected = Counter(), Counter()
    for rc in res.receipts.to_pylist():
        if rc["group_id"] in gids:
            decided[rc["length_bucket"]] += 1
            rejected[rc["length_bucket"]] += rc["decision"] != "admit"
    print(f"== {name}: {len(rows)} rows, {span} spanning two policy versions; members by length "
          + ", ".join(f"{b} {members[b]}" for b in BUCKETS))
    for why, c in sorted(excluded.items()):
        print(f"   excluded {why}: " + ", ".join(f"{b} {c[b]} of {members[b]}" for b in BUCKETS))
    print("   groups rejected by length_bucket: "
          + ", ".join(f"{b} {rejected[b]} of {decided[b]}" for b in sorted(decided, key=str)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/straggler-bias", help="scratch folder (replaced)")
    out = Path(ap.parse_args().out)
    shutil.rmtree(out, ignore_errors=True)
    policy = Path(init_policy(Lake(out / "policy"), warm_start_steps=120, demonstrations=1500,
                              tool_fraction=0.5).hf_dir)

    lake = Lake(out / "cancel")
    publish(lake, policy, 0)
    s = run_rollout(lake, RolloutConfig(policy="latest", run_id="cancel", **COMMON))
    print(f"cancel: rolling out {s.rollout_seconds:.1f}s, {s.groups_complete} groups complete, "
          f"{s.cancelled} cancelled")
    report("cancel, one round", lake, "cancel", 0)

    lake = Lake(out / "carry")
    publish(lake, policy, 0)
    trainer = threading.Timer(1.0, publish, (lake, policy, 1))     # a newer policy while round 1 runs
    trainer.start()
    s = run_rollout(lake, RolloutConfig(policy="latest", follow_latest=True, follow=True, rounds=4,
                                        straggler_policy="carry", run_id="carry", **COMMON))
    trainer.join()
    print(f"carry: rolling out {s.rollout_seconds:.1f}s, {s.rounds} rounds, {s.carried} carried, {s.cancelled} "
          f"cancelled, policy versions {s.policy_versions}")
    n = 72      # groups launched per round
    report("carry, round 1", lake, "carry", 1, range(0, n))
    report("carry, rounds 2-3", lake, "carry", 1, range(n, 3 * n))
    report("carry, round 4 (the last: its stragglers are cancelled)", lake, "carry", 1, range(3 * n, 4 * n))


if __name__ == "__main__":
    main()
