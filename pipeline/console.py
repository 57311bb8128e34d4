"""What reaches the terminal besides a command's result: third-party noise
silenced (unless ``--verbose``) and progress bars on stderr.

Below every stage (it imports nothing of the package), so a stage or a worker
process uses it without reaching up to the CLI; ``pipeline.cli`` wraps every
handler in :func:`quiet_third_party`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Callable, Iterator

# Environment for quiet third-party libraries (also inherited by worker processes).
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore",
    "DS_LOG_LEVEL": "error",
    "DASK_LOGGING__DISTRIBUTED": "error",   # e.g. the shuffle plugin's WARNING lines on every admission
}
QUIET_LOGGERS = ("DeepSpeed", "deepspeed", "transformers", "vllm", "distributed", "dask", "torch",
                 "torch.distributed", "great_expectations", "openlineage", "urllib3", "filelock", "asyncio")


@contextlib.contextmanager
def progress_bar(total: int, desc: str, *, enabled: bool, lines_every_s: float | None = 10.0
                 ) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr for a long step (``enabled``: usually stderr is a
    terminal); yields ``advance(n)``. Not ``enabled`` (output piped: CI, a job's
    log), plain lines instead: one at the start, one at most every ``lines_every_s``
    and one at the end; ``lines_every_s=None`` yields None (silence)."""
    if total <= 0 or (not enabled and lines_every_s is None):
        yield None
        return
    if not enabled:
        yield from _progress_lines(total, desc, lines_every_s or 10.0)
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, file=sys.stderr, unit="step", leave=False, dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()


def _progress_lines(total: int, desc: str, every_s: float) -> Iterator[Callable[[int], None]]:
    import time

    t0 = time.monotonic()
    state = {"done": 0, "said": t0}
    print(f"{desc}: 0/{total} steps", file=sys.stderr, flush=True)

    def advance(n: int) -> None:
        state["done"] += n
        now = time.monotonic()
        if now - state["said"] >= every_s and state["done"] < total:
            state["said"] = now
            print(f"{desc}: {state['done']}/{total} steps ({state['done'] / total:.0%}, {now - t0:.0f}s)",
                  file=sys.stderr, flush=True)

    try:
        yield advance
    finally:
        print(f"{desc}: {state['done']}/{total} steps in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_third_party(verbose: bool) -> Iterator[None]:
    """Silence library logs, warnings and progress bars unless ``verbose``; undone on exit."""
    if verbose:
        yield
        return
    saved_env = {k: os.environ.get(k) for k in QUIET_ENV}
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    gate = _LevelGate(logging.ERROR)
    loggers = [logging.getLogger(n) for n in QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addFilter(gate)               # records logged on the logger itself, even if a library resets its level
        if lg.level < logging.ERROR:     # and its children (distributed.shuffle..., transformers.modeling_utils)
            lg.setLevel(logging.ERROR)
    tf_bars = None
    if "transformers" in sys.modules:       # imported before us (tests): flip its switch too
        try:
            from transformers.utils import logging as tf_logging

            tf_bars = tf_logging.is_progress_bar_enabled()
            tf_logging.disable_progress_bar()
        except Exception:
            tf_bars = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeFilter(gate)
            lg.setLevel(level)
        for k, old in saved_env.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old
        if tf_bars:
            from transformers.utils import logging as tf_logging

            tf_logging.enable_progress_bar()


class _LevelGate(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


def pipeline_command() -> str:
    """How to type ``pipeline`` in the shell this process was started from: ``pipeline``
    when that name on PATH is this interpreter's, else the script beside the interpreter
    (``.venv/bin/pipeline`` relative to the working directory when it is under it), else
    ``python -m pipeline``. A hint that prints bare ``pipeline`` to a shell without the
    venv activated gives "command not found"."""
    import shutil
    from pathlib import Path

    bindir = Path(sys.executable).parent
    script = bindir / "pipeline"
    on_path = shutil.which("pipeline")
    if on_path and script.exists() and Path(on_path).resolve() == script.resolve():
        return "pipeline"
    if script.exists():
        try:
            return str(Path(os.path.abspath(script)).relative_to(Path.cwd()))
        except ValueError:
            return str(script)
    return f"{sys.executable} -m pipeline"
