"""`pipeline ...`: parse, call one stage, print.

Each verb registers its parser in its own light module
(``pipeline/commands/<verb>.py`` exposing ``register(subparsers)``); heavy
imports happen inside the handlers, so ``pipeline --help`` stays fast.
Every command takes ``--lake URI``, ``--json`` and ``--verbose``; a handler
returns an int exit code or None, and writes its result with :func:`emit` /
:func:`out` (the only things that reach stdout).

Output rules (README "Exit codes and output"):

* stdout carries only the command's result; with ``--json`` exactly one JSON
  document. While a handler runs, file descriptor 1 points at stderr, so a
  library that prints (DeepSpeed's accelerator warning, a child process)
  cannot corrupt the result.
* Third-party noise (DeepSpeed, transformers progress bars, vLLM, dask and
  Python warnings) is silenced unless ``--verbose``.
* A user error is one ``error:`` line (+ ``hint:``) on stderr and exit code 2,
  never a traceback; an unexpected exception prints its traceback and exits 70.
* Read commands on a lake that does not exist fail and create nothing
  (:func:`open_lake`); write commands create it and say so on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TextIO

from pipeline import __version__
from pipeline.commands import VERBS
from pipeline.errors import InputFileError, NotFoundError, PipelineError

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

# Exit codes (documented in README "Exit codes and output").
EXIT_OK = 0
EXIT_NOTHING_DONE = 1     # the command ran but achieved nothing (every input row quarantined, a job failed)
EXIT_USER_ERROR = 2       # bad arguments, config, input; something named does not exist (argparse uses 2 too)
EXIT_TRANSIENT = 75       # may succeed when retried (a commit race, a flaky object store); EX_TEMPFAIL
EXIT_INTERNAL = 70        # a bug: unexpected exception, traceback printed; EX_SOFTWARE
EXIT_INTERRUPTED = 130

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

# Where results go while a handler runs (the real stdout); see stdout_for_results.
_RESULT: TextIO | None = None

# One module per verb (pipeline/commands/<verb>.py), in --help order.
COMMAND_MODULES = tuple(f"pipeline.commands.{verb}" for verb in VERBS)


def common(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options every command takes."""
    parser.add_argument("--lake", default=None, metavar="URI",
                        help="lake root: a path or object-store URI (default: $PIPELINE_LAKE or ./lake)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="show third-party library logs, warnings and progress bars (silenced by default)")
    return parser


def result_stream() -> TextIO:
    """The stream results go to: the real stdout, also while fd 1 is pointed at stderr."""
    return _RESULT if _RESULT is not None else sys.stdout


def out(text: str = "", *, flush: bool = True) -> None:
    """Print one line of a command's result (stdout)."""
    print(text, file=result_stream(), flush=flush)


def note(text: str) -> None:
    """A message for the operator that is not the result (stderr)."""
    print(text, file=sys.stderr, flush=True)


def open_lake(args_or_uri: argparse.Namespace | str | None, *, create: bool = False, check_layout: bool = True):
    """The command's lake. ``create=False`` (read commands): a lake that does not
    exist is a NotFoundError and nothing is created. ``create=True`` (write
    commands): a missing local lake is created, and the operator is told.
    ``check_layout``: a lake written by an earlier version is an error saying to
    run ``pipeline lake migrate`` (pipeline.lake.migrate.require_current)."""
    lake = _open_lake(args_or_uri, create=create)
    if check_layout:
        from pipeline.lake.migrate import require_current

        require_current(lake)
    return lake


def _open_lake(args_or_uri: argparse.Namespace | str | None, *, create: bool):
    from pipeline.lake.delta import Lake, resolve_lake_uri

    raw = getattr(args_or_uri, "lake", args_or_uri) if not isinstance(args_or_uri, str) else args_or_uri
    uri = resolve_lake_uri(raw)
    hint = ("check --lake (or $PIPELINE_LAKE); `pipeline ingest`, `pipeline rollout`, `pipeline policy init` "
            "and `pipeline demo` create a lake")
    if "://" not in uri:
        path = Path(uri)
        if path.exists() and not path.is_dir():
            raise InputFileError(f"lake {uri} is a file, not a lake directory", hint=hint)
        if not path.exists():
            if not create:
                raise NotFoundError(f"lake {uri} does not exist", hint=hint)
            lake = Lake(uri)
            note(f"created lake {uri}")
            return lake
        return Lake(uri)
    lake = Lake(uri)
    if not create and not _remote_lake_exists(lake):
        raise NotFoundError(f"lake {uri} does not exist (nothing under that prefix)", hint=hint)
    return lake


def _remote_lake_exists(lake: Lake) -> bool:
    import pyarrow.fs as pafs

    try:
        fs, root = lake.filesystem()
        root = root.split("://", 1)[-1]
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=False, allow_not_found=True))
    except Exception:   # cannot list (permissions, endpoint): let the command itself report
        return True
    return bool(infos)


@contextlib.contextmanager
def progress_bar(total: int, desc: str, *, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr for a long step (``enabled``: usually stderr is a
    terminal); yields ``advance(n)``, or None when disabled."""
    if not enabled or total <= 0:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, file=sys.stderr, unit="step", leave=False, dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()


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


@contextlib.contextmanager
def stdout_for_results() -> Iterator[TextIO]:
    """While the handler runs, stdout (Python's and file descriptor 1, which child
    processes inherit) points at stderr; results go to the saved real stdout."""
    global _RESULT
    real = sys.stdout
    saved_fd = None
    try:
        fd = real.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        fd = None
    result = real
    try:
        os.fstat(1)
        os.fstat(2)
        fds_ok = True
    except OSError:
        fds_ok = False
    if fds_ok:
        with contextlib.suppress(OSError, ValueError):
            real.flush()
        saved_fd = os.dup(1)
        os.dup2(2, 1)
        if fd == 1:   # results must reach the real stdout, which fd 1 no longer is
            result = open(saved_fd, "w", closefd=False, encoding=getattr(real, "encoding", None) or "utf-8",
                          errors="replace", newline=None)
    prev = _RESULT
    _RESULT = result
    sys.stdout = sys.stderr
    try:
        yield result
    finally:
        sys.stdout = real
        _RESULT = prev
        try:
            result.flush()
        except (BrokenPipeError, OSError, ValueError):
            # the reader went away (`| head`): drop what is buffered instead of failing again later
            if saved_fd is not None:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, saved_fd)
                os.close(devnull)
                with contextlib.suppress(OSError, ValueError):
                    result.flush()
        if saved_fd is not None:
            sys.stderr.flush()
            os.dup2(saved_fd, 1)
            os.close(saved_fd)


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE", help="YAML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key (repeatable)")


def config_keys_epilog(module: str, cls: str) -> str:
    """The ``--help`` epilog listing the config keys of ``module.cls`` (imported only when help is shown)."""
    from pipeline.config import keys_epilog

    return keys_epilog(getattr(importlib.import_module(module), cls))


def config_overrides(args: argparse.Namespace, mapping: dict[str, str]) -> dict[str, Any]:
    """``--set k=v`` overrides plus the dedicated flags: ``mapping`` is {args attribute: config key};
    a flag left at None does not override."""
    from pipeline.config import parse_set

    out = parse_set(getattr(args, "set", []))
    for attr, key in mapping.items():
        v = getattr(args, attr, None)
        if v is not None:
            out[key] = v
    return out


def emit(result: dict[str, Any] | None, args: argparse.Namespace, text: Callable[[dict[str, Any]], str] | None = None) -> None:
    """Write the command's result: one JSON document with --json, else ``text(result)``
    (or ``key: value`` lines)."""
    if result is None:
        return
    if getattr(args, "json", False):
        out(json.dumps(result, default=str, sort_keys=True))
    elif text is not None:
        out(text(result))
    else:
        for k, v in result.items():
            out(f"{k}: {plain(v)}")


def plain(v: Any) -> str:
    """A value for text output: mappings as ``k=v, ...``, sequences comma-separated
    (never a Python dict/list repr)."""
    if isinstance(v, dict):
        return ", ".join(f"{k}={plain(x)}" for k, x in v.items()) or "-"
    if isinstance(v, (list, tuple)):
        return ", ".join(plain(x) for x in v) or "-"
    if v is None:
        return "-"
    return str(v)


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose ``epilog`` may be a callable, evaluated only when help
    is shown (key tables that need a stage's config class stay off the start-up path)."""

    @property
    def epilog(self) -> str | None:
        e = self.__dict__.get("_epilog")
        return e() if callable(e) else e

    @epilog.setter
    def epilog(self, value: Any) -> None:
        self.__dict__["_epilog"] = value


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="pipeline",
        description="The trajectory lakehouse: agent RL rollouts -> admitted, immutable training "
                    "snapshots on Delta tables -> DeepSpeed training with lineage.",
    )
    parser.add_argument("--version", action="version", version=f"pipeline {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    _describe_all(parser)
    return parser


def _describe_all(parser: argparse.ArgumentParser) -> None:
    """Every command's --help starts with what it does: a subcommand without its own
    description gets its one-line help as description."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                h = helps.get(name)
                if not sub.description and h:
                    sub.description = h[:1].upper() + h[1:] + "."
                _describe_all(sub)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")


def clean_message(text: str | None) -> str | None:
    """An error message as the operator should see it: no terminal escape codes
    (some native libraries colour their errors), no trailing whitespace."""
    if text is None:
        return None
    return _ANSI.sub("", str(text)).strip()


def _error(exc: PipelineError, args: argparse.Namespace, code: int) -> None:
    message, hint = clean_message(exc.message), clean_message(exc.hint)
    if getattr(args, "json", False):
        try:
            out(json.dumps({"error": message, "hint": hint, "kind": type(exc).__name__, "exit_code": code}))
        except (BrokenPipeError, OSError):
            pass
    print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"  hint: {hint}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_OK
    verbose = bool(getattr(args, "verbose", False))
    result: Any = None
    try:
        with quiet_third_party(verbose), _verbose_env(verbose), stdout_for_results():
            try:
                result = args.handler(args)
            except BrokenPipeError:
                # the reader went away (`pipeline sql ... | head`): not an error of ours
                result = EXIT_OK
    except PipelineError as exc:
        code = EXIT_TRANSIENT if exc.transient else exc.exit_code
        _error(exc, args, code)
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        if exc.filename is None:   # not about a path the operator gave: treat as a bug
            return _internal_error()
        if verbose:
            import traceback

            traceback.print_exc()
        # a path the operator gave cannot be written or read (permissions, a missing directory, a full disk)
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        _error(PipelineError(f"{where}: {exc.strerror or exc}", hint="check the path and its permissions "
                                                                      "(--verbose shows the traceback)"),
               args, EXIT_USER_ERROR)
        return EXIT_USER_ERROR
    except Exception:   # a bug, not a user error: keep the traceback
        return _internal_error()
    if isinstance(result, bool):
        return EXIT_OK
    if isinstance(result, int):
        return result
    return EXIT_OK


@contextlib.contextmanager
def _verbose_env(verbose: bool) -> Iterator[None]:
    """PIPELINE_VERBOSE=1 while a --verbose command runs: worker processes (training ranks) follow it."""
    if not verbose:
        yield
        return
    before = os.environ.get("PIPELINE_VERBOSE")
    os.environ["PIPELINE_VERBOSE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PIPELINE_VERBOSE", None)
        else:
            os.environ["PIPELINE_VERBOSE"] = before


def _internal_error() -> int:
    import traceback

    traceback.print_exc()
    print("internal error (a bug): please report it with the traceback above", file=sys.stderr)
    return EXIT_INTERNAL


def run() -> None:  # pragma: no cover
    """The console entry point. Exits normally, so atexit handlers (OpenLineage's
    client, loggers) run; the teardown aborts that once made this end with
    os._exit are fixed at their source (docs/clean-exit.md)."""
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    run()
