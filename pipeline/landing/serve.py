"""``pipeline serve``: the committer process. One lease per table
(``serve-<stream>-<table>`` in the lake's ``_locks``): a second process refuses
with one line, or waits as a standby until the lease is free. SIGTERM/SIGINT
flush what was pulled, ack it and exit 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pipeline.landing import wire
from pipeline.landing.committer import FlushReport, ServeSettings, TableCommitter, run_table
from pipeline.landing.log import ensure_stream

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake


def lease_name(stream: str, table: str) -> str:
    return f"serve-{stream}-{table}"


def take_leases(lake: Lake, s: ServeSettings, *, standby: bool, poll_s: float = 1.0,
                stop: threading.Event | None = None) -> list[Any]:
    """The leases of every table served; refuses (LeaseHeldError) or, as a standby, waits
    (until ``stop`` is set: then it returns what it holds, which the caller releases)."""
    from pipeline.lake.lease import LeaseHeldError, holder, try_acquire

    leases: list[Any] = []
    try:
        for table in s.tables:
            if stop is not None and stop.is_set():
                break
            name = lease_name(s.stream, table)
            while True:
                # pid-bound: a committer killed with -9 on this host frees its table at once (lake/liveness.py)
                got, _ = try_acquire(lake, name, owner=f"pipeline serve ({table})", ttl=s.lease_ttl_s,
                                     info={"pid_bound": True})
                if got is not None:
                    leases.append(got)
                    break
                if not standby:
                    raise LeaseHeldError(name, holder(lake, name))
                if stop is not None and stop.wait(poll_s):
                    break
                if stop is None:
                    time.sleep(poll_s)
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    return leases


def serve(lake: Lake, url: str, s: ServeSettings, *, standby: bool = False,
          on_flush: Callable[[FlushReport], None] | None = None, ready: Callable[[], None] | None = None,
          auth: dict[str, Any] | None = None, stop_event: threading.Event | None = None,
          ready_file: str | None = None) -> int:
    """Run the committers until SIGTERM/SIGINT (or ``stop_event``, set from another thread); returns the exit code.
    ``ready_file``: touched once serving and at every pull of every table (a readiness probe checks its
    age), removed on exit."""
    for t in s.tables:
        wire.subject(s.stream, t)          # refuses an unknown table before anything starts
    flag = stop_event or threading.Event()
    if threading.current_thread() is threading.main_thread():
        # a standby waiting for the lease stops on SIGTERM/SIGINT too (asyncio's handlers replace these later)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: flag.set())
    leases = take_leases(lake, s, standby=standby, stop=flag)
    if flag.is_set():
        for lease in leases:
            lease.release()
        return 0
    try:
        return asyncio.run(_serve(lake, url, s, leases, on_flush=on_flush, ready=ready, auth=auth or {},
                                  stop_event=flag, ready_file=ready_file))
    finally:
        if ready_file:
            Path(ready_file).unlink(missing_ok=True)
        for lease in leases:
            try:
                lease.release()
            except Exception:  # noqa: BLE001 - a lost lease is released already
                pass


async def _serve(lake: Lake, url: str, s: ServeSettings, leases: list[Any], *, on_flush: Any, ready: Any,
                 auth: dict[str, Any], stop_event: threading.Event | None = None,
                 ready_file: str | None = None) -> int:
    from pipeline.landing.log import nats_connect

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if stop_event is not None:
        _watch(stop_event, stop, loop)
    nc = await nats_connect(url, name="pipeline serve", **auth)
    try:
        js = nc.jetstream(timeout=10)
        await ensure_stream(js, s)
        committers = [TableCommitter(lake, t, stream=s.stream) for t in s.tables]
        renewers = [_renewer(lease, s.lease_ttl_s, ready_file) for lease in leases]
        tasks = [asyncio.create_task(run_table(js, c, s, stop, on_flush=on_flush, renew=r))
                 for c, r in zip(committers, renewers)]
        if ready_file:
            Path(ready_file).touch()
        if ready is not None:
            ready()
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise t.exception()  # type: ignore[misc]
        return 0
    finally:
        await nc.close()


def _watch(flag: threading.Event, stop: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
    """Set ``stop`` when another thread sets ``flag`` (serve run in a thread: tests, the benchmark)."""
    def wait() -> None:
        flag.wait()
        try:
            loop.call_soon_threadsafe(stop.set)
        except RuntimeError:    # the loop ended first
            pass
    threading.Thread(target=wait, daemon=True).start()


def _renewer(lease: Any, ttl: float, ready_file: str | None = None) -> Callable[[], None]:
    """Renew ``lease`` when a third of its ttl passed (LeaseLostError if taken over); touch ``ready_file``."""
    last = [time.monotonic()]

    def renew() -> None:
        if ready_file:
            Path(ready_file).touch()
        if time.monotonic() - last[0] >= ttl / 3:
            lease.renew()
            last[0] = time.monotonic()
    return renew


def check_reachable(url: str, auth: dict[str, Any] | None = None) -> None:
    """Connect once and close (ConfigError with one line when the log cannot be reached)."""
    from pipeline.landing.log import nats_connect

    async def probe() -> None:
        nc = await nats_connect(url, name="pipeline serve (probe)", attempts=2, **(auth or {}))
        await nc.close()
    asyncio.run(probe())


def print_flush(r: FlushReport) -> None:
    if r.messages:
        print(f"{r.table}: {r.messages} message(s), {r.rows_read} row(s): {r.landed} landed, {r.duplicates} "
              f"duplicate, {r.quarantined} quarantined, {r.skipped} message(s) landed before"
              + (f"; version {r.version} (sequence {r.txn_version})" if r.version is not None else ""),
              file=sys.stderr, flush=True)
