"""Stopping long commands and their children (docs/signals.md).

* SIGINT raises ``KeyboardInterrupt`` (Python's default); while a CLI command
  runs, SIGTERM raises :class:`Terminated` the same way (``sigterm_raises``),
  so ``finally`` blocks run: leases are released, children are stopped, and
  the CLI prints one line and exits 0 (SIGTERM) or 130 (SIGINT). Commands with
  a unit worth finishing (``train --follow``, ``admit --follow``) install their
  own handler that sets a flag, and stop between units.
* A child process never outlives its parent: ``child_argv`` starts it through
  ``python -m pipeline.procs PARENT_PID -- ARGV``, which asks the kernel for
  SIGKILL when the parent dies (``prctl(PR_SET_PDEATHSIG)``, kept across
  ``exec``), checks that the parent is still the one that started it, and
  ``exec``s the command (the parent must start it from its main thread: the
  kernel sends the signal when the forking thread ends). ``die_with_parent``
  does the same inside a Python child, or polls the parent pid from a watchdog
  thread where the launcher is not ours (training ranks under torchrun).
* ``stop_children`` forwards the parent's signal to its children, waits for
  them, and kills what is left (``deferred`` keeps a second signal from
  interrupting that).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator, Sequence

__all__ = ["Terminated", "sigterm_raises", "deferred", "child_argv", "die_with_parent", "stop_children",
           "exit_code", "signal_name"]


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as ``KeyboardInterrupt`` is for SIGINT
    (a BaseException: ``except Exception`` blocks do not swallow it)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_name(exc: BaseException) -> str:
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"


def exit_code(exc: BaseException) -> int:
    """0 for SIGTERM (a job runner's stop is not a failure), 130 for SIGINT."""
    return 0 if isinstance(exc, Terminated) else 130


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread (a no-op
    elsewhere: only the main thread may set handlers)."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def deferred() -> Iterator[list[int]]:
    """While inside, SIGTERM and SIGINT are only recorded (the list it yields):
    cleanup that stops children is not itself interrupted."""
    got: list[int] = []
    saved: list[tuple[int, Any]] = []
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            saved.append((sig, signal.signal(sig, lambda signum, frame: got.append(signum))))
    except ValueError:   # not the main thread
        pass
    try:
        yield got
    finally:
        for signum, previous in saved:
            signal.signal(signum, previous)


def child_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` started so that it dies with this process (see the module doc)."""
    return [sys.executable, "-m", "pipeline.procs", str(os.getpid()), "--", *argv]


def _pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent_pid: int, *, pdeathsig: bool = True, watchdog: bool = False, poll_s: float = 0.5) -> None:
    """Never outlive ``parent_pid``: SIGKILL from the kernel when it dies
    (``pdeathsig``, Linux: only for a child started by the parent's main thread,
    since the kernel sends it when the *thread* that forked the child ends), exit
    now if it is already gone, and (``watchdog``) a thread that polls the parent
    pid, for children of a parent that may start them from another thread, or
    kernels without the prctl."""
    if pdeathsig:
        _pdeathsig(signal.SIGKILL)
    if os.getppid() != parent_pid:          # it died before the prctl: we were reparented
        os.kill(os.getpid(), signal.SIGKILL)
    if watchdog:
        def watch() -> None:
            while True:
                if os.getppid() != parent_pid:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(poll_s)

        threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def stop_children(children: Sequence[subprocess.Popen], sig: int = signal.SIGTERM, *, timeout: float = 60.0,
                  ) -> list[int | None]:
    """Send ``sig`` to every child still running, wait up to ``timeout`` seconds for
    all of them, SIGKILL the rest and reap them. Returns their exit codes."""
    for p in children:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)
    deadline = time.monotonic() + timeout
    for p in children:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
    return [p.returncode for p in children]


def _exec_main(argv: list[str]) -> None:
    """``python -m pipeline.procs PARENT_PID -- ARGV...``: die with PARENT_PID, exec ARGV."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m pipeline.procs PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        sys.exit(2)
    die_with_parent(int(argv[0]))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    _exec_main(sys.argv[1:])
