"""`pipeline ...`: parse, call one stage, print.

Each stage registers its subcommands in a light ``command`` module
(``pipeline/<stage>/command.py`` exposing ``register(subparsers)``); heavy
imports happen inside the handlers, so ``pipeline --help`` stays fast.
Every command takes ``--lake URI`` and ``--json``; a handler returns a dict
(printed as JSON with --json) or prints text itself and returns None.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from typing import Any, Callable

from pipeline import __version__
from pipeline.errors import PipelineError

# Stage command modules, in --help order. A module that does not exist yet is
# skipped (stages land one issue at a time); an error inside one is not.
COMMAND_MODULES = (
    "pipeline.demo_command",
    "pipeline.rollout.command",
    "pipeline.lake.command",
    "pipeline.admission.command",
    "pipeline.train.command",
    "pipeline.query.command",
    "pipeline.lineage_command",
    "pipeline.report.command",
    "pipeline.jobs_command",
    "pipeline.sim.command",
)


def common(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options every command takes."""
    parser.add_argument("--lake", default=None, metavar="URI",
                        help="lake root: a path or object-store URI (default: $PIPELINE_LAKE or ./lake)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE", help="YAML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key (repeatable)")


def emit(result: dict[str, Any] | None, args: argparse.Namespace, text: Callable[[dict[str, Any]], str] | None = None) -> None:
    if result is None:
        return
    if getattr(args, "json", False):
        print(json.dumps(result, default=str, sort_keys=True))
    elif text is not None:
        print(text(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeline",
        description="The trajectory lakehouse: agent RL rollouts -> admitted, immutable training "
                    "snapshots on Delta tables -> DeepSpeed training with lineage.",
    )
    parser.add_argument("--version", action="version", version=f"pipeline {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    try:
        result = args.handler(args)
    except PipelineError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": exc.message, "hint": exc.hint, "kind": type(exc).__name__}))
        else:
            print(f"error: {exc.message}", file=sys.stderr)
            if exc.hint:
                print(f"  hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if isinstance(result, int):
        return result
    return 0


def run() -> None:  # pragma: no cover
    """The console entry point. Exits without interpreter teardown: processes that
    used both deltalake and duckdb were seen to abort (SIGABRT, 'terminate called
    without an active exception') while native runtimes shut down, after all work
    was committed (shared/VERIFIED.md), which a job runner would read as a failure."""
    import logging
    import os

    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
