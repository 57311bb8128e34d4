"""``admit``: the admission job as a short list of named steps.

    read versions -> candidates (scalars only) -> quality -> checks (engine)
    -> finalize (decisions, advantages) -> snapshot files -> snapshots row
    -> snapshot_members rows -> receipts (the commit that decides the groups)

Idempotence and concurrency. A group is decided by its receipt, and the
receipts commit is guarded by an application transaction ``admission`` whose
version is (receipts version read) + 1: of two runs that read the same
receipts version, exactly one commit carries that version. The other sees the
transaction already taken (before writing, or as a delta-rs concurrent-
transaction conflict), rereads and decides only what is still undecided. After
committing, every group is checked to have exactly one receipt.

Incremental reads. The receipts commit records the trajectories version the
run read and its pending bound (``now - group_timeout_s``). A group still
undecided after that run was not ready, so each of its members finished after
the bound. The next run therefore reads only the files committed after that
version, plus the older files' rows that finished after the bound (pruned by
Parquet statistics): the same candidates as a full scan, at a cost that grows
with new data, not with history (docs/write-protocol.md).

Crash safety. The snapshot id is content-addressed and its files, its
snapshots row and its snapshot_members rows are each written exactly once per
id (directory rename; app transaction ``snapshot:<id>``). They are written
before the receipts, so a run that dies anywhere before the receipts commit
left its groups undecided: the rerun decides the same groups into the same id
and finds every earlier step already done.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.admission import candidates as cand
from pipeline.admission.advantages import TURN_ESTIMATORS
from pipeline.admission.checks import ADMIT
from pipeline.admission.config import AdmissionConfig, admission_config_hash
from pipeline.admission.decide import conform, finalize, group_schema, member_schema
from pipeline.errors import IntegrityError, PipelineError
from pipeline.hooks import mark_and_wait
from pipeline.lake.ref import as_lake
from pipeline.schema import table_spec
from pipeline.snapshots.format import compute_snapshot_id, snapshot_dir

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

    from pipeline.admission.scope import Scope

LOCK_APP = "admission"
MAX_ATTEMPTS = 5
CRASH_ENV = "PIPELINE_ADMIT_CRASH_AFTER"  # test hook: snapshot_files | snapshots | snapshot_members
PAUSE_ENV = "PIPELINE_ADMIT_PAUSE"        # test hook: after deciding, sleep SECONDS, until @EPOCH, or
                                          # barrier:DIR (write DIR/ready-<pid>, wait for DIR/go): races


@dataclass(kw_only=True)
class AdmissionResult:
    """What one admission run decided (and committed, unless ``dry_run``)."""

    admission_run_id: str
    snapshot_id: str | None                 # None when nothing was admitted
    current_policy_version: int | None
    config_hash: str | None
    engine: str
    dry_run: bool
    receipts: pa.Table                      # the receipts written (or that would be, with dry_run)
    counts: dict[str, int] = field(default_factory=dict)   # decision -> groups
    admitted_groups: int = 0
    admitted_members: int = 0
    num_tokens: int = 0
    source_versions: dict[str, int] = field(default_factory=dict)
    quality: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] | None = None
    attempts: int = 1
    timings: dict[str, float] = field(default_factory=dict)
    members: pa.Table | None = None         # admitted members (snapshot_members rows)

    def as_dict(self, *, with_receipts: bool = False) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("receipts", "members")}
        d["decided_groups"] = self.receipts.num_rows
        if with_receipts:
            d["receipts"] = self.receipts.to_pylist()
        return d


def resolve_current_policy_version(lake: Lake, cfg: AdmissionConfig, explicit: int | None) -> int | None:
    """explicit > config > newest published policy > newest policy_version in trajectories."""
    if explicit is not None:
        return int(explicit)
    if cfg.current_policy_version is not None:
        return int(cfg.current_policy_version)
    from pipeline.policy_store import latest_policy_version

    v = latest_policy_version(lake)
    if v is not None:
        return int(v)
    if not lake.exists("trajectories"):
        return None
    m = pc.max(lake.read("trajectories", columns=["policy_version"]).column("policy_version")).as_py()
    return None if m is None else int(m)


def _crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        os._exit(70)  # simulate a killed process: no cleanup, no exception handlers


def _pause_point(attempt: int) -> None:
    raw = os.environ.get(PAUSE_ENV)
    if not raw or attempt != 1:
        return
    if raw.startswith("barrier:"):   # decided; the commit is next: say so, then wait for the test's go
        d = Path(raw[len("barrier:"):])
        mark_and_wait(d / f"ready-{os.getpid()}", d / "go", timeout_s=240, poll_s=0.005)
        return
    time.sleep(max(0.0, float(raw[1:]) - time.time()) if raw.startswith("@") else float(raw))


def _previous_baseline(lake: Lake, cfg: AdmissionConfig) -> float | None:
    if cfg.advantage != "reinforce_batch_norm" or cfg.baseline_momentum is None or not lake.exists("snapshots"):
        return None
    from pipeline.snapshots.format import open_snapshot

    rows = lake.read("snapshots", columns=["snapshot_id", "advantage_estimator", "created_at"]).to_pylist()
    rows = [r for r in rows if r["advantage_estimator"] == "reinforce_batch_norm"]
    if not rows:
        return None
    last = max(rows, key=lambda r: r["created_at"])
    return open_snapshot(lake, last["snapshot_id"]).manifest.get("running_baseline")


def _quality(cands: pa.Table, cfg: AdmissionConfig) -> tuple[pa.Table, dict[str, Any]]:
    """Member exclusions decided before the engines' rules: rows failing the
    great-expectations suite (``quality:*``), then, under ``truncation=filter``,
    truncated rows (``truncated``)."""
    from pipeline.admission.truncation import truncated_rejects

    rejects, summary = _quality_suite(cands, cfg)
    trunc = truncated_rejects(cands, cfg)
    if trunc.num_rows:
        trunc = trunc.filter(pc.invert(pc.is_in(trunc.column("trajectory_id"), value_set=rejects.column("trajectory_id"))))
        rejects = pa.concat_tables([rejects, trunc]).sort_by("trajectory_id")
    return rejects, summary


QUALITY_COLUMNS = tuple(c for c in cand.SCALARS if c != "reward")  # reward here is the capped reward


def quality_suites() -> dict[str, list[str] | None]:
    """The suites admission validates and the columns each sees (what a resident
    process builds once: pipeline.quality.gx.prepare)."""
    from pipeline.admission.decide import admitted_schema

    return {"trajectories": list(QUALITY_COLUMNS), "snapshot_members": admitted_schema().names}


def _quality_suite(cands: pa.Table, cfg: AdmissionConfig) -> tuple[pa.Table, dict[str, Any]]:
    empty = pa.table({"trajectory_id": pa.array([], pa.string()), "reason": pa.array([], pa.string())})
    if not cfg.quality or cands.num_rows == 0:
        return empty, {"skipped": not cfg.quality}
    from pipeline.quality.gx import validate  # imported only when a suite runs

    res = validate(cands.select(list(QUALITY_COLUMNS)), "trajectories", key="trajectory_id")
    if not res.failing:
        return empty, res.summary
    ids = sorted(res.failing)
    return pa.table({"trajectory_id": ids, "reason": [res.failing[i] for i in ids]}), res.summary


STATE_VERSION = "pipeline.trajectories_version"  # receipts commit metadata: what the run read
STATE_PENDING = "pipeline.pending_after"         # ... and its pending bound (ISO time)
STATE_TARGET = "pipeline.target"                 # ... and its --target-groups report (JSON), when asked


def previous_state(lake: Lake, rv: int) -> tuple[int, datetime] | None:
    """(trajectories version, pending bound) recorded by the admission commit at
    receipts version ``rv``; None when unknown (then everything is read)."""
    if rv < 0:
        return None
    meta = lake.commit_metadata("receipts", rv)
    if STATE_VERSION not in meta or STATE_PENDING not in meta:
        return None
    return int(meta[STATE_VERSION]), datetime.fromisoformat(meta[STATE_PENDING])


@dataclass(frozen=True)
class ReadPlan:
    """Which trajectories files hold every candidate row of a version: ``whole``
    files read entirely (added since the previous admission, or all of them
    without one) and ``pending`` files read only for rows finished at or after
    ``bound`` (pruned by Parquet statistics). Both engines read exactly this."""

    whole: list[tuple[str, dict[str, str | None]]]
    pending: list[tuple[str, dict[str, str | None]]]
    bound: datetime | None


def read_plan(lake: Lake, tv: int, previous: tuple[int, datetime] | None) -> ReadPlan:
    dt = lake.table("trajectories", tv)
    if previous is None or previous[0] > tv:
        return ReadPlan(lake.live_files(dt), [], None)
    new = lake.files_added("trajectories", dt, since=previous[0])
    names = {p for p, _ in new}
    old = [f for f in lake.live_files(dt) if f[0] not in names]
    return ReadPlan(new, old, previous[1] - timedelta(seconds=1))


def _trajectory_sources(lake: Lake, tv: int, previous: tuple[int, datetime] | None) -> list[tuple[Any, Any]]:
    """(dataset, filter) pairs holding every candidate row of trajectories version ``tv``."""
    import pyarrow.dataset as ds

    plan = read_plan(lake, tv, previous)
    out = [(lake.files_dataset("trajectories", plan.whole), None)] if plan.whole or not plan.pending else []
    if plan.pending:
        bound = pa.scalar(plan.bound, pa.timestamp("us", tz="UTC"))
        out.append((lake.files_dataset("trajectories", plan.pending), ds.field("finished_at") >= bound))
    return out


def _decisions_from_engine(lake: Lake, tv: int, cfg: AdmissionConfig, engine: str, decided: pa.Array,
                           current: int, now: datetime, dask_scheduler: str | None,
                           timings: dict[str, float], sources: list[tuple[Any, Any]] | None,
                           plan: ReadPlan | None = None) -> tuple[pa.Table, pa.Table, dict[str, Any], int]:
    t0 = time.perf_counter()
    if engine == "duckdb":
        assert sources is not None  # the caller lists them for this engine
        cands = pa.concat_tables([cand.scan(d, cfg, decided, filter=f) for d, f in sources])
        timings["scan_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        rejects, qsummary = _quality(cands, cfg)
        timings["quality_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        from pipeline.admission import engine_duckdb

        members, groups = engine_duckdb.run(cands, rejects, cfg, current_policy_version=current, now=now)
        timings["checks_s"] = time.perf_counter() - t1
        n = cands.num_rows
    elif engine == "dask":
        from pipeline.admission import engine_dask

        members, groups, qsummary, n = engine_dask.run_with_quality(
            lake, tv, cfg, decided=decided, quality_fn=lambda t: _quality(t, cfg),
            current_policy_version=current, now=now, dask_scheduler=dask_scheduler, plan=plan)
        timings["dask_s"] = time.perf_counter() - t0
    else:
        raise PipelineError(f"unknown engine {engine!r}", hint="--engine duckdb or --engine dask")
    return conform(members, member_schema(cfg)), conform(groups, group_schema(cfg)), qsummary, n


def admit(lake: Lake | str | os.PathLike[str], cfg: AdmissionConfig | None = None, *,
          current_policy_version: int | None = None, dry_run: bool = False,
          engine: Literal["duckdb", "dask"] = "duckdb", dask_scheduler: str | None = None,
          target_groups: int | None = None, now: datetime | None = None,
          command: str = "pipeline admit", scope: Scope | None = None) -> AdmissionResult:
    """Decide every ready, undecided group (of ``scope``: pipeline/admission/scope.py); write receipts
    and one snapshot of the admitted members, all sampled with one tokenizer. Reported as an
    OpenLineage run (pipeline.lineage)."""
    lake = as_lake(lake)
    from pipeline import lineage

    with lineage.admit_run(lake, cfg or AdmissionConfig(), engine, dry_run) as run:
        result = _admit(lake, cfg, current_policy_version=current_policy_version, dry_run=dry_run, engine=engine,
                        dask_scheduler=dask_scheduler, target_groups=target_groups, now=now, command=command,
                        scope=scope)
        lineage.admit_done(run, lake, result)
    return result


def _admit(lake: Lake, cfg: AdmissionConfig | None = None, *, current_policy_version: int | None = None,
           dry_run: bool = False, engine: Literal["duckdb", "dask"] = "duckdb", dask_scheduler: str | None = None,
           target_groups: int | None = None, now: datetime | None = None,
           command: str = "pipeline admit", scope: Scope | None = None) -> AdmissionResult:
    from pipeline.admission import scope as scoping

    # a scoped run (or one that defers another tokenizer's groups, scope.py) leaves groups undecided
    # whatever their age: no incremental-scan state, so the next run scans them all again
    scoped = scope is not None and bool(scope.run_id or scope.env or scope.task)
    cfg = cfg or AdmissionConfig()
    run_id = f"admit-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    receipts_schema = table_spec("receipts").arrow_schema()
    current = resolve_current_policy_version(lake, cfg, current_policy_version)
    if current is None or not lake.exists("trajectories"):
        return AdmissionResult(admission_run_id=run_id, snapshot_id=None, current_policy_version=current,
                               config_hash=None, engine=engine, dry_run=dry_run,
                               receipts=receipts_schema.empty_table())
    cfg = dataclasses.replace(cfg, current_policy_version=current, vocab_size=resolve_vocab_size(lake, cfg, current))
    chash = admission_config_hash(cfg)
    now = now or datetime.now(timezone.utc)
    if now.tzinfo is None:
        now = now.replace(tzinfo=timezone.utc)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        rv = lake.version("receipts")
        rv = -1 if rv is None else rv
        tv = lake.version("trajectories")
        assert tv is not None  # the table exists: checked above
        decided = (lake.read("receipts", columns=["group_id"], version=rv).column("group_id").combine_chunks()
                   if rv >= 0 else pa.array([], pa.string()))
        previous = previous_state(lake, rv)
        sources = _trajectory_sources(lake, tv, previous)   # both engines read only what changed
        plan = read_plan(lake, tv, previous) if engine == "dask" else None
        members, groups, qsummary, n_cands = _decisions_from_engine(
            lake, tv, cfg, engine, decided, current, now, dask_scheduler, timings, sources, plan)
        members, groups, _tok, deferred = scoping.apply(members, groups, scope, _policy_tokenizer(lake, current))
        prev_baseline = _previous_baseline(lake, cfg)
        dec = finalize(members, groups, cfg, config_hash=chash, current_policy_version=current,
                       previous_baseline=prev_baseline)
        reverified = None
        if cfg.reverify_top or cfg.shadow_sample:   # rewards that can be doubted (reverify.py)
            from pipeline.admission import reverify

            dec, reverified = reverify.apply(dec, members, groups, sources, cfg, config_hash=chash,
                                             current_policy_version=current, previous_baseline=prev_baseline)
        timings["decide_s"] = time.perf_counter() - t0
        admitted = dec.admitted
        n_admit_groups = dec.counts.get(ADMIT, 0)
        snapshot_id = snapshot_id_of(admitted, chash, cfg.advantage) if admitted.num_rows else None
        source_versions = {"trajectories": int(tv), "receipts": int(rv)}
        target = target_report(target_groups, n_admit_groups, dec.receipts.num_rows)
        receipts = stamp_receipts(dec.receipts, run_id, snapshot_id, receipts_schema)
        rows = receipts.num_rows
        quality = {"candidates": qsummary, "candidate_rows": n_cands, "deferred_groups": deferred,
                   **({"reverify": reverified.as_dict()} if reverified is not None else {})}
        result = AdmissionResult(admission_run_id=run_id, snapshot_id=snapshot_id, current_policy_version=current,
                                 config_hash=chash, engine=engine, dry_run=dry_run, receipts=receipts,
                                 counts=dict(dec.counts), admitted_groups=n_admit_groups,
                                 admitted_members=admitted.num_rows, num_tokens=0, source_versions=source_versions,
                                 quality=quality, target=target, attempts=attempt, timings=timings,
                                 members=admitted)
        if dry_run or not rows:
            return result
        _pause_point(attempt)
        taken = lake.transaction_version("receipts", LOCK_APP)
        if taken is not None and taken >= rv + 1:
            continue  # another run decided groups since we read: start over
        if snapshot_id is not None:
            t1 = time.perf_counter()
            result.num_tokens, result.quality["snapshot"] = _publish_snapshot(lake, cfg, NewSnapshot(
                snapshot_id=snapshot_id, admission_run_id=run_id, config_hash=chash, members=admitted,
                current_policy_version=current, num_groups=n_admit_groups, running_baseline=dec.baseline,
                source_versions=source_versions, candidate_quality=qsummary), command=command, sources=sources)
            timings["materialize_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        pending = now - timedelta(microseconds=round(cfg.group_timeout_s * 1e6))
        meta = {"pipeline.admission_run_id": run_id} | (
            {} if scoped or deferred else {STATE_VERSION: str(tv), STATE_PENDING: pending.isoformat()})
        if target is not None:  # the next rollout reads it (plan_next_rollout; jobs' {dynamic_groups})
            meta[STATE_TARGET] = json.dumps(target, sort_keys=True)
        res = lake.append("receipts", receipts, command=command, config_hash=chash, app_id=LOCK_APP,
                          txn_version=rv + 1, extra_metadata=meta)
        timings["receipts_s"] = time.perf_counter() - t1
        if not res.landed or not _landed(lake, run_id, res.version):
            continue  # lost the race: reread, decide what is left
        _check_decided_once(lake, receipts.column("group_id"))
        return result
    raise PipelineError(f"admission could not commit after {MAX_ATTEMPTS} attempts (other admission runs kept "
                        "winning the receipts commit)", hint="rerun pipeline admit")


def resolve_vocab_size(lake: Lake, cfg: AdmissionConfig, current: int) -> int | None:
    """config > the current policy's ``vocab_size`` (its checkpoint's hf/config.json) > None (unchecked)."""
    if cfg.vocab_size is not None:
        return int(cfg.vocab_size)
    try:
        from pipeline.lake import objects
        from pipeline.policy_store import HF_SUBDIR, policy_info

        info = policy_info(lake, current)
        raw = objects.get(lake, f"{info['path']}/{HF_SUBDIR}/config.json") if info else None
        conf = json.loads(raw) if raw else {}
    except Exception:  # noqa: BLE001 - a lake without (readable) checkpoints: nothing to check against
        return None
    vocab = conf.get("vocab_size") or (conf.get("text_config") or {}).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) and vocab > 0 else None


def snapshot_id_of(admitted: pa.Table, config_hash: str, estimator: str) -> str:
    """``compute_snapshot_id`` of the admitted members, hashed from one Arrow buffer:
    the rows sorted in Arrow (UTF-8 byte order = Python's code-point order), each
    ``tid\tchash\n`` joined by an Arrow kernel, the whole buffer hashed once (the
    same bytes the per-row loop feeds sha256). Falls back to that loop on nulls."""
    import hashlib

    from pipeline.snapshots.format import FORMAT_VERSION

    t = admitted.select(["trajectory_id", "content_hash"])
    if t.num_rows == 0 or t.column(0).null_count or t.column(1).null_count:
        return compute_snapshot_id(zip(t.column(0).to_pylist(), t.column(1).to_pylist()), config_hash, estimator)
    t = t.sort_by([("trajectory_id", "ascending"), ("content_hash", "ascending")])
    t = t.combine_chunks()
    lines = pc.binary_join_element_wise(t.column(0).chunk(0), t.column(1).chunk(0), "\t")
    lines = pc.binary_join_element_wise(lines, pa.scalar("", pa.string()), "\n")
    offsets = np.frombuffer(lines.buffers()[1], np.int32, len(lines) + 1, lines.offset * 4)
    body = lines.buffers()[2].to_pybytes()[offsets[0]:offsets[-1]]
    h = hashlib.sha256(f"snapshot-v{FORMAT_VERSION}\n".encode())
    h.update(body)
    h.update(f"config\t{config_hash}\nestimator\t{estimator}\n".encode())
    return h.hexdigest()


def _policy_tokenizer(lake: Lake, version: int) -> str | None:
    """The tokenizer_rev of a published policy version (None when unknown)."""
    try:
        from pipeline.policy_store import policy_info

        info = policy_info(lake, version)
    except Exception:  # noqa: BLE001 - a lake without (readable) checkpoints: no preference
        return None
    return info["tokenizer_rev"] if info else None


def stamp_receipts(core: pa.Table, run_id: str, snapshot_id: str | None, schema: pa.Schema, *,
                   decided_at: datetime | None = None) -> pa.Table:
    """Receipt rows from finalize's core columns plus this run's id, snapshot and time (default: now)."""
    n = core.num_rows
    admitted = pc.equal(core.column("decision"), ADMIT)
    cols = {c: core.column(c) for c in core.column_names}
    cols["admission_run_id"] = pa.array([run_id] * n, pa.string())
    cols["snapshot_id"] = pc.if_else(admitted, pa.scalar(snapshot_id, pa.string()), pa.scalar(None, pa.string())) \
        if n else pa.array([], pa.string())
    cols["decided_at"] = pa.array([decided_at or datetime.now(timezone.utc)] * n, pa.timestamp("us", tz="UTC"))
    return pa.table({f.name: cols[f.name] for f in schema}).cast(schema)


@dataclass(frozen=True, kw_only=True)
class NewSnapshot:
    """The snapshot an admission run publishes: its admitted members and where they come from."""

    snapshot_id: str
    admission_run_id: str
    config_hash: str
    members: pa.Table                   # the admitted members (snapshot_members rows, without snapshot_id)
    current_policy_version: int
    num_groups: int                     # admitted groups
    running_baseline: float | None      # reinforce_batch_norm's baseline carried forward (manifest)
    source_versions: dict[str, int]     # {"trajectories": version read, "receipts": version read}
    candidate_quality: dict[str, Any]   # the candidates' quality summary (snapshots.quality_json)


def _publish_snapshot(lake: Lake, cfg: AdmissionConfig, new: NewSnapshot, *, command: str,
                      sources: list[tuple[Any, Any]] | None = None) -> tuple[int, dict[str, Any]]:
    """Write the snapshot's files, then its ``snapshots`` row, then its ``snapshot_members`` rows (each commit
    idempotent under app id ``snapshot:<id>``); returns (tokens, the snapshot's quality summary)."""
    from pipeline.admission.materialize import materialize
    from pipeline.config import config_dict

    admitted, snapshot_id, chash, source_versions = new.members, new.snapshot_id, new.config_hash, new.source_versions
    current, n_groups = new.current_policy_version, new.num_groups

    quality: dict[str, Any] = {"skipped": True}
    if cfg.quality:
        from pipeline.quality.gx import validate

        q = validate(admitted, "snapshot_members", key="trajectory_id")
        quality = q.summary
        if q.failing:
            raise IntegrityError(f"snapshot {snapshot_id}: {len(q.failing)} admitted rows fail the "
                                 f"snapshot_members suite: {sorted(set(q.failing.values()))}",
                                 hint="this is a bug in admission; report it with the receipts")
    extra = {"config_hash": chash, "advantage_estimator": cfg.advantage, "config": config_dict(cfg),
             "current_policy_version": current, "source_versions": source_versions, "num_groups": n_groups,
             "running_baseline": new.running_baseline}
    if cfg.advantage in TURN_ESTIMATORS:
        extra["turn_credit"] = True   # the payload has turn_advantages (pipeline.snapshots.TURN_COLUMNS)
    snap, tokens = materialize(lake, source_versions["trajectories"], admitted, snapshot_id=snapshot_id,
                               batch_rows=cfg.batch_rows, manifest_extra=extra, sources=sources,
                               turn_eps=cfg.eps if cfg.advantage in TURN_ESTIMATORS else None)
    tokens = int(snap.manifest.get("num_tokens", tokens))
    _crash_point("snapshot_files")
    row = {
        "snapshot_id": snapshot_id, "admission_run_id": new.admission_run_id, "config_hash": chash,
        "config_json": json.dumps(config_dict(cfg), sort_keys=True, default=str),
        "advantage_estimator": cfg.advantage, "current_policy_version": current, "num_groups": n_groups,
        "num_members": admitted.num_rows, "num_tokens": tokens, "path": snapshot_dir(snapshot_id),
        "manifest_sha256": snap.manifest_sha256, "source_versions": list(source_versions.items()),
        "quality_json": json.dumps({"candidates": new.candidate_quality, "snapshot": quality}, sort_keys=True,
                                   default=str),
        "created_at": datetime.now(timezone.utc),
    }
    lake.append("snapshots", pa.Table.from_pylist([row], schema=table_spec("snapshots").arrow_schema()),
                command=command, config_hash=chash, app_id=f"snapshot:{snapshot_id}", txn_version=0)
    _crash_point("snapshots")
    members = admitted.add_column(0, "snapshot_id", pa.array([snapshot_id] * admitted.num_rows, pa.string()))
    lake.append("snapshot_members", members, command=command, config_hash=chash,
                app_id=f"snapshot:{snapshot_id}", txn_version=0)
    _crash_point("snapshot_members")
    return tokens, quality


# Filters are applied in Arrow after reading the (small, scalar) columns rather
# than pushed into the Delta dataset: pruning by file statistics buys nothing
# for random ids and must never be able to hide a row from these checks.
def _landed(lake: Lake, run_id: str, version: int | None) -> bool:
    if version is not None and lake.commit_metadata("receipts", version).get("pipeline.admission_run_id") == run_id:
        return True
    t = lake.read("receipts", columns=["admission_run_id"])
    return bool(pc.any(pc.equal(t.column("admission_run_id"), run_id)).as_py())


def _check_decided_once(lake: Lake, group_ids: pa.ChunkedArray) -> None:
    """After our commit: every group we decided has exactly one receipt."""
    ids = group_ids.combine_chunks()
    t = lake.read("receipts", columns=["group_id"])
    t = t.filter(pc.is_in(t.column("group_id"), value_set=ids))
    if t.num_rows != len(ids):
        counts = t.group_by("group_id").aggregate([("group_id", "count")])
        dup = counts.filter(pc.greater(counts.column("group_id_count"), 1)).column("group_id").to_pylist()
        raise IntegrityError(f"groups decided more than once: {dup[:5]} ({len(dup)} in all)",
                             hint="two admission runs raced past the receipts guard; report this")


def target_report(target: int | None, admitted: int, decided: int) -> dict[str, Any] | None:
    """DAPO-style dynamic sampling: how many more groups a scheduler should sample."""
    if target is None:
        return None
    missing = max(0, int(target) - admitted)
    rate = admitted / decided if decided else None
    return {"target_groups": int(target), "admitted_groups": admitted, "missing_groups": missing,
            "observed_admit_rate": rate,
            "groups_to_sample": (math.ceil(missing / rate) if rate else None) if missing else 0}


def plan_next_rollout(target: dict[str, Any] | None, *, default: int, max_groups: int, fresh: bool = False) -> int:
    """Dynamic sampling as a loop: the group count of the next rollout from an
    admission's target report (``AdmissionResult.target``). A shortfall asks for
    ``groups_to_sample`` (the missing groups over the observed admit rate); a
    met target asks for ``ceil(target_groups / rate)``, what the next batch is
    expected to need; no report, or no observed rate, falls back to
    ``default`` (nothing admitted at all: ``max_groups``). Clamped to
    [1, max_groups]. ``fresh``: size a whole new batch (ceil(target_groups /
    rate)) whatever this one's shortfall."""
    if target is None:
        n = default
    else:
        rate = target.get("observed_admit_rate")
        if target.get("missing_groups", 0) > 0 and not fresh:
            n = target.get("groups_to_sample") or (max_groups if rate == 0 else default)
        else:
            n = math.ceil(target["target_groups"] / rate) if rate else default
    return max(1, min(int(max_groups), int(n)))


def last_target(lake: Lake, *, lookback: int = 50) -> dict[str, Any] | None:
    """The target report of the newest admission commit that recorded one
    (``--target-groups``), looking back at most ``lookback`` receipts versions."""
    v = lake.version("receipts")
    if v is None:
        return None
    for version in range(v, max(-1, v - lookback), -1):
        raw = lake.commit_metadata("receipts", version).get(STATE_TARGET)
        if raw:
            return json.loads(raw)
    return None
