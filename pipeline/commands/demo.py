"""CLI: `pipeline demo [--iterations K] [--engine hf|vllm] [--mode sync|async]`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import add_config_options, common

    p = common(sub.add_parser(
        "demo", help="the closed loop: rollout -> admit -> train -> publish on arithmetic-tool, showing reward rise",
        description="Creates a lake and policy version 0, then runs K iterations of rollout -> admit -> train -> "
                    "publish, printing one line per iteration (policy version, trajectories, admitted / "
                    "zero-variance / stale / infra-failed groups, mean reward, held-out success, policy lag, "
                    "seconds). Without --lake it uses a fresh ./lake/demo-<time> directory.",
        # cli.Parser (the subparsers' parser_class) takes a callable epilog, run only when help is shown
        epilog=_keys,  # type: ignore[arg-type]
        formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--iterations", type=int, default=None, help="iterations K (default 6)")
    p.add_argument("--engine", choices=["hf", "vllm"], default=None, help="generation engine (default hf)")
    p.add_argument("--mode", choices=["sync", "async"], default=None, help="sync (default) or async")
    p.add_argument("--groups", type=int, default=None, help="groups per iteration (default 32)")
    p.add_argument("--seed", type=int, default=None, help="seed of the policy init, rollouts and training (default 0)")
    p.add_argument("--target-groups", type=int, default=None, metavar="N",
                   help="dynamic sampling: admitted groups wanted per iteration (sync; default: sample --groups once)")
    add_config_options(p)
    p.set_defaults(handler=_demo)


def _keys() -> str:
    from pipeline.config import keys_epilog
    from pipeline.demo import DemoConfig

    return keys_epilog(DemoConfig)


def _demo(args: argparse.Namespace):
    import json

    from pipeline.clikit import out
    from pipeline.config import load_config, parse_set, refuse_other_sections
    from pipeline.demo import DemoConfig, default_lake_uri, run_demo
    from pipeline.lake.delta import Lake

    overrides = parse_set(args.set)
    for key in ("iterations", "engine", "mode", "groups", "seed", "target_groups"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    refuse_other_sections(args.config, "demo", command="pipeline demo", hint=(
        "put the demo's keys under `demo:` (lr, epochs, max_policy_lag, groups, group_size, trackers, ...: "
        "`pipeline demo --help`), or run the stages with `pipeline rollout|admit|train --config FILE`"))
    cfg = load_config(DemoConfig, args.config, overrides)
    if cfg.engine == "vllm":    # before the warm start and the lake, not after them
        from pipeline.rollout.vllm_engine import require_vllm

        require_vllm()
    lake = Lake(args.lake or default_lake_uri())
    if lake.exists("checkpoints"):
        from pipeline.errors import PipelineError

        raise PipelineError(f"{lake.uri} already holds a policy; the demo starts from version 0",
                            hint="omit --lake (a fresh ./lake/demo-<time> is used) or pass an empty directory")
    summary = run_demo(lake, cfg, out=(lambda *a, **k: None) if args.json else _out)
    if args.json:
        out(json.dumps(summary, default=str))


def _out(*parts, **kw) -> None:
    from pipeline.clikit import out

    out(" ".join(str(p) for p in parts))
