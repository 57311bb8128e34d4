"""The line's lease: trainers on one lake run one at a time.

A training run (``pipeline train --batch-snapshot``) and the resident trainer
(``pipeline train --follow``) hold the lease ``train-line`` (pipeline/lake/lease.py:
put-if-absent generations, one holder among any number of racers, local and S3)
while they decide what to train, train and publish:

- a ``--batch-snapshot`` run that finds another run holding it waits for it, then
  decides on the table as that run left it (the result of running them one after
  the other: the same run again is "already published"); one that finds the
  resident trainer holding it is refused with one line naming it (the resident
  trainer trains every pending snapshot itself);
- a ``--follow`` that finds a ``--batch-snapshot`` run holding it waits for it;
  one that finds another resident trainer is refused (one resident trainer per line).

The holder renews the lease from a thread every ``TTL_S / 4``; a killed holder's
lease is free at once on its own host (its pid is gone) and after ``TTL_S``
elsewhere. The publication itself does not rely on the lease: of any number of
runs publishing one checkpoint id exactly one row lands (pipeline.policy_store).
Under a launcher other than ours (``deepspeed ... -m pipeline.train.worker``)
no lease is taken: its ranks cannot agree on one holder before training.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Literal

from pipeline.errors import ConflictError
from pipeline.policy_store.care import TRAIN_LINE_LEASE

if TYPE_CHECKING:
    from pipeline.lake.delta import Lake
    from pipeline.lake.lease import Lease

LINE_LEASE = TRAIN_LINE_LEASE       # also read by `lake maintain` (pipeline.policy_store.care)
TTL_S = 120.0
POLL_S = 1.0
Role = Literal["batch", "follow"]


class LineHeldError(ConflictError):
    """The line is held by a trainer this one must not wait for."""


@contextmanager
def hold_line(lake: Lake, role: Role, what: str) -> Iterator[Lease | None]:
    """Hold the line's lease for the body (see the module docstring); yields None
    inside processes started by a launcher (their parent holds it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        yield None
        return
    lease = _acquire(lake, role, what)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(lease, stop), daemon=True, name="train-line-lease")
    beat.start()
    try:
        yield lease
    finally:
        stop.set()
        beat.join(timeout=10)
        try:
            lease.release()
        except Exception:  # noqa: BLE001 - never mask the body's error; the lease then expires
            pass


def _acquire(lake: Lake, role: Role, what: str) -> Lease:
    from pipeline.lake.lease import describe_holder, try_acquire

    owner = f"pipeline train {'--follow' if role == 'follow' else '--batch-snapshot ' + what} " \
            f"({os.uname().nodename} pid {os.getpid()})"
    told = False
    while True:
        # pid_bound: a holder killed with -9 frees the line at once for a trainer on its host (the docstring's
        # promise; without it a restarted --follow was refused for TTL_S after a kill)
        lease, rec = try_acquire(lake, LINE_LEASE, owner=owner, ttl=TTL_S, info={"role": role, "pid_bound": True})
        if lease is not None:
            return lease
        held_by = describe_holder(LINE_LEASE, rec)
        if (rec or {}).get("role") == "follow":
            if role == "follow":
                raise LineHeldError(f"another resident trainer holds the line: {held_by}",
                                    hint="run one resident trainer per line; stop the other one first")
            raise LineHeldError(f"the resident trainer holds the line ({held_by}); it trains every pending "
                                "snapshot itself", hint="stop it (SIGTERM) before training a snapshot by hand")
        if not told:
            print(f"note: waiting for the training run that holds the line: {held_by}", file=sys.stderr)
            told = True
        time.sleep(POLL_S)


def _heartbeat(lease: Lease, stop: threading.Event) -> None:
    from pipeline.lake.lease import LeaseLostError

    while not stop.wait(TTL_S / 4):
        try:
            lease.renew()
        except LeaseLostError:
            print(f"warning: lost the line's lease {LINE_LEASE!r} (not renewed in time); another trainer may run "
                  "now (its publication of the same checkpoint id lands once)", file=sys.stderr)
            return
        except Exception:  # noqa: BLE001 - a store hiccup: try again at the next beat, before the ttl runs out
            continue
