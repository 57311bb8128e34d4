"""What every verb of the CLI shares: the common options, the output rules
(results on stdout, notes on stderr), the lake a command opens, the exit codes.

``pipeline/cli.py`` is the entry point (parse, call one verb's handler, turn
errors into exit codes); each ``pipeline/commands/<verb>.py`` registers its
parser and imports its helpers from here, so the verb modules never reach
back up to the entry point. ``pipeline.cli`` re-exports every public name
below (its import path stays as documented).

Output rules (docs/reference/cli.md "Output and exit codes"):

* stdout carries only the command's result; with ``--json`` exactly one JSON
  document. While a handler runs (:func:`stdout_for_results`), file
  descriptor 1 points at stderr, so a library that prints cannot corrupt the
  result; :func:`emit` / :func:`out` write to the saved real stdout.
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

from pipeline.errors import InputFileError, NotFoundError

if TYPE_CHECKING:  # deltalake is imported only where a lake is opened
    from pipeline.lake.delta import Lake

# The verbs, in ``pipeline --help`` order: one module each, pipeline/commands/<verb>.py (re-exported by
# pipeline.commands; declared here because the hints that suggest a command (with_lake) must know them).
VERBS = ("demo", "rollout", "policy", "ingest", "serve", "lake", "admit", "snapshots", "train", "sql", "lineage", "report",
         "jobs", "simulate")

# Exit codes (documented in docs/reference/cli.md "Output and exit codes").
EXIT_OK = 0
EXIT_NOTHING_DONE = 1     # the command ran but achieved nothing (every input row quarantined, a job failed)
EXIT_USER_ERROR = 2       # bad arguments, config, input; something named does not exist (argparse uses 2 too)
EXIT_TRANSIENT = 75       # may succeed when retried (a commit race, a flaky object store); EX_TEMPFAIL
EXIT_INTERNAL = 70        # a bug: unexpected exception, traceback printed; EX_SOFTWARE
EXIT_INTERRUPTED = 130

# Where results go while a handler runs (the real stdout); see stdout_for_results.
_RESULT: TextIO | None = None


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


def set_given_lake(lake: str | None) -> None:
    """Remember the --lake of the command that runs (None: the default) for :func:`with_lake`'s hints."""
    global _GIVEN_LAKE
    _GIVEN_LAKE = lake


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


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")


def clean_message(text: str | None) -> str | None:
    """An error message as the operator should see it: no terminal escape codes
    (some native libraries colour their errors), no trailing whitespace."""
    if text is None:
        return None
    return _ANSI.sub("", str(text)).strip()
