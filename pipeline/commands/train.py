"""CLI: ``pipeline train --batch-snapshot ID [--config FILE] [--set k=v] [--from-checkpoint ID] [--resume] [--nproc N]``."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.cli import add_config_options, common
    from pipeline.config import keys_epilog
    from pipeline.train.config import TrainConfig

    keys = keys_epilog(TrainConfig)
    p = common(sub.add_parser(
        "train", help="train the policy on one snapshot with DeepSpeed; publish the next policy version",
        description="Trains on exactly the snapshot's own files (verified first), writes\n"
                    "<lake>/_checkpoints/<id>/ (DeepSpeed state, RNG, data cursor, config, hf/ export, 'latest' last)\n"
                    "and publishes it as the next policy version, with a metrics row per step and lineage.",
        epilog=keys,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--batch-snapshot", required=True, metavar="ID", help="snapshot id (pipeline admit prints it), or a unique prefix of it (>= 6 characters)")
    add_config_options(p)
    p.add_argument("--from-checkpoint", default=None, metavar="ID",
                   help="start from this checkpoint id, policy version or HF directory (default: newest published)")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run of this snapshot/parent/config (error if there is none)")
    p.add_argument("--nproc", type=int, default=1, metavar="N", help="processes (torchrun; gloo on CPU, nccl on GPUs)")
    p.add_argument("--force", action="store_true", help="train even if a published checkpoint already consumed the snapshot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int | None:
    from pipeline.cli import emit, note, open_lake
    from pipeline.config import load_config, parse_set
    from pipeline.errors import ConfigError
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    cfg = load_config(TrainConfig, args.config, parse_set(args.set))
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: must be >= 1")
    src = args.from_checkpoint
    from pipeline.snapshots.format import resolve_snapshot_id

    lake = open_lake(args)
    res = train_snapshot(lake, resolve_snapshot_id(lake, args.batch_snapshot), cfg, from_checkpoint=src,
                         resume=args.resume,
                         nproc=args.nproc, force=args.force, progress=False if args.no_progress else None)
    emit(res.to_dict(), args, _text)
    if res.worker_exit_codes and any(res.worker_exit_codes):
        # the checkpoint was published and verified, but a process did not exit cleanly: say so, and let a
        # job runner see it (a rerun is a no-op: "already published")
        note(f"warning: checkpoint {res.checkpoint_id} was published, but the training processes exited with "
             f"{res.worker_exit_codes} (e.g. an abort while native runtimes shut down); see the output above")
        return EXIT_WORKER_EXIT
    return None


EXIT_WORKER_EXIT = 3   # published, but a training process did not exit cleanly (README "Exit codes")


def _text(r: dict) -> str:
    if r["already_published"]:
        head = f"already published: checkpoint {r['checkpoint_id']} (policy version {r['policy_version']})"
    else:
        head = (f"checkpoint {r['checkpoint_id']} published as policy version {r['policy_version']} "
                f"({r['global_step']} step{'' if r['global_step'] == 1 else 's'}, {r['samples_seen']} samples, "
                f"{r['seconds']:.1f} s"
                + (f", resumed at step {r['resumed_from_step']}" if r["resumed_from_step"] is not None else "") + ")")
    m = r["metrics"]
    tail = (f"\n  loss {m.get('loss_first', float('nan')):.4f} -> {m.get('loss_last', float('nan')):.4f}, "
            f"reward {m.get('reward_mean') or 0:.3f}, padding {m.get('padding_ratio_mean') or 0:.1%}") if m.get("steps") else ""
    return head + tail + f"\n  {r['path']}"
