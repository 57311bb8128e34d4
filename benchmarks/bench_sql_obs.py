"""Issue 41 (6): what scoring over-budget observations as policy failures does to tool use.

    .venv/bin/python benchmarks/run.py --only sql_obs            # full: 6 seeds, 3 arms, 3 updates (~22 min on a loaded 2-core box)
    .venv/bin/python benchmarks/run.py --only sql_obs --quick    # smoke (1 seed, 1 update; nothing committed)

The demo policy (the built-in tiny character Llama, warm-started by
``pipeline policy init``) learns the SQL environment ``sql-lookup-hot``
(pipeline/rollout/envs/sql.py): the value of key ``k`` in table ``t(k, v)``,
answered by the query ``select v from t where k=K`` (exact: 0.95) or directly
(a guess from ``k``: at most 0.8 unless exact, ~0.55 on average). Every
episode opens its own copy of the database from a content-addressed snapshot
(the stateful lifecycle; ``env_state_hash`` in each trajectory). Half the keys
are *hot*: their row is stored 8 times, so the same query returns 8 rows, and
the observation budget on (``max_obs_tokens = 16``: a one-row result takes 6
tokens, the 8 rows 55, the truncation marker alone 26) cannot hold it: the
episode ends over budget through tool output alone. The two arms differ in
that outcome only (and the third in how admission scores it):

    obs_env_outcome   the shipped default (harness/3): INFRA_FAILED / ENV_ERROR / obs_budget, null
                      reward: left out of the group baseline (an environment outcome)
    obs_as_zero       the old behaviour (harness/2, before issue 41): REJECTED / FAIL / max_length,
                      reward 0, which admission's default truncation policy (score_zero) trains on as
                      the policy's failure. Reproduced here by re-labelling that one terminal outcome
                      in this process (``old_scoring``): nothing else of the harness changes.
    obs_as_zero_filter  the old behaviour, admitted with ``truncation=filter``: every max_length
                      member (the re-labelled ones and the policy's own) excluded, reason truncated:
                      what the admission-side truncation policy alone can undo

With hot keys at 1/2 and scored 0, a query is worth 0.95 x 1/2 ~ 0.48 on
average against ~0.55 for a direct guess: the naive scoring should teach the
policy to stop querying; excluded, the queries that came back (0.95) beat the
guesses. Held-out evaluation is greedy on ``sql-lookup`` (the same values, no
hot keys: every query fits), so held-out success measures whether the policy
kept the tool.

Measured per seed and update: held-out success and held-out tool use (share
of held-out episodes that query), and over the sampled training episodes:
queries per episode, the share that query, and the over-budget episodes. The
figures (``derive``) are per arm the mean over seeds of each seed's mean over
updates with a seeded percentile-bootstrap 95% interval over seeds, and the
paired (same version 0) difference between the arms, as docs/gates.md.
"""


import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TRAIN_ENV = "sql-lookup-hot"
EVAL_ENV = "sql-lookup"
ARMS = ("obs_env_outcome", "obs_as_zero", "obs_as_zero_filter")
# the arm whose admission filters truncated members (truncation=filter) instead of scoring them 0
FILTER_ARMS = ("obs_as_zero_filter",)
PAIRS = (("obs_env_outcome", "obs_as_zero"), ("obs_as_zero_filter", "obs_as_zero"))


@dataclass(frozen=True)
class Config:
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    iterations: int = 3
    groups: int = 16
    group_size: int = 8
    eval_n: int = 100
    lr: float = 3e-4
    warm_start_steps: int = 300
    warm_start_tool_fraction: float = 0.5
    # the rollout's limits: the observation budget on (max_total_tokens is then the policy's own tokens)
    limits: dict[str, Any] = field(default_factory=lambda: {
        "max_turns": 3, "max_tokens_per_turn": 32, "max_total_tokens": 48, "max_obs_tokens": 16})


QUICK = Config(seeds=(0,), iterations=1, groups=4, eval_n=20, warm_start_steps=60)


@contextlib.contextmanager
def old_scoring():
    """The pre-issue-41 harness for one outcome: an episode over budget through tool output
    alone (``obs_budget``) ends REJECTED / FAIL / max_length with reward 0 and the components
    of a failed answer, as harness/2 recorded it. Yields a counter of the episodes re-labelled."""
    from pipeline.rollout.harness import Harness

    orig = Harness.terminal
    seen = {"n": 0}

    def terminal(self, ep, status, verdict, stop_reason, reward, components, payload):
        if stop_reason == "obs_budget":
            seen["n"] += 1
            v = self.env.verify(ep.task, None, ep.tool_calls)
            return orig(self, ep, "REJECTED", "FAIL", "max_length", 0.0, v.components, payload)
        return orig(self, ep, status, verdict, stop_reason, reward, components, payload)

    Harness.terminal = terminal          # type: ignore[method-assign]
    try:
        yield seen
    finally:
        Harness.terminal = orig           # type: ignore[method-assign]


SAMPLED_SQL = """
SELECT count(*) AS n, coalesce(sum(num_tool_calls), 0)::BIGINT AS queries, count(*) FILTER (WHERE num_tool_calls > 0) AS querying,
       count(*) FILTER (WHERE stop_reason = 'obs_budget') AS obs_budget,
       count(*) FILTER (WHERE status = 'REJECTED' AND stop_reason = 'max_length') AS max_length,
       count(*) FILTER (WHERE status = 'ACCEPTED' AND verdict = 'PASS') AS passed,
       count(DISTINCT env_state_hash) AS states
FROM trajectories WHERE run_id = $run
"""


def _evaluate(lake, cfg: Config) -> tuple[int, float, float]:
    from pipeline.policy_store import resolve_policy
    from pipeline.rollout.evaluate import evaluate

    ref = resolve_policy(lake)
    ev = evaluate(ref, EVAL_ENV, n=cfg.eval_n, seed=0, max_turns=cfg.limits["max_turns"],
                  max_tokens_per_turn=cfg.limits["max_tokens_per_turn"], max_total_tokens=64)
    return ref.policy_version, float(ev["success_rate"]), float(ev["tool_use_rate"])


def run_arm(lake, arm: str, seed: int, cfg: Config, v0: dict[str, float]) -> dict[str, Any]:
    from pipeline.admission.config import AdmissionConfig
    from pipeline.admission.run import admit
    from pipeline.query.duck import query
    from pipeline.rollout.run import run_rollout
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    curve: list[dict[str, Any]] = [{"iteration": 0, "heldout_success": v0["success"], "heldout_tool_use": v0["tool"]}]
    t_arm = time.perf_counter()
    for k in range(1, cfg.iterations + 1):
        run_id = f"{arm}-{seed}-{k}"
        t0 = time.perf_counter()
        with (old_scoring() if arm.startswith("obs_as_zero") else contextlib.nullcontext({"n": 0})) as relabelled:
            run_rollout(lake, env=TRAIN_ENV, groups=cfg.groups, group_size=cfg.group_size, seed=seed * 1000 + k,
                        group_offset=k * 1000, run_id=run_id, policy="latest", **cfg.limits)
        rollout_s = time.perf_counter() - t0
        s = query(lake, SAMPLED_SQL, params={"run": run_id}).to_pylist()[0]
        a = admit(lake, AdmissionConfig(truncation="filter" if arm in FILTER_ARMS else "score_zero"),
                  command="bench_sql_obs")
        # an episode over budget issued one more query than it observed (num_tool_calls counts observations)
        over = s["obs_budget"] + relabelled["n"]
        row: dict[str, Any] = {"iteration": k, "rollout_s": round(rollout_s, 2), "sampled": s["n"],
                               "queries": int(s["queries"]) + over, "querying": int(s["querying"]) + over,
                               "passed": s["passed"],
                               "obs_budget": s["obs_budget"], "max_length": s["max_length"],
                               "relabelled": relabelled["n"], "states": s["states"],
                               "admitted_groups": a.admitted_groups, "admitted_members": a.admitted_members,
                               "train_s": 0.0}
        if a.snapshot_id:
            t1 = time.perf_counter()
            train_snapshot(lake, a.snapshot_id, TrainConfig(lr=cfg.lr, epochs=1, seed=seed * 100 + k), progress=False)
            row["train_s"] = round(time.perf_counter() - t1, 2)
        row["policy_version"], row["heldout_success"], row["heldout_tool_use"] = _evaluate(lake, cfg)
        curve.append(row)
        print(f"  {arm:<16} seed {seed} iter {k}: v{row['policy_version']} held-out {row['heldout_success']:.2f} "
              f"(tool {row['heldout_tool_use']:.2f}); sampled: {row['querying']}/{s['n']} query, "
              f"{s['obs_budget']} obs_budget, {relabelled['n']} scored 0; admitted {a.admitted_groups}/{cfg.groups}",
              file=sys.stderr, flush=True)
    return {"arm": arm, "seed": seed, "curve": curve, "seconds": round(time.perf_counter() - t_arm, 1)}


def run_all(cfg: Config, root: Path) -> dict[str, Any]:
    import shutil

    from pipeline.demo import warm_start_overrides
    from pipeline.lake.delta import Lake
    from pipeline.rollout.policy import init_policy

    runs, v0s = [], {}
    for i, seed in enumerate(cfg.seeds):
        base = root / f"v0-seed{seed}"
        t0 = time.perf_counter()
        # demonstrations of sql-lookup (one-row results: a demonstration never shows a hot key) and arithmetic-tool
        init_policy(Lake(base), seed=seed, warm_start_steps=cfg.warm_start_steps,
                    tool_fraction=cfg.warm_start_tool_fraction, **warm_start_overrides(EVAL_ENV))
        _, s0, t0_tool = _evaluate(Lake(base), cfg)
        v0s[str(seed)] = {"success": s0, "tool": t0_tool, "warm_start_s": round(time.perf_counter() - t0, 1)}
        print(f"seed {seed}: version 0 held-out success {s0:.2f} (tool use {t0_tool:.2f})", file=sys.stderr, flush=True)
        order = ARMS[i % len(ARMS):] + ARMS[:i % len(ARMS)]      # the arm order rotates per seed
        for arm in order:
            lake_dir = root / f"{arm}-seed{seed}"
            shutil.copytree(base, lake_dir)
            runs.append(run_arm(Lake(lake_dir), arm, seed, cfg, v0s[str(seed)]))
            shutil.rmtree(lake_dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    return {"config": asdict(cfg), "train_env": TRAIN_ENV, "eval_env": EVAL_ENV, "arms": list(ARMS),
            "version0": v0s, "runs": runs}


def run(quick: bool = False) -> dict[str, Any]:
    cfg = QUICK if quick else Config()
    old = os.environ.get("PIPELINE_SQL_STORE")
    with tempfile.TemporaryDirectory(prefix="bench-sql-obs-") as tmp:
        os.environ["PIPELINE_SQL_STORE"] = str(Path(tmp) / "sql-store")     # the snapshots and episode copies
        try:
            return run_all(cfg, Path(tmp))
        finally:
            if old is None:
                os.environ.pop("PIPELINE_SQL_STORE", None)
            else:
                os.environ["PIPELINE_SQL_STORE"] = old


# -- figures --------------------------------------------------------------------------------------------------
def per_seed(raw: dict[str, Any], arm: str, metric: str) -> dict[str, float]:
    """seed -> the mean over updates (versions 1..K) of ``metric`` of ``arm``: a held-out figure
    (``heldout_success``, ``heldout_tool_use``) or a sampled one (``query_share``: episodes that
    query / sampled; ``queries_per_episode``; ``over_budget_share``)."""
    out = {}
    for r in raw["runs"]:
        if r["arm"] != arm:
            continue
        vals = []
        for c in r["curve"][1:]:
            if metric in ("heldout_success", "heldout_tool_use"):
                vals.append(c[metric])
            elif metric == "query_share":
                vals.append(c["querying"] / c["sampled"])
            elif metric == "queries_per_episode":
                vals.append(c["queries"] / c["sampled"])
            elif metric == "over_budget_share":
                vals.append((c["obs_budget"] + c["relabelled"]) / c["sampled"])
            else:
                raise KeyError(metric)
        out[str(r["seed"])] = statistics.fmean(vals)
    return out


METRICS = ("heldout_success", "heldout_tool_use", "query_share", "queries_per_episode", "over_budget_share")


def summary(raw: dict[str, Any]) -> dict[str, Any]:
    """Per arm and metric: per-seed means, their mean and bootstrap 95% interval; per pair of
    ``PAIRS`` run and metric, the paired (same seeds, same version 0) difference ``a - b``."""
    from bench_gates import bootstrap_ci

    out: dict[str, Any] = {"arms": {}, "differences": {}}
    for arm in raw["arms"]:
        out["arms"][arm] = {}
        for m in METRICS:
            ps = per_seed(raw, arm, m)
            out["arms"][arm][m] = {"mean": round(statistics.fmean(ps.values()), 4), "ci95": bootstrap_ci(list(ps.values())),
                                   "seeds": {k: round(v, 4) for k, v in ps.items()}}
    for a, b in PAIRS:
        if a not in raw["arms"] or b not in raw["arms"]:
            continue
        out["differences"][f"{a}-{b}"] = diff = {}
        for m in METRICS:
            pa, pb = per_seed(raw, a, m), per_seed(raw, b, m)
            d = [pa[s] - pb[s] for s in sorted(set(pa) & set(pb), key=int)]
            diff[m] = {"mean": round(statistics.fmean(d), 4), "ci95": bootstrap_ci(d), "seeds": [round(x, 4) for x in d]}
    return out


NAMES = {"heldout_success": "held-out success", "heldout_tool_use": "held-out tool use (share querying)",
         "query_share": "sampled episodes that query", "queries_per_episode": "queries per sampled episode",
         "over_budget_share": "sampled episodes over the obs budget"}


def derive(raw: dict[str, Any]) -> list:
    """The figures: per pair (a, b) of ``PAIRS`` and metric, b's mean over seeds / a's, with
    both arms' 95% intervals and the paired difference a - b in the text."""
    from run import Result

    s = summary(raw)
    n = len(raw["config"]["seeds"])
    out = []
    for pair, diff in s["differences"].items():
        a, b = pair.split("-")
        what = {"obs_env_outcome": "excluded", "obs_as_zero": "scored 0",
                "obs_as_zero_filter": "scored 0, truncation=filter"}
        for m, label in NAMES.items():
            x, y, d = s["arms"][b][m], s["arms"][a][m], diff[m]
            out.append(Result(
                name=f"sql obs budget ({n} seeds): {label}, over-budget {what[b]} / {what[a]}",
                ratio=x["mean"] / y["mean"] if y["mean"] else 0.0, target=None, higher_is_better=True,
                measured=f"{b}: {x['mean']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]",
                baseline=f"{a}: {y['mean']:.3f} [{y['ci95'][0]:.3f}, {y['ci95'][1]:.3f}]",
                note=f"paired difference {a} - {b}: {d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] "
                     f"(95% bootstrap over seeds)",
                possible=(0.0, None)))
    return out


if __name__ == "__main__":
    import json

    res = run(quick="--quick" in sys.argv)
    print(json.dumps(summary(res), indent=1))
