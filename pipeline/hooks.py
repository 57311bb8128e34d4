"""The handshake of the test hooks: a process at a named point of its work
says so with a marker file, then waits for the test's ``go`` file.

Race and kill drills (tests/) set an environment variable naming a directory
or a marker path; the code under test calls :func:`mark_and_wait` at the
point the drill is about (the commit point of a snapshot publication, an
admission about to commit, a dask read task), so the test can line two
processes up at that point, or kill one there. Without the variable the
hooks do nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def mark_and_wait(marker: str | os.PathLike[str], go: str | os.PathLike[str], *, text: str = "",
                  timeout_s: float | None, poll_s: float, atomic: bool = False) -> None:
    """Write ``text`` to ``marker``, then wait until the file ``go`` exists or ``timeout_s`` passed (None: wait
    for ever, until the test kills the process). ``atomic``: the marker appears whole or not at all (written
    beside it, then renamed), for a test that reads it."""
    marker = Path(marker)
    if atomic:
        tmp = Path(f"{marker}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, marker)
    else:
        marker.write_text(text)
    go = Path(go)
    deadline = None if timeout_s is None else time.time() + timeout_s
    while not go.exists() and (deadline is None or time.time() < deadline):
        time.sleep(poll_s)
