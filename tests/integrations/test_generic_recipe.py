"""The recipe for trainers without an adapter (TRL, OpenRLHF, any other; docs/how-to/land-rollouts.md) runs and
lands what it says: the block under "TRL, OpenRLHF and any other trainer", executed as written except
for the lake URI (a local lake here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _recipe() -> str:
    section = (ROOT / "docs" / "how-to" / "land-rollouts.md").read_text().split("### TRL, OpenRLHF and any other trainer", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "docs/how-to/land-rollouts.md: no python block under 'TRL, OpenRLHF and any other trainer'"
    return m.group(1)


def test_generic_recipe_lands_its_rows_and_a_retry_is_a_noop(lake):
    code = _recipe()
    assert '"s3://bucket/lake"' in code
    code = code.replace('"s3://bucket/lake"', repr(lake.uri))
    for attempt in (1, 2):
        scope: dict = {}
        exec(compile(code, "land-rollouts.md:generic-recipe", "exec"), scope)
        r = scope["report"]
        assert (r.landed, r.quarantined) == ((2, 0) if attempt == 1 else (0, 0)), r
    rows = sorted(lake.read("trajectories").to_pylist(), key=lambda r: r["trajectory_id"])
    assert [r["trajectory_id"] for r in rows] == ["grpo-qwen:3:0", "grpo-qwen:3:1"]
    assert [(r["verdict"], r["reward"], r["group_size"]) for r in rows] == [("PASS", 1.0, 2), ("FAIL", 0.0, 2)]
    assert rows[0]["response_logprobs"] == [-0.5, -1.25]

    # the group is admitted like a rollout's own (it has reward spread)
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit

    res = admit(lake, AdmissionConfig(), current_policy_version=3)
    assert res.counts == {"admit": 1} and res.admitted_members == 2, res.counts
