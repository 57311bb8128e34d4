"""Lineage: OpenLineage run events for every job, and the walk
checkpoint -> snapshots -> trajectories -> versions.

Every job (ingest, rollout, admit, train, lake maintain, scheduled jobs) runs
inside :func:`job_run`, which emits START and then COMPLETE or FAIL with one run
id. Events go through openlineage-python. Transport: the client's own
configuration when the user gave one (``OPENLINEAGE_URL``, ``OPENLINEAGE_CONFIG``,
an ``openlineage.yml`` in the working directory or ``OPENLINEAGE__TRANSPORT__*``),
otherwise a file transport appending one JSON event per line to
``<lake>/lineage/openlineage.jsonl`` (``PIPELINE_LINEAGE_FILE`` overrides the
path; ``PIPELINE_LINEAGE=off`` turns emission off).

Dataset naming follows the OpenLineage naming spec, so another producer reading
the same files names the same nodes: a local file or directory is namespace
``file`` with its absolute path as the name; an object-store path is namespace
``<scheme>://<bucket>`` with the key path (no leading slash) as the name. A
Delta table is the table's root directory, a snapshot is its directory
``<lake>/_snapshots/<snapshot_id>``, a checkpoint the directory its row names (``<lake>/_checkpoints/<id>.<run tag>``).
Facets: the dataset version (the Delta version read or written; a snapshot's
id; a checkpoint's policy version), the schema from ``schemas/``, the storage
layer; the job type; the processing engine; the resolved configuration as
execution parameters; the parent run when a scheduled job started the command
(``PIPELINE_LINEAGE_PARENT``); and the error of a failed run.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal, Sequence


from pipeline import __version__
from pipeline.lake.ref import as_lake
from pipeline.lake.uri import split_uri
from pipeline.resources import machine_cache

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

PRODUCER = f"https://github.com/trajectory-lakehouse/pipeline/tree/{__version__}"
NAMESPACE_JOB = "trajectory-lakehouse"
INTEGRATION = "TRAJECTORY_LAKEHOUSE"
DEFAULT_FILE = "lineage/openlineage.jsonl"
PARENT_ENV = "PIPELINE_LINEAGE_PARENT"


def new_run_id() -> str:
    return str(uuid.uuid4())


def enabled() -> bool:
    return os.environ.get("PIPELINE_LINEAGE", "on").lower() not in ("off", "0", "false", "no")


def lineage_file(lake: Lake) -> Path:
    override = os.environ.get("PIPELINE_LINEAGE_FILE")
    if override:
        return Path(override)
    if lake.is_local:
        return Path(lake.uri) / DEFAULT_FILE
    return _lake_cache_dir(lake) / DEFAULT_FILE


def _lake_cache_dir(lake: Lake) -> Path:
    """This machine's cache folder of an object-store lake: ``$PIPELINE_CACHE`` (default ~/.cache/pipeline)
    ``/checkpoints/<first 12 hex of sha256(lake URI)>``, the folder pipeline.policy_store.local_dir fetches the
    lake's checkpoints into (the lineage file of that lake sits beside them)."""
    return machine_cache("checkpoints", lake.uri)


def _user_configured() -> bool:
    return (any(k in os.environ for k in ("OPENLINEAGE_URL", "OPENLINEAGE_CONFIG"))
            or any(k.startswith("OPENLINEAGE__TRANSPORT") for k in os.environ)
            or Path("openlineage.yml").is_file())


def client(lake: Lake):
    """An OpenLineageClient: the user's configured transport, else the lake's file."""
    from openlineage.client import OpenLineageClient

    if _user_configured():
        return OpenLineageClient()
    from openlineage.client.transport.file import FileConfig, FileTransport

    path = lineage_file(lake)
    path.parent.mkdir(parents=True, exist_ok=True)
    return OpenLineageClient(transport=FileTransport(FileConfig(log_file_path=str(path), append=True)))


# -- datasets (OpenLineage naming spec) -------------------------------------------


@dataclass(frozen=True)
class Dataset:
    namespace: str
    name: str
    version: str | None = None
    schema: str | None = None           # a table of schemas/ whose columns describe it
    storage: tuple[str, str] | None = None   # (storageLayer, fileFormat)

    def key(self) -> tuple[str, str]:
        return self.namespace, self.name


def location(uri: str) -> tuple[str, str]:
    """(namespace, name) of a path or object-store URI per the naming spec."""
    if "://" in uri and not uri.startswith("file://"):
        scheme, rest = split_uri(uri)
        bucket, _, key = rest.partition("/")
        return f"{scheme}://{bucket}", key.strip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return "file", str(Path(uri).absolute()).rstrip("/") or "/"


def path_dataset(lake: Lake, rel: str, **kw: Any) -> Dataset:
    ns, name = location(f"{lake.uri.rstrip('/')}/{rel}")
    return Dataset(ns, name, **kw)


def table(lake: Lake, name: str, version: int | None = None) -> Dataset:
    """A Delta table of the lake at ``version`` (None: unknown / not read)."""
    from pipeline.schema import TABLES

    known = name in TABLES or name in ("metrics", "evaluations")
    return path_dataset(lake, name, version=None if version is None or int(version) < 0 else str(version),
                        schema=name if known else None, storage=("delta", "parquet"))


def snapshot(lake: Lake, snapshot_id: str) -> Dataset:
    """A snapshot directory (immutable; its id is its version)."""
    return path_dataset(lake, f"_snapshots/{snapshot_id}", version=snapshot_id, schema="snapshot_payload",
                        storage=("file", "parquet"))


def checkpoint(lake: Lake, checkpoint_id: str, policy_version: int | None = None, *, rel: str | None = None
               ) -> Dataset:
    """A checkpoint directory; its policy version is its dataset version. The directory is the one its
    ``checkpoints`` row names (``rel``, else looked up: each run writes its own ``<id>.<run tag>`` and only
    the publication's winner is named), so the producer's output and every consumer's input are one dataset,
    named by the path the files really have."""
    from pipeline.errors import NotFoundError
    from pipeline.policy_store import checkpoint_rel, published_rel

    if rel is None:
        try:
            rel = published_rel(lake, checkpoint_id)
        except NotFoundError:   # not published (yet): the id's own name
            rel = checkpoint_rel(checkpoint_id)
    return path_dataset(lake, rel, version=None if policy_version is None else str(policy_version),
                        storage=("file", "safetensors"))


def file(path: str | os.PathLike[str]) -> Dataset:
    ns, name = location(str(path))
    return Dataset(ns, name)


def checkpoints_for_versions(lake: Lake, versions) -> list[Dataset]:
    """Checkpoint datasets of the given policy versions (the newest checkpoint of each)."""
    versions = {int(v) for v in versions if v is not None}
    if not versions or not lake.exists("checkpoints"):
        return []
    rows = lake.read("checkpoints", columns=["checkpoint_id", "policy_version", "created_at", "path"]).to_pylist()
    best: dict[int, dict[str, Any]] = {}
    for r in rows:
        v = r["policy_version"]
        if v in versions and (v not in best or r["created_at"] > best[v]["created_at"]):
            best[v] = r
    from pipeline.policy_store import row_rel

    return [checkpoint(lake, r["checkpoint_id"], v, rel=row_rel(r)) for v, r in sorted(best.items())]


def train_outputs(lake: Lake, checkpoint_id: str, policy_version: int | None) -> list[Dataset]:
    """What a published training run wrote: the checkpoint, its row, its metrics."""
    return [checkpoint(lake, checkpoint_id, policy_version), table(lake, "checkpoints", lake.version("checkpoints")),
            table(lake, "metrics", lake.version("metrics"))]


# -- per-job wrappers (one call from each job's entry point) ---------------------------


def ingest_run(lake: Lake, paths: Sequence[str | os.PathLike[str]], command: str):
    return job_run(lake, "pipeline.ingest", job_type="INGEST", engine="deltalake",
                   config={"command": command, "files": [str(p) for p in paths]},
                   inputs=[file(p) for p in paths if "://" in str(p) or Path(p).exists()])


def ingest_done(run: JobRun, lake: Lake, report) -> None:
    run.output(table(lake, "trajectories", report.trajectories_version),
               table(lake, "quarantine", report.quarantine_version) if report.quarantine_version is not None
               else None)


def admit_run(lake: Lake, cfg, engine: str, dry_run: bool):
    return job_run(lake, "pipeline.admit", job_type="ADMIT", engine=engine, config=cfg)


def admit_done(run: JobRun, lake: Lake, result) -> None:
    if result.dry_run:
        run.skip = True
        return
    sv = result.source_versions or {}
    run.input(table(lake, "trajectories", sv.get("trajectories")), table(lake, "receipts", sv.get("receipts"))
              if sv.get("receipts", -1) >= 0 else None)
    if result.receipts.num_rows:
        run.output(table(lake, "receipts", lake.version("receipts")))
    if result.snapshot_id:
        run.output(snapshot(lake, result.snapshot_id), table(lake, "snapshots", lake.version("snapshots")),
                   table(lake, "snapshot_members", lake.version("snapshot_members")))


def rollout_run(lake: Lake, cfg):
    return job_run(lake, "pipeline.rollout", job_type="ROLLOUT", engine=getattr(cfg, "engine", None), config=cfg)


def rollout_done(run: JobRun, lake: Lake, summary) -> None:
    policy = str(getattr(run.config, "policy", "") or "")
    if policy and Path(policy).is_dir():          # a plain policy directory outside the lake's versions
        run.input(file(policy))
    else:
        run.input(*checkpoints_for_versions(lake, summary.policy_versions))
    run.output(table(lake, "trajectories", lake.version("trajectories")),
               table(lake, "events", lake.version("events")) if lake.exists("events") else None)


def maintain_run(lake: Lake, config: dict[str, Any]):
    return job_run(lake, "pipeline.lake.maintain", job_type="MAINTENANCE", engine="deltalake", config=config)


def maintain_done(run: JobRun, lake: Lake, report: dict[str, Any], dry_run: bool) -> None:
    for name, t in report.get("tables", {}).items():
        run.input(table(lake, name, t.get("version")))
        if not dry_run:
            run.output(table(lake, name, t.get("version")))


class ScheduledRun:
    """A scheduled job (pipeline jobs): START before its command runs, COMPLETE
    or FAIL from its result; the command's own runs name this one as parent."""

    def __init__(self, lake: Lake, job: str, args: list[str]) -> None:
        self.run = JobRun(lake=lake, job_name=f"pipeline.jobs.{job}", run_id=new_run_id(), job_type="SCHEDULED_JOB",
                          engine=None, config={"job": job, "args": list(args)})
        self.run._emit("START")

    def env(self) -> dict[str, str]:
        return dict(os.environ) | parent_env(self.run.job_name, self.run.run_id)

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        if result.get("status") == "ok":
            self.run._emit("COMPLETE")
        else:
            self.run._emit("FAIL", error=f"{result.get('status')}: returncode {result.get('returncode')}; "
                                         f"{(result.get('stderr') or '').strip()[-500:]}")
        return result


def _schema_facet(table_name: str):
    from openlineage.client.facet_v2 import schema_dataset

    from pipeline.schema import table_spec

    spec = table_spec(table_name)
    return schema_dataset.SchemaDatasetFacet(fields=[
        schema_dataset.SchemaDatasetFacetFields(name=c.name, type=c.type_text, description=c.description or None)
        for c in spec.columns])


def _dataset_facets(d: Dataset) -> dict[str, Any]:
    from openlineage.client.facet_v2 import dataset_version_dataset, storage_dataset

    facets: dict[str, Any] = {}
    if d.version is not None:
        facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=str(d.version))
    if d.schema is not None:
        facets["schema"] = _schema_facet(d.schema)
    if d.storage is not None:
        facets["storage"] = storage_dataset.StorageDatasetFacet(storageLayer=d.storage[0], fileFormat=d.storage[1])
    return facets


def _as_dataset(lake: Lake, item) -> Dataset:
    if isinstance(item, Dataset):
        return item
    name, version = item                      # legacy (relative name, version) under the lake
    return path_dataset(lake, name, version=None if version is None else str(version))


# -- run facets ---------------------------------------------------------------------


def engine_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    dist = {"deltalake": "deltalake", "duckdb": "duckdb", "dask": "dask", "deepspeed": "deepspeed",
            "hf": "transformers", "transformers": "transformers", "vllm": "vllm", "pyarrow": "pyarrow"}.get(name)
    if dist is None:
        return __version__
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def _flatten(prefix: str, value: Any, out: list[tuple[str, str]]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out.append((prefix, value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)))


def config_facet(config: Any):
    """The resolved configuration as an ExecutionParametersRunFacet (dotted keys, JSON values)."""
    import dataclasses

    from openlineage.client.facet_v2 import execution_parameters_run as ep

    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        from pipeline.config import config_dict

        config = config_dict(config)
    flat: list[tuple[str, str]] = []
    _flatten("", config or {}, flat)
    return ep.ExecutionParametersRunFacet(parameters=[ep.ExecutionParameter(key=k, value=v) for k, v in flat])


def _parent_facet():
    raw = os.environ.get(PARENT_ENV)
    if not raw:
        return None
    try:
        p = json.loads(raw)
        from openlineage.client.facet_v2 import parent_run

        return parent_run.ParentRunFacet(run=parent_run.Run(runId=p["runId"]),
                                         job=parent_run.Job(namespace=p["namespace"], name=p["name"]))
    except Exception:   # a malformed variable never stops a job
        return None


def parent_env(job_name: str, run_id: str) -> dict[str, str]:
    """Environment for a child process so that its runs name this run as parent."""
    return {PARENT_ENV: json.dumps({"namespace": NAMESPACE_JOB, "name": job_name, "runId": run_id})}


EventType = Literal["START", "COMPLETE", "FAIL"]   # the OpenLineage run states this package emits


def emit_run_event(lake: Lake, *, event_type: EventType, run_id: str, job_name: str,
                   inputs: list, outputs: list, run_facets: dict[str, Any] | None = None,
                   error: str | None = None, job_type: str | None = None, engine: str | None = None,
                   config: Any = None) -> dict[str, Any]:
    """Emit one RunEvent. ``inputs``/``outputs`` are :class:`Dataset` (or legacy
    (name relative to the lake, version) pairs). Returns the event as a dict."""
    from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
    from openlineage.client.facet_v2 import error_message_run, job_type_job, processing_engine_run
    from openlineage.client.serde import Serde

    facets: dict[str, Any] = dict(run_facets or {})
    if engine:
        from importlib.metadata import version as _v

        facets["processing_engine"] = processing_engine_run.ProcessingEngineRunFacet(
            version=engine_version(engine), name=engine, openlineageAdapterVersion=_v("openlineage-python"))
    if config is not None:
        facets["executionParameters"] = config_facet(config)
    parent = _parent_facet()
    if parent is not None:
        facets["parent"] = parent
    if error:
        facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(message=error, programmingLanguage="python")
    job_facets: dict[str, Any] = {}
    if job_type:
        job_facets["jobType"] = job_type_job.JobTypeJobFacet(processingType="BATCH", integration=INTEGRATION,
                                                             jobType=job_type)
    ins = [_as_dataset(lake, d) for d in inputs]
    outs = [_as_dataset(lake, d) for d in outputs]
    event = RunEvent(
        eventType=getattr(RunState, event_type),
        eventTime=datetime.now(timezone.utc).isoformat(),
        run=Run(runId=run_id, facets=facets),
        job=Job(namespace=NAMESPACE_JOB, name=job_name, facets=job_facets),
        producer=PRODUCER,
        inputs=[InputDataset(namespace=d.namespace, name=d.name, facets=_dataset_facets(d)) for d in ins],
        outputs=[OutputDataset(namespace=d.namespace, name=d.name, facets=_dataset_facets(d)) for d in outs],
    )
    if enabled():
        client(lake).emit(event)
    return json.loads(Serde.to_json(event))


@dataclass(kw_only=True)
class JobRun:
    """What a running job has read and written so far (reported at COMPLETE/FAIL)."""
    lake: Any
    job_name: str
    run_id: str
    job_type: str
    engine: str | None
    config: Any
    inputs: list[Dataset] = field(default_factory=list)
    outputs: list[Dataset] = field(default_factory=list)
    skip: bool = False                  # e.g. a dry run: emit nothing more

    def input(self, *ds: Dataset | None) -> None:
        self.inputs.extend(d for d in ds if d is not None)

    def output(self, *ds: Dataset | None) -> None:
        self.outputs.extend(d for d in ds if d is not None)

    def _emit(self, event_type: EventType, error: str | None = None) -> None:
        try:
            emit_run_event(self.lake, event_type=event_type, run_id=self.run_id, job_name=self.job_name,
                           inputs=_dedupe(self.inputs), outputs=_dedupe(self.outputs), error=error,
                           job_type=self.job_type, engine=self.engine, config=self.config)
        except Exception as exc:   # lineage is observability: it never fails the job
            print(f"warning: OpenLineage {event_type} event of {self.job_name} not emitted: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)


def _dedupe(ds: list[Dataset]) -> list[Dataset]:
    seen: dict[tuple[str, str], Dataset] = {}
    for d in ds:
        seen[d.key()] = d           # the last report of a dataset wins (its newest version)
    return list(seen.values())


@contextlib.contextmanager
def job_run(lake: Lake, job_name: str, *, job_type: str, engine: str | None = None, config: Any = None,
            inputs: list[Dataset] | None = None, run_id: str | None = None) -> Iterator[JobRun]:
    """START now; COMPLETE when the block returns, FAIL (with the error) when it raises."""
    run = JobRun(lake=lake, job_name=job_name, run_id=run_id or new_run_id(), job_type=job_type, engine=engine,
                 config=config, inputs=list(inputs or []))
    run._emit("START")
    try:
        yield run
    except BaseException as exc:
        run._emit("FAIL", error=f"{type(exc).__name__}: {exc}")
        raise
    if not run.skip:
        run._emit("COMPLETE")


def read_events(lake: Lake | str | os.PathLike[str], run_id: str | None = None) -> list[dict[str, Any]]:
    """Events of the default file transport (optionally one run's)."""
    lake = as_lake(lake)
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


def _read_where(lake: Lake, name: str, columns: list[str] | None, column: str, values: list, *, version=None):
    """Rows whose ``column`` is in ``values``, filter pushed down to the files.
    (The lake writes min/max stats for every scalar column: without them
    deltalake's dataset prunes every file from a string filter.)"""
    import pyarrow.dataset as ds

    return lake.read(name, columns=columns, version=version, filter=ds.field(column).isin(list(values)))


def walk(lake: Lake | str | os.PathLike[str], checkpoint_id: str, *, with_trajectories: bool = True,
         max_ancestors: int = 100) -> dict[str, Any]:
    """checkpoint -> parent chain; -> snapshots (row + manifest) -> member
    trajectories -> the versions they were produced with (counts)."""
    lake = as_lake(lake)
    from pipeline.snapshots.format import open_snapshot, read_snapshot_table
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
    chain: list[dict[str, Any]] = []
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
                   if any((o.get("namespace"), o.get("name")) == checkpoint(lake, checkpoint_id).key()
                          for o in e.get("outputs", []))],
    }


def format_walk(w: dict[str, Any]) -> str:
    lines = [f"checkpoint {w['checkpoint_id']}  policy version {w['policy_version']}  "
             f"(parent {w['parent_checkpoint_id'] or '-'}, {w['global_step']} step{'' if w['global_step'] == 1 else 's'}, seed {w['seed']}, "
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
