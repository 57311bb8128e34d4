"""`pipeline ...`: parse, call one stage, print.

Each verb registers its parser in its own light module
(``pipeline/commands/<verb>.py`` exposing ``register(subparsers)``); heavy
imports happen inside the handlers, so ``pipeline --help`` stays fast.
Every command takes ``--lake URI``, ``--json`` and ``--verbose``; a handler
returns an int exit code or None, and writes its result with :func:`emit` /
:func:`out` (the only things that reach stdout).

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
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TextIO

from pipeline import __version__
from pipeline.commands import VERBS
from pipeline.console import quiet_third_party
from pipeline.errors import DiskFullError, InputFileError, NotFoundError, PipelineError, disk_full

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

# Exit codes (documented in docs/reference/cli.md "Output and exit codes").
EXIT_OK = 0
EXIT_NOTHING_DONE = 1     # the command ran but achieved nothing (every input row quarantined, a job failed)
EXIT_USER_ERROR = 2       # bad arguments, config, input; something named does not exist (argparse uses 2 too)
EXIT_TRANSIENT = 75       # may succeed when retried (a commit race, a flaky object store); EX_TEMPFAIL
EXIT_INTERNAL = 70        # a bug: unexpected exception, traceback printed; EX_SOFTWARE
EXIT_INTERRUPTED = 130

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


# The --lake the operator gave to the running command (None: the default), for the commands hints suggest.
_GIVEN_LAKE: str | None = None
_GROUP_VERBS = ("snapshots", "lake", "policy", "jobs")   # verbs whose first word after them is an action
_SUGGESTED = re.compile(r"\bpipeline ((?:%s) [a-z][a-z-]*|%s)\b" % (
    "|".join(_GROUP_VERBS), "|".join(v for v in VERBS if v not in _GROUP_VERBS)))


def with_lake(text: str, lake: str | None = None) -> str:
    """``text`` with ``--lake URI`` added to every ``pipeline VERB ...`` command it suggests, when the operator
    gave a --lake (a hint to run ``pipeline snapshots list`` must list the same lake's snapshots)."""
    lake = lake if lake is not None else _GIVEN_LAKE
    if not lake or not text:
        return text
    import shlex

    flag = f" --lake {shlex.quote(lake)}"

    def add(m: re.Match[str]) -> str:
        rest = text[m.end():m.end() + 200].split("\n", 1)[0]
        return m.group(0) if "--lake" in rest else m.group(0) + flag

    return _SUGGESTED.sub(add, text)


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
        from pipeline.lake.uri import split_uri

        fs, root = lake.filesystem()
        root = split_uri(root)[1]
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=False, allow_not_found=True))
    except Exception:   # cannot list (permissions, endpoint): let the command itself report
        return True
    return bool(infos)


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
                        help="override one config key (repeatable); KEY or SECTION.KEY (train.lr=1e-4)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults <- --config <- --set) and exit without running")


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
    global _GIVEN_LAKE
    _GIVEN_LAKE = getattr(args, "lake", None)
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
