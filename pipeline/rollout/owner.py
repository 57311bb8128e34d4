"""One owner per run. ``run_rollout`` holds a lease in the lake
(``rollout-<run_id>`` in pipeline/lake/lease.py, the jobs' lease: put-if-absent
generations, renewed in the background); a second invocation with the same ``run_id`` refuses while
it is fresh and naming its owner, and takes the run over once it expired (at
once when the owner provably died on this host). Workers die with the owner:
a parent-death signal (``prctl(PR_SET_PDEATHSIG)`` on Linux) plus a watchdog
thread that polls the parent pid (for kernels or sandboxes without it), so no
worker of a dead owner works beside the next one.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.lake.lease import Lease
    from pipeline.rollout.config import RolloutConfig


WATCHDOG_S = 0.5
_PARENT: int | None = None
_LEASE: tuple[Any, float] | None = None     # (the owner's shared "lease valid until", lease_s)


def die_with_parent(parent_pid: int, pdeathsig: bool = True, valid_until=None, lease_s: float = 0.0) -> None:
    """Worker-process initializer: never outlive the run's owner. The kernel sends
    SIGKILL when the parent dies (PR_SET_PDEATHSIG, Linux); a watchdog thread
    polling the parent pid covers kernels and sandboxes without it and the window
    before the prctl (a parent that died first leaves us reparented).
    ``valid_until``: the owner's lease expiry in shared memory, moved on by each
    renewal; the worker stops writing when it runs low (an owner that is alive
    but stalled, e.g. SIGSTOPped, whose lease another invocation may take)."""
    import signal
    import threading

    global _PARENT, _LEASE
    _PARENT = parent_pid
    _LEASE = (valid_until, lease_s) if valid_until is not None else None
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(WATCHDOG_S)

    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="owner-watchdog", daemon=True).start()


def parent_alive() -> None:
    from pipeline.errors import ConflictError

    if _PARENT is not None and os.getppid() != _PARENT:
        raise ConflictError("the run's owner is gone; this worker stops writing")
    if _LEASE is not None and not _lease_fresh(_LEASE[0].value, _LEASE[1]):
        raise ConflictError("the run's owner has not renewed its lease in time; this worker stops writing")


def _lease_fresh(valid_until: float, lease_s: float) -> bool:
    """Fresh while at least a quarter of the lease is left (renewals come every
    quarter, so one missed renewal is tolerated, two are not)."""
    return time.time() < valid_until - lease_s / 4


def _lock_name(run_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)


class RunOwner:
    """The run lease (``rollout-<run_id>``, pipeline/lake/lease.py): taken before anything is
    written, renewed by a background thread every ``lease_s / 4``, released at
    the end. Losing it (the owner stalled past its lease and another invocation
    took the run over) calls ``on_lost`` and makes ``check`` raise."""

    def __init__(self, lake: Lake, cfg: RolloutConfig, on_lost=None) -> None:
        import multiprocessing as mp
        import threading

        self.lake, self.cfg = lake, cfg
        self.name = f"rollout-{_lock_name(cfg.run_id)}"[:200]
        self.lease: Lease | None = None
        self.on_lost = on_lost
        self.lost = False
        # the lease's expiry as last written, shared with the worker processes (guard)
        self.valid_until = mp.get_context("spawn").RawValue("d", 0.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        import threading

        from pipeline.errors import ConflictError
        from pipeline.lake.lease import try_acquire

        self.lease, held = try_acquire(
            self.lake, self.name, ttl=self.cfg.lease_s,
            owner=f"pipeline rollout pid {os.getpid()} on {socket.gethostname()} ({self.cfg.workers} workers)",
            info={"run_id": self.cfg.run_id, "workers": self.cfg.workers, "pid_bound": True})
        if self.lease is None:
            held = held or {}
            left = float(held.get("expires", time.time())) - time.time()
            raise ConflictError(
                f"run {self.cfg.run_id} is owned by a live `pipeline rollout`: pid {held.get('pid', '?')} on host "
                f"{held.get('host', '?')} ({held.get('workers', '?')} workers); its lease runs {max(0, left):.0f}s "
                "more and is renewed while it runs",
                hint="two owners would run the same actions twice: wait for it to finish, or stop that process "
                     f"(its workers stop with it) and rerun; a dead owner's lease is taken over once it expires "
                     f"(lease_s={self.cfg.lease_s:g}), at once when it ran on this host")
        self.valid_until.value = self.lease.expires
        self._thread = threading.Thread(target=self._beat, args=(self.lease,), name="run-lease", daemon=True)
        self._thread.start()

    def _beat(self, lease: Lease) -> None:
        from pipeline.lake.lease import LeaseLostError

        renewed = time.monotonic()
        while not self._stop.wait(self.cfg.lease_s / 4):
            try:
                lease.renew()
                ok = True
            except LeaseLostError:
                ok = False
            except Exception:  # noqa: BLE001 - a flaky store: try again at the next beat, while the lease lasts
                ok = time.monotonic() - renewed < self.cfg.lease_s * 0.75
            else:
                renewed = time.monotonic()
                self.valid_until.value = lease.expires
            if not ok:
                self.lost = True
                if self.on_lost is not None:
                    self.on_lost()
                return

    def check(self) -> None:
        from pipeline.errors import ConflictError

        if self.lost or not _lease_fresh(self.valid_until.value, self.cfg.lease_s):
            raise ConflictError(f"run {self.cfg.run_id}: this process lost its lease or could not renew it in time "
                                f"(stalled for about lease_s={self.cfg.lease_s:g}s); another owner may take the run "
                                "over, so it stops", hint="raise lease_s if the machine or the store stalls that long")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lease is not None and not self.lost:
            self.lease.release()        # a no-op when it is no longer ours
