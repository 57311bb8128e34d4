"""Lineage: OpenLineage run events for training runs, and the walk
checkpoint -> snapshots -> trajectories -> versions.

Events go through openlineage-python. Transport: the client's own
configuration when the user gave one (``OPENLINEAGE_URL``,
``OPENLINEAGE_CONFIG`` or ``OPENLINEAGE__TRANSPORT__*``), otherwise a file
transport appending one JSON event per line to ``<lake>/lineage/openlineage.jsonl``
(``PIPELINE_LINEAGE_FILE`` overrides the path). A training run emits START and
then COMPLETE or FAIL with the same run id; the snapshot is an input dataset
(its id is its version), the parent policy another input, the checkpoint the
output (its policy version is the dataset version).
"""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


from pipeline import __version__

PRODUCER = f"https://github.com/trajectory-lakehouse/pipeline/tree/{__version__}"
NAMESPACE_JOB = "trajectory-lakehouse"
DEFAULT_FILE = "lineage/openlineage.jsonl"


def new_run_id() -> str:
    return str(uuid.uuid4())


def lineage_file(lake) -> Path:
    override = os.environ.get("PIPELINE_LINEAGE_FILE")
    if override:
        return Path(override)
    if lake.is_local:
        return Path(lake.uri) / DEFAULT_FILE
    from pipeline.policy_store import local_checkpoint_dir

    return local_checkpoint_dir(lake, "_lineage").parent / DEFAULT_FILE   # per-lake cache dir


def _user_configured() -> bool:
    return any(k in os.environ for k in ("OPENLINEAGE_URL", "OPENLINEAGE_CONFIG")) or any(
        k.startswith("OPENLINEAGE__TRANSPORT") for k in os.environ)


def client(lake):
    """An OpenLineageClient: the user's configured transport, else the lake's file."""
    from openlineage.client import OpenLineageClient

    if _user_configured():
        return OpenLineageClient()
    from openlineage.client.transport.file import FileConfig, FileTransport

    path = lineage_file(lake)
    path.parent.mkdir(parents=True, exist_ok=True)
    return OpenLineageClient(transport=FileTransport(FileConfig(log_file_path=str(path), append=True)))


def namespace(lake) -> str:
    return lake.uri if "://" in lake.uri else f"file://{lake.uri}"


def emit_run_event(lake, *, event_type: str, run_id: str, job_name: str,
                   inputs: list[tuple[str, str | None]], outputs: list[tuple[str, str | None]],
                   run_facets: dict[str, Any] | None = None, error: str | None = None) -> dict[str, Any]:
    """Emit one RunEvent. ``inputs``/``outputs`` are (dataset name, version or
    None) under the lake's namespace. Returns the event as a dict."""
    from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
    from openlineage.client.facet_v2 import dataset_version_dataset, error_message_run
    from openlineage.client.serde import Serde

    ns = namespace(lake)

    def dsfacets(version: str | None) -> dict[str, Any]:
        if version is None:
            return {}
        return {"version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=str(version))}

    facets: dict[str, Any] = dict(run_facets or {})
    if error:
        facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(message=error, programmingLanguage="python")
    event = RunEvent(
        eventType=getattr(RunState, event_type),
        eventTime=datetime.now(timezone.utc).isoformat(),
        run=Run(runId=run_id, facets=facets),
        job=Job(namespace=NAMESPACE_JOB, name=job_name),
        producer=PRODUCER,
        inputs=[InputDataset(namespace=ns, name=n, facets=dsfacets(v)) for n, v in inputs],
        outputs=[OutputDataset(namespace=ns, name=n, facets=dsfacets(v)) for n, v in outputs],
    )
    client(lake).emit(event)
    return json.loads(Serde.to_json(event))


def read_events(lake, run_id: str | None = None) -> list[dict[str, Any]]:
    """Events of the default file transport (optionally one run's)."""
    path = lineage_file(lake)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            ev = json.loads(line)
            if run_id is None or ev.get("run", {}).get("runId") == run_id:
                out.append(ev)
    return out


# -- the walk -------------------------------------------------------------------


def _version_summary(rows: list[dict[str, Any]], cols: list[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for c in cols:
        counts: dict[str, int] = {}
        for r in rows:
            k = str(r.get(c))
            counts[k] = counts.get(k, 0) + 1
        out[c] = dict(sorted(counts.items()))
    return out


VERSION_COLUMNS = ["policy_version", "tokenizer_rev", "prompt_template_rev", "harness_version", "env_version",
                   "verifier_version", "task_version"]


def _read_where(lake, name: str, columns: list[str] | None, column: str, values: list, *, version=None):
    """Rows whose ``column`` is in ``values``, filter pushed down to the files.
    (The lake writes min/max stats for every scalar column: without them
    deltalake's dataset prunes every file from a string filter.)"""
    import pyarrow.dataset as ds

    return lake.read(name, columns=columns, version=version, filter=ds.field(column).isin(list(values)))


def walk(lake, checkpoint_id: str, *, with_trajectories: bool = True, max_ancestors: int = 100) -> dict[str, Any]:
    """checkpoint -> parent chain; -> snapshots (row + manifest) -> member
    trajectories -> the versions they were produced with (counts)."""
    from pipeline.admission.snapshot import open_snapshot, read_snapshot_table
    from pipeline.errors import NotFoundError

    if not lake.exists("checkpoints"):
        raise NotFoundError(f"lake {lake.uri} has no checkpoints table", hint="train or init a policy first")
    ck = lake.read("checkpoints").to_pylist()
    by_id = {r["checkpoint_id"]: r for r in ck}
    if checkpoint_id not in by_id:
        # also accept a policy version number
        if checkpoint_id.isdigit():
            match = [r for r in ck if r["policy_version"] == int(checkpoint_id)]
            if match:
                checkpoint_id = max(match, key=lambda r: r["created_at"])["checkpoint_id"]
        if checkpoint_id not in by_id:
            raise NotFoundError(f"checkpoint {checkpoint_id} not found", hint="pipeline sql \"SELECT checkpoint_id, "
                                "policy_version FROM checkpoints\" lists them")
    row = by_id[checkpoint_id]
    chain = []
    cur = row
    while cur is not None and len(chain) < max_ancestors:
        chain.append({"checkpoint_id": cur["checkpoint_id"], "policy_version": cur["policy_version"],
                      "snapshot_ids": list(cur["snapshot_ids"] or []), "created_at": str(cur["created_at"])})
        cur = by_id.get(cur["parent_checkpoint_id"]) if cur["parent_checkpoint_id"] else None
    snaps = []
    snap_rows = {}
    if lake.exists("snapshots") and row["snapshot_ids"]:
        t = _read_where(lake, "snapshots", None, "snapshot_id", list(row["snapshot_ids"]))
        snap_rows = {r["snapshot_id"]: r for r in t.to_pylist()}
    for sid in row["snapshot_ids"] or []:
        info: dict[str, Any] = {"snapshot_id": sid}
        sr = snap_rows.get(sid)
        if sr:
            info.update({k: sr[k] for k in ("admission_run_id", "advantage_estimator", "current_policy_version",
                                           "num_groups", "num_members", "num_tokens", "config_hash")})
            info["source_versions"] = dict(sr["source_versions"] or [])
        try:
            snap = open_snapshot(lake, sid)
            members = read_snapshot_table(lake, snap, verify=False,
                                          columns=["trajectory_id", "group_id", "policy_version", "task_id"])
            info["members"] = members.num_rows
            info["groups"] = len(set(members.column("group_id").to_pylist()))
            tids = members.column("trajectory_id").to_pylist()
            info["trajectory_ids_sample"] = tids[:5]
            versions = _version_summary(members.to_pylist(), ["policy_version"])
            if with_trajectories and lake.exists("trajectories"):
                traj_version = (info.get("source_versions") or {}).get("trajectories")
                cols = ["trajectory_id"] + VERSION_COLUMNS
                tt = _read_where(lake, "trajectories", cols, "trajectory_id", tids, version=traj_version)
                info["trajectories_found"] = tt.num_rows
                info["trajectories_table_version"] = traj_version
                versions = _version_summary(tt.to_pylist(), VERSION_COLUMNS)
            info["versions"] = versions
        except NotFoundError:
            info["missing_files"] = True
        snaps.append(info)
    return {
        "checkpoint_id": checkpoint_id,
        "policy_version": row["policy_version"],
        "parent_checkpoint_id": row["parent_checkpoint_id"],
        "train_config_hash": row["train_config_hash"],
        "code_version": row["code_version"],
        "seed": row["seed"],
        "world_size": row["world_size"],
        "global_step": row["global_step"],
        "samples_seen": row["samples_seen"],
        "created_at": str(row["created_at"]),
        "ancestors": chain[1:],
        "snapshots": snaps,
        "events": [{"eventType": e.get("eventType"), "runId": e.get("run", {}).get("runId"),
                    "eventTime": e.get("eventTime")}
                   for e in read_events(lake)
                   if any(o.get("name") == f"checkpoints/{checkpoint_id}" for o in e.get("outputs", []))],
    }


def format_walk(w: dict[str, Any]) -> str:
    lines = [f"checkpoint {w['checkpoint_id']}  policy version {w['policy_version']}  "
             f"(parent {w['parent_checkpoint_id'] or '-'}, {w['global_step']} steps, seed {w['seed']}, "
             f"world size {w['world_size']}, code {w['code_version']})"]
    for s in w["snapshots"]:
        lines.append(f"  <- snapshot {s['snapshot_id']}: {s.get('members', '?')} members in {s.get('groups', '?')} "
                     f"groups, estimator {s.get('advantage_estimator', '?')}, admitted at policy version "
                     f"{s.get('current_policy_version', '?')}")
        if s.get("source_versions"):
            sv = s["source_versions"]
            pairs = sv.items() if isinstance(sv, dict) else sv
            lines.append("       read tables at " + ", ".join(
                f"{t} version {v}" if v is not None and int(v) >= 0 else f"{t} (absent)" for t, v in pairs))
        if "trajectories_found" in s:
            lines.append(f"     <- {s['trajectories_found']} trajectories (trajectories table version "
                         f"{s.get('trajectories_table_version')})")
        for col, counts in (s.get("versions") or {}).items():
            lines.append(f"          {col}: " + ", ".join(f"{k} x{n}" for k, n in counts.items()))
        if s.get("missing_files"):
            lines.append("       (snapshot files missing)")
    for a in w["ancestors"]:
        lines.append(f"  parent: {a['checkpoint_id']} (policy version {a['policy_version']}, "
                     f"snapshots {len(a['snapshot_ids'])})")
    for e in w["events"]:
        lines.append(f"  openlineage: {e['eventType']} run {e['runId']} at {e['eventTime']}")
    return "\n".join(lines)
