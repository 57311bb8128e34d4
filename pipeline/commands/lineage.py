"""CLI: ``pipeline lineage CHECKPOINT_ID``: checkpoint -> snapshots -> trajectories -> versions."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import common

    p = common(sub.add_parser("lineage", help="what a checkpoint learned from: snapshots, trajectories, versions",
                              description="Walks checkpoint -> parent chain, snapshots -> member trajectories -> "
                                          "the policy/tokenizer/env/verifier versions they were produced with, "
                                          "and lists the OpenLineage events of the run."))
    p.add_argument("checkpoint_id", help="checkpoint id or policy version number")
    p.set_defaults(handler=_lineage)


def _lineage(args: argparse.Namespace) -> None:
    from pipeline.clikit import emit, open_lake
    from pipeline.lineage import format_walk, walk

    emit(walk(open_lake(args), args.checkpoint_id), args, format_walk)
