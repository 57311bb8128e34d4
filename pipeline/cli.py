"""`pipeline ...`: parse, call one stage, print.

Each verb registers its parser in its own light module
(``pipeline/commands/<verb>.py`` exposing ``register(subparsers)``); heavy
imports happen inside the handlers, so ``pipeline --help`` stays fast.
Every command takes ``--lake URI``, ``--json`` and ``--verbose``; a handler
returns an int exit code or None, and writes its result with :func:`emit` /
:func:`out` (the only things that reach stdout). Those helpers, shared by
every verb, live in ``pipeline/clikit.py`` (re-exported here); this module is
the entry point: the parser, the exit codes of errors, the signals.

Output rules (docs/reference/cli.md "Output and exit codes"):

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
import json
import os
import re
import sys
from typing import Any, Iterator

from pipeline import __version__
from pipeline.clikit import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOTHING_DONE,
    EXIT_OK,
    EXIT_TRANSIENT,
    EXIT_USER_ERROR,
    add_config_options,
    clean_message,
    common,
    config_keys_epilog,
    config_overrides,
    emit,
    note,
    open_lake,
    out,
    plain,
    result_stream,
    set_given_lake,
    stdout_for_results,
    with_lake,
)
from pipeline.commands import VERBS
from pipeline.console import quiet_third_party
from pipeline.errors import DiskFullError, PipelineError, disk_full

# The helpers every verb shares live in pipeline/clikit.py (the verb modules import them from there); they stay
# importable from here, where they were documented first.
__all__ = [
    "COMMAND_MODULES", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_NOTHING_DONE", "EXIT_OK", "EXIT_TRANSIENT",
    "EXIT_USER_ERROR", "Parser", "add_config_options", "build_parser", "clean_message", "common",
    "config_keys_epilog", "config_overrides", "emit", "main", "note", "open_lake", "out", "plain", "result_stream",
    "run", "stdout_for_results", "with_lake",
]

# One module per verb (pipeline/commands/<verb>.py), in --help order.
COMMAND_MODULES = tuple(f"pipeline.commands.{verb}" for verb in VERBS)


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


def _error(exc: PipelineError, args: argparse.Namespace, code: int) -> None:
    message, hint = clean_message(exc.message), clean_message(exc.hint)
    lake = getattr(args, "lake", None)
    hint = with_lake(hint, lake) if hint else hint   # a hint suggests commands; the message may name a process
    if getattr(args, "json", False):
        try:
            out(json.dumps({"error": message, "hint": hint, "kind": type(exc).__name__, "exit_code": code}))
        except (BrokenPipeError, OSError):
            pass
    print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"  hint: {hint}", file=sys.stderr)


def _disk_full(exc: BaseException, args: argparse.Namespace) -> int:
    """One clear error for a full disk, whichever library hit it (no traceback)."""
    if getattr(args, "verbose", False):
        import traceback

        traceback.print_exception(exc)
    where = getattr(exc, "filename", None)
    _error(DiskFullError(f"no space left on the device{f' writing {where}' if where else ''} "
                         f"(lake {getattr(args, 'lake', None) or os.environ.get('PIPELINE_LAKE', './lake')}); "
                         "nothing was committed by the write that failed",
                         hint="free space on the lake's disk (or the cache / scratch directory), then rerun: "
                              "what already landed is not landed twice (--verbose shows the traceback)"),
           args, EXIT_TRANSIENT)
    return EXIT_TRANSIENT


# A Hydra-style override typed as a bare argument: `pipeline train train.lr=5e-5` (verl's and Hydra's
# habit) is `--set train.lr=5e-5`; KEY is a config key or SECTION.KEY.
_OVERRIDE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*=.*", re.S)


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parse_args``, except that on a command with config options (``--set``) the bare
    ``KEY=VALUE`` / ``SECTION.KEY=VALUE`` arguments are ``--set`` overrides, in order."""
    args, rest = parser.parse_known_args(argv)
    if rest and isinstance(getattr(args, "set", None), list):
        args.set += [a for a in rest if _OVERRIDE.fullmatch(a)]
        rest = [a for a in rest if not _OVERRIDE.fullmatch(a)]
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_OK
    verbose = bool(getattr(args, "verbose", False))
    set_given_lake(getattr(args, "lake", None))
    result: Any = None
    from pipeline.procs import Terminated, exit_code, sigterm_raises, signal_name

    try:
        with sigterm_raises(), quiet_third_party(verbose), _verbose_env(verbose), stdout_for_results():
            try:
                result = _run_handler(args)
            except BrokenPipeError:
                # the reader went away (`pipeline sql ... | head`): not an error of ours
                result = EXIT_OK
    except PipelineError as exc:
        if disk_full(exc):
            return _disk_full(exc, args)
        code = EXIT_TRANSIENT if exc.transient else exc.exit_code
        _error(exc, args, code)
        return code
    except (KeyboardInterrupt, Terminated) as exc:
        # SIGINT / SIGTERM (docs/signals.md): the unit in progress was abandoned, its children stopped
        # on the way out (finally blocks); one line, exit 130 / 0
        print(f"stopped by {signal_name(exc)}: pipeline {args.command} abandoned the work in progress "
              "(what it committed stays; rerunning continues from there)", file=sys.stderr, flush=True)
        return exit_code(exc)
    except OSError as exc:
        if disk_full(exc):
            return _disk_full(exc, args)
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
    except Exception as exc:   # a bug, not a user error: keep the traceback
        if disk_full(exc):
            return _disk_full(exc, args)
        return _internal_error()
    if isinstance(result, bool):
        return EXIT_OK
    if isinstance(result, int):
        return result
    return EXIT_OK


def _run_handler(args: argparse.Namespace) -> Any:
    """Call the command's handler; with --print-config, print the config it resolved instead of running."""
    if not getattr(args, "print_config", False):
        return args.handler(args)
    from pipeline import config as config_module

    config_module.PRINT_CONFIG = True
    try:
        args.handler(args)
    except config_module.ConfigPrinted as printed:
        tree = {printed.section: printed.resolved} if printed.section else printed.resolved
        if getattr(args, "json", False):
            out(json.dumps(tree, default=str, sort_keys=True))
        else:
            import yaml

            out(yaml.safe_dump(tree, sort_keys=True, default_flow_style=False).rstrip())
        return EXIT_OK
    finally:
        config_module.PRINT_CONFIG = False
    raise PipelineError("--print-config: this command resolved no config before finishing",
                        hint="report it: every command with --config should load its config first")


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
    os._exit are fixed at their source (docs/clean-exit.md). SIGTERM raises from
    the start (it exits 0, docs/signals.md); once the command is done, a late
    SIGTERM or SIGINT no longer changes its exit code."""
    import signal

    from pipeline.procs import Terminated, exit_code, sigterm_raises, signal_name

    try:
        with sigterm_raises():
            code = main()
    except (KeyboardInterrupt, Terminated) as exc:   # before main's own handling began (parsing the arguments)
        print(f"stopped by {signal_name(exc)} before the command started", file=sys.stderr, flush=True)
        code = exit_code(exc)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
