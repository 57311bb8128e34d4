"""`pipeline rollout ...`: run rollout workers for an environment and land trajectories + events."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from pipeline.clikit import add_config_options, common, config_keys_epilog

    p = common(sub.add_parser(
        "rollout", help="run rollout workers for an environment and land trajectories + events",
        description="Sample N groups of G trajectories from a policy on a verifiable environment; land\n"
                    "trajectories and events in the lake with exactly-once batches. Rerun with the same\n"
                    "--run-id to resume a crashed run. Creates the lake if it does not exist.\n"
                    "Options below override the config key of the same name.",
        # cli.Parser (the subparsers' parser_class) takes a callable epilog, run only when help is shown
        epilog=lambda: config_keys_epilog("pipeline.rollout.run", "RolloutConfig"),  # type: ignore[arg-type]
        formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--env", default=None, help="environment: arithmetic-tool | reverse-digits | module:Class")
    p.add_argument("--engine", choices=["hf", "vllm"], default=None, help="generation engine (default hf)")
    p.add_argument("--policy", default=None, metavar="PATH_OR_VERSION",
                   help="policy version, checkpoint id, 'latest' (default) or an HF directory")
    p.add_argument("--groups", type=int, default=None, metavar="N", help="groups to sample")
    p.add_argument("--group-size", type=int, default=None, metavar="G", help="samples per group")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="task and sampling seed")
    p.add_argument("--workers", type=int, default=None, metavar="K", help="worker processes")
    p.add_argument("--run-id", default=None, help="experiment id (same id = resume)")
    p.add_argument("--follow-latest", action="store_true", default=None,
                   help="switch to the newest published policy between waves")
    p.add_argument("--ingest-url", default=None, metavar="URL",
                   help="ship to the lake's log (NATS JetStream) instead of appending; pipeline serve commits "
                        "(default $PIPELINE_INGEST_URL; docs/front-door.md)")
    p.add_argument("--follow", action="store_true", default=None,
                   help="continuous mode: keep launching the next round's groups with no barrier until --rounds, "
                        "the config's stop_file, or SIGTERM/SIGINT (the episodes in flight finish and ship)")
    p.add_argument("--rounds", type=int, default=None, metavar="R", help="with --follow: rounds (0 = until stopped)")
    p.add_argument("--group-redundancy", type=float, default=None, metavar="R",
                   help="launch ceil(N x (1 + R)) groups, finish once N are complete, cancel the stragglers "
                        "(EXPIRED / cancelled, never a policy failure); default 0 = off")
    p.add_argument("--straggler-policy", choices=["cancel", "carry"], default=None,
                   help="with --group-redundancy: cancel the stragglers (default) or, with --follow, carry them "
                        "into the next round as partial rollouts (a newer policy samples their later tokens)")
    add_config_options(p)
    p.set_defaults(handler=_rollout)


def _rollout(args: argparse.Namespace) -> None:
    import os

    from pipeline.clikit import config_overrides, emit, open_lake
    from pipeline.config import load_config
    from pipeline.rollout.run import RolloutConfig, run_rollout

    over = config_overrides(args, {"env": "env", "engine": "engine", "policy": "policy", "groups": "groups",
                             "group_size": "group_size", "seed": "seed", "workers": "workers", "run_id": "run_id",
                             "follow_latest": "follow_latest", "ingest_url": "ingest_url",
                             "group_redundancy": "group_redundancy", "follow": "follow", "rounds": "rounds",
                             "straggler_policy": "straggler_policy"})
    if os.environ.get("PIPELINE_INGEST_URL"):
        over.setdefault("ingest_url", os.environ["PIPELINE_INGEST_URL"])
    if not args.json:
        over.setdefault("progress", True)
    cfg = load_config(RolloutConfig, args.config, over)
    if cfg.engine == "vllm":    # one line before any work, not "a rollout worker died" from each worker
        from pipeline.rollout.vllm_engine import require_vllm

        require_vllm()
    _require_a_policy(args.lake, str(cfg.policy))
    s = run_rollout(open_lake(args, create=True), cfg).as_dict()
    emit(s, args, lambda r: (
        f"rollout {r['run_id']}: {r['trajectories']} trajectories on {r['env']} ({r['engine']}, "
        f"policy v{','.join(map(str, r['policy_versions']))}), {r['landed']} landed, {r['events']} events"
        + (f", {r['quarantined']} quarantined" if r["quarantined"] else "")
        + (f", {r['resumed']} resumed" if r["resumed"] else "")
        + f"\n  status: {', '.join(f'{k} {v}' for k, v in sorted(r['statuses'].items()))}"
        + f"\n  verdict: {', '.join(f'{k} {v}' for k, v in sorted(r['verdicts'].items()))}"
        + f"\n  reward mean {_fmt(r['reward_mean'])}, success {_fmt(r['success_rate'])}"
        + f"\n  {r['generated_tokens']} generated tokens, {r['tokens_per_s']:.0f} tokens/s "
          f"({r['rollout_seconds']:.1f}s rolling out, {r['seconds']:.1f}s in total), {r['tool_executions']} tool calls"
        + (f", {r['tools_abandoned']} past their deadline" if r["tools_abandoned"] else "")
        + f"\n  engine busy {r['engine_busy_s']:.1f}s ({r['engine_busy_share']:.0%} of rolling out, "
          f"{r['engine_steps']} steps, schedule {r['schedule']})"
        + (f"\n  bound by the {r['bound_by'].replace('_', ' ')}, not the engine: calls waited for a free slot "
           f"{r['pool_wait_s'].get(r['bound_by'].split('_')[0], 0.0):.1f}s (pool of "
           f"{r['pool_bounds'].get(r['bound_by'].split('_')[0], 0)}; raise tool_concurrency / "
           "verifier_concurrency, or the environment's declared limit)" if r["bound_by"] != "engine" else "")
        + (f"\n  continuous: {r['rounds']} rounds" if r["rounds"] > 1 else "")
        + (f"\n  over-provisioned: {r['groups_complete']} groups complete, {r['cancelled']} stragglers cancelled"
           + (f", {r['carried']} carried into a later round" if r.get("carried") else "")
           if r["groups_complete"] is not None else "")
        + "".join(f"\n  wait {k}: p50 {v['p50']:.0f} ms, p95 {v['p95']:.0f} ms" for k, v in r["waits_ms"].items())
        + (f", {r['verifiers_abandoned']} verifier calls past their deadline" if r["verifiers_abandoned"] else "")
        + "".join(f"\n  weight switch to v{w['version']}: {w['mode']} in {w['seconds']:.2f}s"
                  for w in r["weight_switches"])
        + (f"\n  retries: {r['retries']} run, {r['retries_denied']} denied (budget spent or policy moved on)"
           if r["retries"] or r["retries_denied"] else "")))


def _require_a_policy(lake_arg: str | None, policy: str) -> None:
    """A lake with no published policy can only be rolled out from an HF directory (--policy DIR):
    refuse before the lake is created, so a mistyped --lake leaves nothing behind."""
    import difflib
    from pathlib import Path

    from pipeline.errors import NotFoundError
    from pipeline.lake.delta import Lake, resolve_lake_uri

    if Path(policy).is_dir():
        return
    uri = resolve_lake_uri(lake_arg)
    hint = f"pipeline policy init --lake {uri} publishes version 0 (or pass --policy HF_DIR)"
    path = Path(uri)
    if "://" not in uri and not path.exists():     # checked before Lake(), which makes the directory
        near = [p.name for p in path.parent.iterdir() if p.is_dir()] if path.parent.is_dir() else []
        close = difflib.get_close_matches(path.name, near, n=1, cutoff=0.6)
        hint = (f"did you mean --lake {path.parent / close[0]}? " if close else "check --lake; ") + "or " + hint
        raise NotFoundError(f"lake {uri} does not exist, so it holds no policy to roll out", hint=hint)
    if not Lake(uri).exists("checkpoints"):
        raise NotFoundError(f"no published policy in lake {uri}", hint=hint)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
