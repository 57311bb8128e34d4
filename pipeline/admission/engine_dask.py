"""The Dask engine: the same rules as sql/admission_*.sql, in pandas, on a
``distributed`` cluster (``--dask-scheduler ADDRESS`` or ``$PIPELINE_DASK_SCHEDULER``;
a LocalCluster when neither is given). The only module importing dask.

Workers get everything they need in the task arguments: the file list and
the lake's storage options (credentials and endpoint), so a worker started
without AWS_* in its own environment reads an S3 lake. With no worker alive
for ``$PIPELINE_DASK_WORKER_TIMEOUT_S`` (default 120 s) admission stops with a
one-line error; so does a lost scheduler (nothing is committed before the
engine returns).

The dataframe is built over the Delta version's Parquet files (the lake's
file list with each file's partition values: Delta keeps partition columns
out of the files), each file reduced to candidate scalars by the same
``candidates.extract`` the DuckDB path uses, then shuffled by group_id so each
partition holds whole groups. docs/dependency-notes.md measured Dask LocalCluster 15-52x
slower than DuckDB on one machine: it is the scale-out path, not the default.
"""

from __future__ import annotations

import os
from concurrent.futures import CancelledError
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import dask
import numpy as np
import pandas as pd
import pyarrow as pa

from pipeline.admission import candidates as cand
from pipeline.admission.config import AdmissionConfig
from pipeline.admission import rules
from pipeline.admission.decide import conform, group_schema, member_schema
from pipeline.admission.rules import MISMATCH_REASONS, REF_FIELDS
from pipeline.errors import ConfigError, PipelineError
from pipeline.lake.uri import split_uri

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

SCHEDULER_ENV = "PIPELINE_DASK_SCHEDULER"
WORKER_TIMEOUT_ENV = "PIPELINE_DASK_WORKER_TIMEOUT_S"
HOLD_ENV = "PIPELINE_DASK_TEST_HOLD"  # test hook (workers): a directory; each read task marks itself, waits for `go`
DEFAULT_WORKER_TIMEOUT_S = 120.0
ROWS_PER_PARTITION = 100_000   # candidate rows per partition of the group shuffle

# keep object columns object: the engines must compare like Python strings
dask.config.set({"dataframe.convert-string": False})


def _read_file(item: tuple, cfg: AdmissionConfig, decided: pa.Array,
               storage_options: dict | None) -> pd.DataFrame:
    """One file's candidate rows. ``item`` = (uri, partition values[, bound]): with a
    bound (an ISO time) only rows finished at or after it, reading only the row
    groups whose finished_at statistics reach it (the DuckDB engine's pending
    filter, run/read_plan)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from pipeline.schema import table_spec

    uri, partition_values = item[0], item[1]
    bound = item[2] if len(item) > 2 else None
    if os.environ.get(HOLD_ENV):
        _hold(os.environ[HOLD_ENV])
    spec = table_spec("trajectories")
    cols = cand.source_columns(cfg)
    if "://" in uri and not uri.startswith("file://"):
        fs = _worker_filesystem(uri, storage_options)
        pf = pq.ParquetFile(fs.open_input_file(split_uri(uri)[1]))
    else:
        pf = pq.ParquetFile(uri.removeprefix("file://"))
    present = [c for c in cols if c in pf.schema_arrow.names]
    if bound is None:
        t = pf.read(columns=present)
    else:
        b = pa.scalar(datetime.fromisoformat(bound), pa.timestamp("us", tz="UTC"))
        keep = _row_groups_reaching(pf, "finished_at", b)
        t = pf.read_row_groups(keep, columns=present) if keep else pf.schema_arrow.empty_table().select(present)
        t = t.filter(pc.greater_equal(t.column("finished_at"), b))
    for c in cols:
        if c not in present:
            f = spec.column(c).arrow_field()
            t = t.append_column(f, pa.array([partition_values.get(c)] * t.num_rows, pa.string()).cast(f.type))
    return cand.extract(t.select(cols), cfg, decided).to_pandas()


def _row_groups_reaching(pf, column: str, bound: pa.Scalar) -> list[int]:
    """Row groups of ``pf`` that may hold ``column >= bound`` (no statistics: kept)."""
    md = pf.metadata
    # the Parquet leaf column (list and map columns before it have more leaves than Arrow fields)
    i = next((j for j in range(md.num_columns) if md.schema.column(j).path == column), None)
    if i is None:
        return list(range(md.num_row_groups))
    keep = []
    for rg in range(md.num_row_groups):
        st = md.row_group(rg).column(i).statistics
        if st is None or not st.has_min_max or pa.scalar(st.max, bound.type).as_py() >= bound.as_py():
            keep.append(rg)
    return keep


def _hold(d: str) -> None:
    import time
    from pathlib import Path

    from pipeline.hooks import mark_and_wait

    mark_and_wait(Path(d, f"task-{os.getpid()}-{time.time_ns()}"), Path(d, "go"), timeout_s=120, poll_s=0.01)


_FILESYSTEMS: dict[tuple, Any] = {}


def _worker_filesystem(uri: str, storage_options: dict | None):
    """The object-store filesystem built from the driver's storage options (the
    lake's own mapping, Lake.filesystem), cached per worker process: never
    from the worker's environment unless the driver had no options either."""
    from pipeline.lake.delta import Lake

    scheme, rest = split_uri(uri)
    root = f"{scheme}://{rest.split('/', 1)[0]}"
    key = (root, tuple(sorted((storage_options or {}).items())))
    if key not in _FILESYSTEMS:
        _FILESYSTEMS[key] = Lake(root, storage_options=storage_options).filesystem()[0]
    return _FILESYSTEMS[key]


def _first_min(values: pd.Series):
    v = values.dropna()
    return None if v.empty else v.min()


def decide_partition(df: pd.DataFrame, cfg: AdmissionConfig, current_policy_version: int, now: datetime,
                     quality: dict[str, str]) -> pd.DataFrame:
    """Candidate rows of whole groups -> member rows with their group's columns (``g_*``)."""
    m_schema, g_schema = member_schema(cfg), group_schema(cfg)
    out_cols = m_schema.names + [f"g_{c}" for c in g_schema.names]
    if df.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in out_cols})
    df = df.sort_values(["group_id", "trajectory_id"]).reset_index(drop=True)
    g = df.groupby("group_id", sort=False)
    arrived = g["trajectory_id"].transform("size")
    gsize = g["group_size"].transform("max")
    oldest = g["finished_at"].transform("min")
    cutoff = pd.Timestamp(now) - timedelta(microseconds=round(cfg.group_timeout_s * 1e6))
    df = df[(arrived >= gsize) | (oldest <= cutoff)].reset_index(drop=True)
    if df.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in out_cols})
    # 1. member exclusions
    q = df["trajectory_id"].map(quality) if quality else pd.Series([None] * len(df), dtype=object)
    member_reason = np.select(
        [q.notna().to_numpy()] + [(df["status"] == s).to_numpy() for s, _ in rules.STATUS_REASONS]
        + [(df["verdict"].isin(list(rules.NO_REWARD_VERDICTS)) | df["reward"].isna()).to_numpy()]
        + [_out_of_vocabulary(df, cfg.vocab_size)],
        [q.to_numpy(dtype=object)] + [r for _, r in rules.STATUS_REASONS] + [rules.NO_REWARD, rules.OUT_OF_VOCABULARY],
        default=None).astype(object)  # type: ignore[arg-type]  # numpy's stub omits the object default np.select takes
    df["member_reason"] = member_reason
    # 2. reference configuration among the rest
    rest = df[pd.isna(df["member_reason"])]
    cfgs = rest.groupby(["group_id", *REF_FIELDS], sort=False).size().rename("n").reset_index()
    cfgs["neg_pv"] = -cfgs["policy_version"]
    cfgs = cfgs.sort_values(["group_id", "n", "neg_pv", *REF_FIELDS[1:]],
                            ascending=[True, False, True] + [True] * (len(REF_FIELDS) - 1))
    ref = cfgs.drop_duplicates("group_id", keep="first")[["group_id", *REF_FIELDS]]
    ref = ref.rename(columns={f: f"ref_{f}" for f in REF_FIELDS})
    df = df.merge(ref, on="group_id", how="left")
    lag = int(current_policy_version) - df["oldest_version"].astype("int64")
    df["policy_lag"] = lag
    conds, why = [], []
    for f, reason in zip(REF_FIELDS, MISMATCH_REASONS):
        conds.append((df[f] != df[f"ref_{f}"]).to_numpy())
        why.append(reason)
    conds.append((lag > cfg.max_policy_lag).to_numpy())          # 3. freshness
    why.append(rules.STALE_POLICY)
    if cfg.max_queue_wait_ms is not None:
        conds.append((df["queue_wait_ms"] > cfg.max_queue_wait_ms).to_numpy())
        why.append(rules.STALE_WAIT)
    later = np.select(conds, why, default=None).astype(object)  # type: ignore[arg-type]  # as above
    df["reason"] = np.where(pd.isna(df["member_reason"]), later, df["member_reason"])
    df.loc[pd.isna(df["reason"]), "reason"] = None
    # 4. group columns
    valid = df[pd.isna(df["reason"])]
    gv = valid.groupby("group_id", sort=True)
    ga = df.groupby("group_id", sort=True)
    grp = pd.DataFrame({
        "run_id": ga["run_id"].first(), "task_id": ga["task_id"].first(),
        "difficulty": ga["difficulty"].agg(_first_min),
        **{f"ref_{f}": ga[f"ref_{f}"].first() for f in REF_FIELDS},
        "group_size": ga["group_size"].max(), "arrived_members": ga.size(),
        "max_response_len": ga["response_len"].max(), "max_tool_calls": ga["num_tool_calls"].max(),
    })
    n_valid = gv.size().reindex(grp.index, fill_value=0)
    rmax, rmin = gv["reward"].max().reindex(grp.index), gv["reward"].min().reindex(grp.index)
    rstd = gv["reward"].agg(lambda s: float(np.std(s.to_numpy(np.float64)))).reindex(grp.index)
    grp["n_valid"] = n_valid
    grp["min_valid_ok"] = n_valid >= cfg.min_valid_members
    grp["spread_ok"] = ((rmax > rmin) & (rstd >= cfg.min_reward_std)).fillna(False).astype(bool)
    grp["policy_lag"] = gv["policy_lag"].max().reindex(grp.index)
    grp["max_queue_wait_ms"] = gv["queue_wait_ms"].max().reindex(grp.index)
    for i, gt in enumerate(cfg.gates):
        s = gv[f"comp_{gt.component}"]
        agg = s.min() if gt.agg == "min" else s.max() if gt.agg == "max" else s.mean()
        grp[f"gate_{i}"] = agg.reindex(grp.index)
    grp = grp.reset_index()
    df = df.merge(grp.rename(columns={c: f"g_{c}" for c in grp.columns}), left_on="group_id",
                  right_on="g_group_id", how="left")
    return df[out_cols].astype(object).where(pd.notna(df[out_cols]), None)


def _meta(cfg: AdmissionConfig) -> pd.DataFrame:
    cols = member_schema(cfg).names + [f"g_{c}" for c in group_schema(cfg).names]
    return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})


def scheduler_address(explicit: str | None = None) -> str | None:
    """``--dask-scheduler`` > ``$PIPELINE_DASK_SCHEDULER`` > None (a LocalCluster)."""
    return explicit or os.environ.get(SCHEDULER_ENV) or None


def worker_timeout_s(explicit: float | None = None) -> float:
    """Seconds admission waits while no worker is alive (``$PIPELINE_DASK_WORKER_TIMEOUT_S``)."""
    if explicit is not None:
        return float(explicit)
    raw = os.environ.get(WORKER_TIMEOUT_ENV)
    if not raw:
        return DEFAULT_WORKER_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if v <= 0:
        raise ConfigError(f"{WORKER_TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return v


@contextmanager
def _quiet_distributed():
    """distributed logs every lost connection with a traceback; the CLI reports
    one line instead (the exception below), so keep its client side quiet."""
    import logging

    import distributed  # noqa: F401  (its import configures its loggers: quiet them after that)

    prefixes = ("distributed", "tornado", "asyncio")
    names = [n for n in [*prefixes, *logging.root.manager.loggerDict] if n.split(".")[0] in prefixes]
    before = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL + 1)
    yield
    # restored on success only: after a lost scheduler the client's background
    # reconnect keeps logging tracebacks after it is closed
    for n, lvl in before.items():
        logging.getLogger(n).setLevel(lvl)


def _client(dask_scheduler: str | None, connect_timeout: float):
    from distributed import Client, LocalCluster

    if dask_scheduler:
        try:
            return Client(dask_scheduler, timeout=connect_timeout), None
        except (OSError, TimeoutError) as exc:
            raise PipelineError(f"cannot reach the Dask scheduler at {dask_scheduler} "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})",
                                hint=f"start it (dask scheduler) or fix --dask-scheduler / ${SCHEDULER_ENV}") from None
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    return Client(cluster), cluster


def _alive_workers(client) -> int:
    return len(client.nthreads())


def _result(client, collection, *, address: str, worker_timeout: float):
    """``client.compute(collection).result()``, failing in one line when no
    worker is alive for ``worker_timeout`` seconds or the scheduler is lost."""
    import time

    from distributed import wait

    fut = client.compute(collection)
    idle_since: float | None = None
    while True:
        try:
            wait(fut, timeout=1.0)
        except TimeoutError:
            pass
        if fut.done():
            if fut.status == "error":  # a task raised: its own error, not a lost cluster
                raise _TaskError(fut.exception())
            return fut.result()
        if fut.status in ("lost", "cancelled"):
            raise _lost(address, None)
        n = _alive_workers(client)
        if n:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= worker_timeout:
            fut.cancel()
            raise PipelineError(f"no Dask worker alive at {address} for {worker_timeout:g}s; admission stopped, "
                                "nothing committed",
                                hint=f"start workers (dask worker {address}) or raise ${WORKER_TIMEOUT_ENV}")


class _TaskError(Exception):
    def __init__(self, original: BaseException) -> None:
        super().__init__(str(original))
        self.original = original


def _lost(address: str, exc: BaseException | None) -> PipelineError:
    what = f" ({type(exc).__name__})" if exc is not None else ""
    return PipelineError(f"lost the Dask scheduler at {address} during admission{what}; nothing committed",
                         hint="check the scheduler and rerun pipeline admit (admission is idempotent)")


def run_with_quality(lake: Lake, version: int, cfg: AdmissionConfig, *, decided: pa.Array, quality_fn,
                     current_policy_version: int, now: datetime, dask_scheduler: str | None = None,
                     worker_timeout: float | None = None, plan=None
                     ) -> tuple[pa.Table, pa.Table, dict[str, Any], int]:
    """-> (members, groups, quality summary, candidate rows). ``quality_fn(candidates)``
    -> (rejects table, summary) runs on the driver over the candidate scalars.
    ``plan`` (pipeline.admission.run.ReadPlan): read only its files, the pending
    ones only from its bound on (incremental, as the DuckDB engine); None: every
    live file of ``version``."""
    import dask.dataframe as dd

    files: list[tuple]
    if plan is None:
        files = lake.live_file_uris(lake.table("trajectories", version))   # (uri, partition values as log strings)
    else:
        base = lake.table_uri("trajectories")
        bound = plan.bound.isoformat() if plan.bound is not None else None
        files = [(f"{base}/{p}", pv) for p, pv in plan.whole] + [(f"{base}/{p}", pv, bound) for p, pv in plan.pending]
    m_schema, g_schema = member_schema(cfg), group_schema(cfg)
    if not files:
        return m_schema.empty_table(), g_schema.empty_table(), {}, 0
    address = scheduler_address(dask_scheduler)
    timeout = worker_timeout_s(worker_timeout)
    with _quiet_distributed():
        client, cluster = _client(address, connect_timeout=min(timeout, 30.0))
        where = address or "a LocalCluster"
        try:
            try:
                client.wait_for_workers(1, timeout=timeout)
            except TimeoutError:
                raise PipelineError(f"no Dask worker alive at {where} after {timeout:g}s; admission stopped, "
                                    "nothing committed",
                                    hint=f"start workers (dask worker {address or 'ADDRESS'}) or raise "
                                         f"${WORKER_TIMEOUT_ENV}") from None
            meta_in = cand.candidate_schema(cfg).empty_table().to_pandas()
            ddf = dd.from_map(_read_file, files, cfg=cfg, decided=decided, storage_options=lake.storage_options,
                              meta=meta_in, enforce_metadata=False)
            ddf = client.persist(ddf)
            cands_pdf = _result(client, ddf, address=where, worker_timeout=timeout)
            cands = pa.Table.from_pandas(cands_pdf, schema=cand.candidate_schema(cfg), preserve_index=False)
            rejects, qsummary = quality_fn(cands)
            quality = dict(zip(rejects.column("trajectory_id").to_pylist(), rejects.column("reason").to_pylist()))
            # sized by the candidates, not the files: an incremental run over a big lake has many
            # (mostly pruned) pending files and few candidate rows
            nparts = max(1, min(len(files), 16, -(-cands.num_rows // ROWS_PER_PARTITION)))
            out = ddf.shuffle("group_id", npartitions=nparts).map_partitions(
                decide_partition, cfg, int(current_policy_version), now, quality, meta=_meta(cfg),
                enforce_metadata=False)
            pdf = _result(client, out, address=where, worker_timeout=timeout)
        except PipelineError:
            raise
        except _TaskError as te:
            exc = te.original
            if isinstance(exc, OSError):
                first = (str(exc).splitlines() or [""])[0][:300]
                raise PipelineError(f"a Dask worker could not read the lake {lake.uri}: {type(exc).__name__}: {first}",
                                    hint="the workers get the lake's storage options from this process: check "
                                         "AWS_* here (endpoint, credentials) and that workers reach the store"
                                    ) from None
            raise
        except (OSError, TimeoutError, CancelledError) as exc:  # CommClosedError is an OSError
            raise _lost(where, exc) from None
        except Exception as exc:
            if client.status in ("closed", "closing", "connecting") or "scheduler" in type(exc).__name__.lower():
                raise _lost(where, exc) from None
            raise
        finally:
            try:
                client.close(timeout=5)
            except Exception:
                pass
            if cluster is not None:
                cluster.close()
    n = cands.num_rows
    if pdf.empty:
        return m_schema.empty_table(), g_schema.empty_table(), qsummary, n
    pdf = pdf.sort_values(["group_id", "trajectory_id"]).reset_index(drop=True)
    members = pa.Table.from_pandas(pdf[m_schema.names], schema=m_schema, preserve_index=False)
    gcols = [f"g_{c}" for c in g_schema.names]
    gdf = pdf[gcols].drop_duplicates("g_group_id").rename(columns=lambda c: c[2:])
    groups = pa.Table.from_pandas(gdf, schema=g_schema, preserve_index=False)
    return conform(members, m_schema), conform(groups, g_schema), qsummary, n


def _out_of_vocabulary(df: pd.DataFrame, vocab_size: int | None) -> np.ndarray:
    """Members holding a token id >= ``vocab_size`` (unrecorded max_token_id: not excluded)."""
    if vocab_size is None or "max_token_id" not in df:
        return np.zeros(len(df), bool)
    top = pd.to_numeric(df["max_token_id"], errors="coerce")
    return (top.notna() & (top >= vocab_size)).to_numpy(dtype=bool)
