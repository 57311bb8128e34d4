"""Which micro-batches share an optimizer step (issue 29, item 5): ``step_order``.

The packer (``pack_by_length``) sorts rows by length before filling
micro-batches, so each micro-batch is one length stratum. Agent rollouts' length
correlates with their outcome (long answers fail more often), so a stratum's
mean GRPO advantage is far from the snapshot's (0 per group). Under
``step_order=length`` each optimizer step trains consecutive strata: its mean
advantage swings with the step (the loss sawtooth). ``shuffled`` (the order
before) draws a step's micro-batches at random; ``stratified`` (the default)
gives every step one micro-batch of each length band.

On a synthetic snapshot shaped like agent data (lognormal lengths, groups of 8,
success probability falling with length, GRPO advantages), for each order and
several plan seeds: the spread (standard deviation over steps) of the per-step
mean advantage, the share of consecutive steps whose mean advantage flips sign,
and the padding ratio (sign flips are in the raw results: around a mean of 0
the stratified steps flip sign often, by small amounts; the spread and the
largest |step mean| say how far a step is pulled from the snapshot's
direction). Pure planning (no model): the figures are exact counts,
not timings, so the machine's load does not move them.

    .venv/bin/python benchmarks/run.py --only step_order [--quick]

The same through the real trainer (tiny Llama, one epoch over a synthetic
snapshot whose rewards fall with length): the spread of the ``metrics`` rows'
``advantage_mean`` (target <= 0.5) and the mean |loss change| between
consecutive steps (the sawtooth's amplitude; no target).

Targets (planning): stratified / length spread <= 0.5; stratified / shuffled spread <= 0.8;
padding stratified / length == 1 (the same micro-batches).
"""

from __future__ import annotations

from run import Result


def snapshot(n: int, seed: int = 0):
    import numpy as np

    from pipeline.testing.train_fixtures import grpo_advantages
    from pipeline.testing.trajectories import response_lengths

    rng = np.random.default_rng(seed)
    group = 8
    lengths = response_lengths(rng, n, median_len=600, sigma=0.8, max_len=8192) + 64   # + the prompt
    skill = np.repeat(rng.normal(0, 1, -(-n // group)), group)[:n]                       # per task
    p = 1 / (1 + np.exp(-(skill - 1.2 * (np.log(lengths) - np.log(664)))))                 # longer: fails more
    reward = (rng.random(n) < p).astype(np.float64)
    gids = [f"g{i // group}" for i in range(n)]
    return lengths, grpo_advantages(gids, reward)


def step_figures(lengths, adv, *, order: str, seed: int, budget: int, grad_accum: int) -> dict:
    import numpy as np

    from pipeline.train.packing import padding_ratio, plan_steps

    steps = plan_steps(lengths, budget_tokens=budget, grad_accum=grad_accum, epochs=1, seed=seed, order=order)
    means = np.array([adv[[i for mb in s.micro_batches for i in mb]].mean() for s in steps])
    signs = np.sign(means)
    return {"steps": len(steps), "spread": float(means.std()), "max_abs_mean": float(np.abs(means).max()),
            "sign_flip_share": float((signs[1:] != signs[:-1]).mean()) if len(steps) > 1 else 0.0,
            "padding_ratio": padding_ratio(lengths, [list(mb) for s in steps for mb in s.micro_batches]),
            "step_means_head": [round(float(m), 3) for m in means[:12]]}


def trainer_runs(quick: bool) -> list[Result]:
    """The same comparison through the real trainer (tiny Llama, one epoch): the
    per-step ``advantage_mean`` and ``loss`` of the ``metrics`` rows."""
    import tempfile

    import numpy as np
    import pyarrow as pa

    from pipeline.lake.delta import Lake
    from pipeline.testing.train_fixtures import (grpo_advantages, publish_payload_snapshot, publish_tiny_policy,
                                                 synthetic_payload)
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    n = 128 if quick else 256
    payload = synthetic_payload(n, seed=5, median_len=40, prompt_len=8, sigma=0.6, group_size=8)
    lens = np.array([len(r) for r in payload.column("response_ids").to_pylist()])
    rng = np.random.default_rng(5)
    reward = (rng.random(n) < 1 / (1 + np.exp(3.0 * (np.log(lens) - np.log(40))))).astype(np.float64)
    adv = grpo_advantages(payload.column("group_id").to_pylist(), reward)
    payload = payload.set_column(payload.schema.get_field_index("reward"), "reward", pa.array(reward))
    payload = payload.set_column(payload.schema.get_field_index("advantage"), "advantage", pa.array(adv))
    raw: dict = {"trajectories": n, "advantage_length_corr": float(np.corrcoef(np.log(lens), adv)[0, 1])}
    for order in ("length", "stratified", "shuffled", "length"):    # the baseline first and last
        with tempfile.TemporaryDirectory() as tmp:
            lake = Lake(f"{tmp}/lake")
            publish_tiny_policy(lake)
            sid = publish_payload_snapshot(lake, payload)
            train_snapshot(lake, sid, TrainConfig(lr=1e-3, micro_batch_tokens=256, grad_accum=4, seed=3,
                                                  step_order=order, max_train_lag=None), progress=False)
            rows = sorted(lake.read("metrics").to_pylist(), key=lambda r: r["global_step"])
        am = np.array([r["advantage_mean"] for r in rows])
        loss = np.array([r["loss"] for r in rows])
        got = {"steps": len(rows), "advantage_mean": am.round(4).tolist(), "loss": loss.round(5).tolist(),
               "advantage_mean_spread": float(am.std()), "loss_step_to_step": float(np.abs(np.diff(loss)).mean()),
               "padding_ratio": [r["padding_ratio"] for r in rows]}
        if order in raw:
            assert raw[order]["advantage_mean"] == got["advantage_mean"], "length order is deterministic"
        raw[order] = got
    L, S, R = raw["length"], raw["stratified"], raw["shuffled"]

    def text(d: dict) -> str:
        return (f"advantage_mean spread {d['advantage_mean_spread']:.3f}, mean |loss step-to-step| "
                f"{d['loss_step_to_step']:.4f}, {d['steps']} steps")

    what = f"train_snapshot ({n} trajectories, tiny Llama, grad_accum 4)"
    return [Result(f"step order, {what}: stratified / length, spread of the metrics rows' advantage_mean",
                   S["advantage_mean_spread"] / L["advantage_mean_spread"], 0.5, text(S), text(L), raw=raw,
                   note=f"advantage vs log length corr {raw['advantage_length_corr']:.2f}"),
            Result(f"step order, {what}: stratified / shuffled (the order before), mean |loss change| between "
                   "consecutive steps", S["loss_step_to_step"] / R["loss_step_to_step"], None, text(S), text(R),
                   note="the sawtooth's amplitude; no target (length order drifts monotonically instead: "
                        "small steps, large spread)")]


def run(quick: bool) -> list[Result]:
    import numpy as np

    n, budget, grad_accum = (1024 if quick else 8192), 16384, 8
    seeds = [0, 1, 2] if quick else [0, 1, 2, 3, 4]
    lengths, adv = snapshot(n)
    raw: dict = {"n": n, "budget_tokens": budget, "grad_accum": grad_accum, "plan_seeds": seeds,
                 "advantage_mean": float(adv.mean()),
                 "advantage_length_corr": float(np.corrcoef(np.log(lengths), adv)[0, 1])}
    orders = ("length", "stratified", "shuffled", "length")      # the baseline first and last (alternated)
    for order in orders:
        runs = [step_figures(lengths, adv, order=order, seed=s, budget=budget, grad_accum=grad_accum) for s in seeds]
        key = order if order not in raw else f"{order}_again"
        raw[key] = {"per_seed": runs, "spread_mean": float(np.mean([r["spread"] for r in runs])),
                    "sign_flip_share_mean": float(np.mean([r["sign_flip_share"] for r in runs])),
                    "padding_ratio": runs[0]["padding_ratio"], "steps": runs[0]["steps"]}
    assert raw["length"] == raw["length_again"], "length order is a pure function of the lengths"
    L, S, R = raw["length"], raw["stratified"], raw["shuffled"]

    def text(d: dict) -> str:
        worst = float(np.mean([r["max_abs_mean"] for r in d["per_seed"]]))
        return (f"spread {d['spread_mean']:.3f}, largest |step mean| {worst:.3f}, "
                f"padding {d['padding_ratio']:.2%}, {d['steps']} steps")

    size = f"n={n}, grad_accum {grad_accum}, budget {budget // 1024}k, {len(seeds)} plan seeds"
    return [*trainer_runs(quick),
        Result(f"step order ({size}): stratified / length, spread of per-step mean advantage",
               S["spread_mean"] / L["spread_mean"], 0.5, text(S), text(L), raw=raw,
               note=f"advantage vs log length corr {raw['advantage_length_corr']:.2f}"),
        Result(f"step order ({size}): stratified / shuffled, spread of per-step mean advantage",
               S["spread_mean"] / R["spread_mean"], 0.8, text(S), text(R)),
        Result(f"step order ({size}): stratified / length, padding ratio (the same micro-batches)",
               S["padding_ratio"] / L["padding_ratio"], 1.0, f"{S['padding_ratio']:.4%}", f"{L['padding_ratio']:.4%}"),
    ]
