"""``pipeline rollout``: sample N groups of G trajectories and land them.

    pipeline rollout --env arithmetic-tool --engine hf --groups 32 --group-size 8 --seed 0
    pipeline rollout --env reverse-digits --engine vllm --policy 0 --groups 8 --workers 2

The run's parts: ``RolloutConfig`` (config.py; importable from here too), the worker (pipeline/rollout/worker.py,
with what it owes in plan.py and how it resumes in recovery.py), the run's
owner (owner.py) and its summary (summary.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from pipeline.config import config_dict
from pipeline.lake.ref import as_lake
from pipeline.procs import Terminated
from pipeline.rollout.config import RolloutConfig, check_config
from pipeline.rollout.owner import RunOwner, die_with_parent, parent_alive
from pipeline.rollout.summary import RolloutSummary, merge_summaries
from pipeline.rollout.worker import run_worker

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

__all__ = ["RolloutConfig", "check_config", "run_rollout"]   # RolloutConfig lives in config.py; its old path works


def _worker_main(lake_uri: str, cfg_dict: dict[str, Any], worker: int) -> dict[str, Any]:
    from pipeline.lake.delta import Lake

    cfg = RolloutConfig(**cfg_dict)
    return run_worker(Lake(lake_uri), cfg, worker, guard=parent_alive).as_dict(samples=True)


def run_rollout(lake: Lake | str | os.PathLike[str], cfg: RolloutConfig | None = None, **overrides: Any) -> RolloutSummary:
    """Sample ``cfg.groups`` groups of ``cfg.group_size`` and land them (see module doc)."""
    lake = as_lake(lake)
    if cfg is None:
        from pipeline.config import load_config

        cfg = load_config(RolloutConfig, None, overrides)
    elif overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    check_config(cfg)
    if cfg.engine == "vllm":   # one error here, not one per spawned worker
        from pipeline.rollout.vllm_engine import require_vllm

        require_vllm()
    if not cfg.run_id:
        cfg = dataclasses.replace(cfg, run_id=f"rollout-{cfg.seed}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}")
    from pipeline import lineage

    with lineage.rollout_run(lake, cfg) as run:
        summary = _run_rollout(lake, cfg)
        lineage.rollout_done(run, lake, summary)
    return summary


def _run_rollout(lake: Lake, cfg: RolloutConfig) -> RolloutSummary:
    import multiprocessing as mp

    def kill_workers() -> None:
        for p in mp.active_children():
            p.kill()

    owner = RunOwner(lake, cfg, on_lost=kill_workers)
    owner.acquire()
    try:
        from pipeline.rollout.spool import run_spool_dir, ship_all

        # recovery per run: whatever any former worker spooled is in the lake before anyone reads it
        if cfg.ingest_url:
            _ship_all_log(lake, cfg)
        else:
            ship_all(lake, run_spool_dir(lake, cfg), fsync=cfg.spool_fsync)
        owner.check()
        if cfg.workers == 1:
            return run_worker(lake, cfg, 0, guard=owner.check)
        return _run_pool(lake, cfg, owner)
    finally:
        owner.release()


def _ship_all_log(lake: Lake, cfg: RolloutConfig) -> None:
    """Publish what former workers spooled to the log, then wait until the committer landed
    everything ever published for this run (recovery reads the lake)."""
    from pathlib import Path

    from pipeline.landing import connect
    from pipeline.landing.committer import wait_committed
    from pipeline.rollout.spool import Spool, published_marks, run_spool_dir, ship_log, spool_worker_id

    spool_dir = run_spool_dir(lake, cfg)
    with connect(cfg.ingest_url, stream=cfg.ingest_stream) as door:
        for path in sorted(Path(spool_dir).glob("*.spool.jsonl")) if Path(spool_dir).is_dir() else []:
            worker_id = spool_worker_id(path)
            if worker_id is None:
                continue
            spool = Spool(spool_dir, worker_id, fsync=cfg.spool_fsync)
            try:
                ship_log(door, spool)
            finally:
                spool.close()
    wait_committed(lake, cfg.ingest_stream, published_marks(spool_dir))


def _run_pool(lake: Lake, cfg: RolloutConfig, owner: RunOwner) -> RolloutSummary:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from pipeline.errors import PipelineError

    t0 = time.perf_counter()
    # spawn: no forked torch/OpenMP state; a killed worker raises instead of hanging the pool
    with ProcessPoolExecutor(cfg.workers, mp_context=mp.get_context("spawn"), initializer=die_with_parent,
                             initargs=(os.getpid(), True, owner.valid_until, cfg.lease_s)) as pool:
        try:   # submit starts the worker processes: a signal there must stop them too
            futures = [pool.submit(_worker_main, lake.uri, config_dict(cfg), w) for w in range(cfg.workers)]
            parts = [f.result() for f in futures]
        except (KeyboardInterrupt, Terminated):
            # stopped (docs/signals.md): the workers abandon their waves (SIGTERM ends a worker at once; what it
            # spooled is shipped by the next run of this run id); the pool's exit must not wait for their runs
            _stop_workers(signal.SIGTERM)
            raise
        except BrokenProcessPool:
            owner.check()
            raise PipelineError(f"a rollout worker of run {cfg.run_id} died",
                                hint=f"rerun with --run-id {cfg.run_id} (any --workers) to resume: finished "
                                     "trajectories are kept, interrupted ones are completed from the spools "
                                     "and the lake") from None
    return merge_summaries(cfg, parts, time.perf_counter() - t0)


def _stop_workers(sig: int, timeout: float = 30.0) -> None:
    """Send ``sig`` to this process's worker processes, wait for them, kill the rest."""
    import multiprocessing as mp

    from pipeline.procs import deferred

    with deferred():
        workers = mp.active_children()
        for p in workers:
            if p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)
        deadline = time.monotonic() + timeout
        for p in workers:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
