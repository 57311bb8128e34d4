"""CLI: ``pipeline train --batch-snapshot ID [--config FILE] [--set k=v] [--from-checkpoint ID] [--resume] [--nproc N]``
and the resident trainer ``pipeline train --follow [--stop-after N] [--idle-timeout S] [--nproc N]``."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import add_config_options, common
    from pipeline.config import keys_epilog
    from pipeline.train.config import TrainConfig

    keys = keys_epilog(TrainConfig)
    p = common(sub.add_parser(
        "train", help="train the policy on one snapshot with DeepSpeed; publish the next policy version",
        description="Trains on exactly the snapshot's own files (verified first), writes\n"
                    "<lake>/_checkpoints/<id>/ (DeepSpeed state, RNG, data cursor, config, hf/ export, 'latest' last)\n"
                    "and publishes it as the next policy version, with a metrics row per step and lineage.\n\n"
                    "--follow: the resident trainer. One long-lived process keeps model, optimizer and engine in\n"
                    "memory and trains, in admission order, every snapshot no published version consumed (those\n"
                    "waiting, then each new one), publishing weights per version and the full DeepSpeed state every\n"
                    "full_checkpoint_every versions and at shutdown. SIGTERM finishes the current version, writes the\n"
                    "full state and exits 0; after a crash it replays from the last full state, verifying every\n"
                    "replayed version's weight hash (docs/resident-trainer.md).",
        epilog=keys,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--batch-snapshot", metavar="ID", help="snapshot id (pipeline admit prints it), or a unique prefix of it (>= 6 characters)")
    what.add_argument("--follow", action="store_true",
                      help="resident trainer: train every unconsumed snapshot as it is admitted, until stopped")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="--follow: exit 0 after publishing N versions (replayed ones do not count)")
    p.add_argument("--idle-timeout", type=float, default=None, metavar="S",
                   help="--follow: exit 0 after S seconds without a snapshot to train (default: wait forever)")
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
    from pipeline.clikit import emit, note, open_lake
    from pipeline.config import load_config, parse_set
    from pipeline.errors import ConfigError
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    cfg = load_config(TrainConfig, args.config, parse_set(args.set))
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: must be >= 1")
    if args.follow:
        if args.resume or args.force:
            raise ConfigError("--resume and --force are --batch-snapshot options",
                              hint="--follow resumes by itself: it replays from the last full state")
        from pipeline.train.follow import follow

        fres = follow(open_lake(args), cfg, from_checkpoint=args.from_checkpoint, nproc=args.nproc,
                      stop_after=args.stop_after, idle_timeout_s=args.idle_timeout,
                      progress=False if args.no_progress else None,
                      on_version=None if args.json else lambda d: note(
                          result_text(d) + f"\n  {d['bytes_written'] / 1e6:.1f} MB written"
                          + (" (with the full DeepSpeed state)" if d["full_state"] else " (weights only)")))
        emit(fres.to_dict(), args, _follow_text)
        return EXIT_WORKER_EXIT if fres.worker_exit_codes and any(fres.worker_exit_codes) else None
    if args.stop_after is not None or args.idle_timeout is not None:
        raise ConfigError("--stop-after and --idle-timeout are --follow options")
    src = args.from_checkpoint
    from pipeline.snapshots.format import resolve_snapshot_id

    lake = open_lake(args)
    res = train_snapshot(lake, resolve_snapshot_id(lake, args.batch_snapshot), cfg, from_checkpoint=src,
                         resume=args.resume,
                         nproc=args.nproc, force=args.force, progress=False if args.no_progress else None)
    emit(res.to_dict(), args, result_text)
    if res.worker_exit_codes and any(res.worker_exit_codes):
        # the checkpoint was published and verified, but a process did not exit cleanly: say so, and let a
        # job runner see it (a rerun is a no-op: "already published")
        note(f"warning: checkpoint {res.checkpoint_id} was published, but the training processes exited with "
             f"{res.worker_exit_codes} (e.g. an abort while native runtimes shut down); see the output above")
        return EXIT_WORKER_EXIT
    return None


EXIT_WORKER_EXIT = 3   # published, but a training process did not exit cleanly (docs/reference/cli.md "Output and exit codes")


def result_text(r: dict) -> str:
    """The text output of a one-snapshot training run."""
    if r["already_published"]:
        head = (f"already published: checkpoint {r['checkpoint_id']} (policy version {r['policy_version']}) by "
                f"{r.get('published_by') or 'an earlier run'}")
    else:
        head = (f"checkpoint {r['checkpoint_id']} published as policy version {r['policy_version']} "
                f"({r['global_step']} step{'' if r['global_step'] == 1 else 's'}, {r['samples_seen']} samples, "
                f"{r['seconds']:.1f} s"
                + (f", resumed at step {r['resumed_from_step']}" if r["resumed_from_step"] is not None else "") + ")")
    m = r["metrics"]
    tail = (f"\n  loss {m.get('loss_first', float('nan')):.4f} -> {m.get('loss_last', float('nan')):.4f}, "
            f"reward {m.get('reward_mean') or 0:.3f}, padding {m.get('padding_ratio_mean') or 0:.1%}") if m.get("steps") else ""
    return head + tail + f"\n  {r['path']}"


def _follow_text(r: dict) -> str:
    full = len(r["full_state"])
    return (f"resident trainer stopped ({r['stopped_by']}) at policy version {r['head_policy_version']} "
            f"({r['head_checkpoint_id']}): {len(r['versions'])} version(s) published, {len(r['replayed'])} replayed, "
            f"{len(r['skipped'])} snapshot(s) skipped, {full} full state(s) written, {r['seconds']:.1f} s "
            f"(start-up {r['startup_seconds']:.1f} s)")
