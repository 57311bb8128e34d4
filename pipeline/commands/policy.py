"""`pipeline policy init | import | list | eval | repair | export`: policy versions."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import add_config_options, common, config_keys_epilog

    pol = sub.add_parser("policy", help="policy versions: init (version 0), import, list, eval, repair, export")
    psub = pol.add_subparsers(dest="policy_command", metavar="ACTION")
    i = common(psub.add_parser(
        "init", help="build the tokenizer + tiny Llama, warm-start it, publish policy version 0",
        description="Build the char tokenizer and a tiny Llama from PolicyInitConfig, run a short supervised\n"
                    "warm start on synthetic demonstrations (20-40 s on a CPU; a progress bar on a terminal),\n"
                    "save it in HF format under <lake>/_checkpoints/ and publish it as policy version 0.\n"
                    "Idempotent for the same config. Creates the lake if it does not exist.",
        epilog=lambda: config_keys_epilog("pipeline.rollout.policy", "PolicyInitConfig"), formatter_class=argparse.RawDescriptionHelpFormatter))
    i.add_argument("--seed", type=int, default=None, help="sets the seed key")
    i.add_argument("--warm-start-steps", type=int, default=None, help="sets the warm_start_steps key")
    i.add_argument("--if-missing", action="store_true",
                   help="do nothing when the lake already has a published policy (any version, e.g. imported): "
                        "the deployment's bootstrap step")
    add_config_options(i)
    i.set_defaults(handler=_init)
    im = common(psub.add_parser(
        "import", help="register a Hugging Face causal LM directory (or a GGUF file) as the next policy version",
        description="Copy a Hugging Face causal LM directory (config.json, *.safetensors, tokenizer files; any\n"
                    "architecture transformers loads, e.g. qwen2, llama) into <lake>/_checkpoints/ with the sha256\n"
                    "of every file and publish it as the next policy version (0 on an empty lake). The weights are\n"
                    "loaded as the config's architecture and run one forward pass first: a directory that fails\n"
                    "is refused and nothing is written. tokenizer_rev is the hash of the tokenizer's canonical\n"
                    "content (docs/how-to/own-model.md, Bring your own model). Idempotent for the same files.\n"
                    "--gguf FILE (needs the [gguf] extra) dequantizes a GGUF model to --dtype, writes it as a\n"
                    "safetensors directory with its tokenizer and chat template, and imports that.",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    src = im.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", metavar="DIR", help="the directory save_pretrained() wrote")
    src.add_argument("--gguf", metavar="FILE", help="a GGUF model file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)")
    im.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="with --gguf: the dtype the weights are dequantized to (default float32, the trainer's)")
    im.set_defaults(handler=_import)
    ls = common(psub.add_parser("list", help="published versions: origin (init/import/train) and tokenizer_rev"))
    ls.set_defaults(handler=_list)
    r = common(psub.add_parser(
        "repair", help="make damaged published versions load again (retire their damaged DeepSpeed state)",
        description="Rehash every published version's files against its checkpoints row (what rollout and the\n"
                    "trainer check before loading; `pipeline lake verify` reports the same). A version whose\n"
                    "damaged or missing files are all DeepSpeed state (ds/, rng/) gets that state retired, as\n"
                    "`lake maintain --keep-checkpoints` does (recorded in its retired.json with the reason): its\n"
                    "hf/ model verifies again, rollout loads it, and `train --follow` rebuilds the optimizer by\n"
                    "replay (or starts a fresh one). A version whose hf/ model is damaged cannot be repaired\n"
                    "here (exit 1): restore its files from a copy.",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    r.add_argument("--dry-run", action="store_true", help="report what would be retired; change nothing")
    r.set_defaults(handler=_repair)
    x = common(psub.add_parser(
        "export", help="write a published version's weights as a plain Hugging Face directory",
        description="Rebuild a published version's weights from its anchor and the sparse deltas after it\n"
                    "(docs/resident-trainer.md, section 3), check them against the digest its checkpoints row\n"
                    "recorded (a missing or modified delta is refused: nothing is written), and write them with\n"
                    "its config and tokenizer files to --out (model.safetensors): a directory transformers,\n"
                    "vLLM or `pipeline policy import` load.",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    x.add_argument("--version", required=True, metavar="N", help="policy version, checkpoint id or 'latest'")
    x.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory")
    x.set_defaults(handler=_export)
    e = common(psub.add_parser(
        "eval", help="greedy success on the environment's fixed held-out set",
        description="Greedy (temperature 0) episodes on the first N tasks of the environment's held-out split,\n"
                    "which training never sees; prints success, format and tool-use rates and success per\n"
                    "difficulty. --policy is a version number, checkpoint id or 'latest' of the lake, or a\n"
                    "local HF directory (then no lake is needed).",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    e.add_argument("--policy", default="latest", metavar="PATH_OR_VERSION",
                   help="policy version, checkpoint id, 'latest' (default) or an HF directory")
    e.add_argument("--env", default="arithmetic-tool", help="environment name or module:Class (default arithmetic-tool)")
    e.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="generation engine (default hf)")
    e.add_argument("--n", type=int, default=200, help="held-out tasks (default 200)")
    e.add_argument("--seed", type=int, default=0, help="seed of the held-out task sample (default 0)")
    e.add_argument("--samples", type=int, default=1, help="answers per task (1 = greedy); > 1 reports pass@k")
    e.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0 greedy, "
                   "1.0 with --samples > 1)")
    e.add_argument("--render", choices=["auto", "text", "chat"], default="auto",
                   help="chat: the environment's chat messages through the policy's chat template; text: the "
                        "<call>/<ans> protocol; auto (default): chat when the policy has a chat template")
    e.add_argument("--max-tokens-per-turn", type=int, default=16, help="tokens per model turn (default 16)")
    e.add_argument("--max-total-tokens", type=int, default=64, help="response tokens in total (default 64)")
    e.add_argument("--no-record", dest="record", action="store_false",
                   help="do not append the result to the evaluations table")
    e.set_defaults(handler=_eval)
    pol.set_defaults(handler=lambda a: pol.print_help())


def _init(args: argparse.Namespace) -> None:
    import sys

    from pipeline.clikit import config_overrides, emit, open_lake
    from pipeline.console import progress_bar
    from pipeline.config import load_config
    from pipeline.rollout.policy import PolicyInitConfig, init_policy

    cfg = load_config(PolicyInitConfig, args.config,
                      config_overrides(args, {"seed": "seed", "warm_start_steps": "warm_start_steps"}))
    lake = open_lake(args, create=True)
    if args.if_missing:
        from pipeline.policy_store import latest_policy_version, resolve_policy

        latest = latest_policy_version(lake)
        if latest is not None:
            ref = resolve_policy(lake, latest)
            out = {"checkpoint_id": ref.checkpoint_id, "policy_version": ref.policy_version,
                   "path": str(ref.hf_dir), "already_present": True}
            emit(out, args, lambda r: f"policy version {r['policy_version']} already published: "
                                      f"{r['checkpoint_id']} (nothing to do)")
            return
    with progress_bar(cfg.warm_start_steps, "warm start", enabled=sys.stderr.isatty()) as bar:
        ref = init_policy(lake, cfg, progress=bar)
    out = {"checkpoint_id": ref.checkpoint_id, "policy_version": ref.policy_version, "path": str(ref.hf_dir),
           "already_present": False}
    emit(out, args, lambda r: f"policy version {r['policy_version']}: {r['checkpoint_id']} ({r['path']})")


def _eval(args: argparse.Namespace) -> None:
    from pathlib import Path

    from pipeline.clikit import emit, open_lake
    from pipeline.errors import ConfigError
    from pipeline.rollout.evaluate import evaluate

    from pipeline.rollout.evaluate import record_evaluation

    if args.n < 1:
        raise ConfigError(f"--n {args.n}: must be >= 1")
    lake = None if Path(str(args.policy)).is_dir() else open_lake(args)
    r = evaluate(args.policy, args.env, n=args.n, seed=args.seed, engine=args.engine, lake=lake,
                 samples=args.samples, temperature=args.temperature, render=args.render,
                 max_tokens_per_turn=args.max_tokens_per_turn, max_total_tokens=args.max_total_tokens)
    if args.record and lake is not None:      # a plain HF directory evaluated without a lake: nothing to record
        r["eval_id"] = record_evaluation(lake, r, command="pipeline policy eval")["eval_id"]
    emit(r, args, lambda r: (
        f"{policy_label(r, args.policy)} on {r['env']} (held-out, "
        f"{'greedy' if r['samples'] == 1 else str(r['samples']) + ' samples'}, n={r['n']}): "
        f"success {r['success_rate']:.3f}, format {r['format_rate']:.3f}, tool use {r['tool_use_rate']:.3f}"
        + "".join(f", pass@{k} {v:.3f}" for k, v in r["pass_at_k"].items() if k > 1)
        + "".join(f"\n  {k}: {v:.3f}" for k, v in r["success_by_difficulty"].items())))


def policy_label(r: dict, policy: str) -> str:
    """``policy v3`` for a lake version; a local HF directory has no version (-1 in the result): its path."""
    version = r.get("policy_version")
    if version is None or version < 0:
        return f"policy {policy} (a local directory, not a lake version)"
    return f"policy v{version}"


def _import(args: argparse.Namespace) -> None:
    from contextlib import AbstractContextManager, nullcontext
    from typing import Any

    from pipeline.clikit import emit, open_lake
    from pipeline.policy_store import check_model_dir, converted_gguf, import_policy

    # check (and convert) first, open (create) the lake after: a refused model leaves no empty lake behind
    ctx: AbstractContextManager[tuple[Any, dict[str, Any], Any]]
    if args.gguf:
        ctx = converted_gguf(args.gguf, dtype=args.dtype)
    else:
        ctx = nullcontext((args.hf_dir, check_model_dir(args.hf_dir), None))
    with ctx as (hf_dir, checked, source):
        r = import_policy(open_lake(args, create=True), hf_dir, checked=checked, source=source)
    emit(r, args, lambda r: f"policy version {r['policy_version']}: {r['checkpoint_id']} ({r['model_type']}, "
                            f"tokenizer {r['tokenizer_rev']})" + (" already imported" if r["already_present"] else ""))


def _list(args: argparse.Namespace) -> None:
    from pipeline.clikit import emit, open_lake
    from pipeline.policy_store import list_policies

    rows = list_policies(open_lake(args))
    emit({"policies": rows}, args, lambda r: "\n".join(
        [f"{'version':>7}  {'origin':<6}  {'model':<8}  {'tokenizer_rev':<22}  checkpoint"]
        + [f"{x['policy_version']:>7}  {x['origin']:<6}  {str(x['model_type']):<8}  {str(x['tokenizer_rev']):<22}  "
           f"{x['checkpoint_id']}" for x in r["policies"]]))


def _repair(args: argparse.Namespace) -> int | None:
    from pipeline.clikit import EXIT_NOTHING_DONE, emit, open_lake
    from pipeline.policy_store.care import repair_checkpoints

    r = repair_checkpoints(open_lake(args), dry_run=args.dry_run)
    verb = "would retire" if args.dry_run else "retired"
    emit(r, args, lambda r: "\n".join(
        [f"policy version {x['policy_version']} ({x['checkpoint_id']}): {verb} its DeepSpeed state "
         f"({len(x['retired'])} files; damaged: {x['files'][:3]}); its hf/ model verifies" for x in r["repaired"]]
        + [f"policy version {x['policy_version']}: cannot repair: {x['reason']} (its model is damaged: restore "
           "the files from a copy)" for x in r["unrepairable"]]
        + ([f"ok: {r['checked']} published version(s), none damaged"] if not r["repaired"] and not r["unrepairable"]
           else [])))
    return EXIT_NOTHING_DONE if r["unrepairable"] else None


def _export(args: argparse.Namespace) -> int | None:
    from pathlib import Path

    from pipeline.clikit import emit, open_lake
    from pipeline.policy_store.delta import export_version

    r = export_version(open_lake(args), args.version, Path(args.out))
    emit(r, args, lambda r: f"policy version {r['policy_version']} ({r['checkpoint_id']}) -> {r['out']}: weights "
                            f"{r['weights_sha256'][:16]} rebuilt from {len(r['rebuilt_from'])} file set(s)")
    return None
