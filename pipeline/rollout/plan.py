"""What a worker owes: its groups (``plan``) and the retries of their failed
members (``plan_retries``), every id and seed a function of the config, so a
restarted run knows exactly which episodes it owes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pipeline.rollout.engine import derive_seed

if TYPE_CHECKING:
    from pipeline.rollout.config import RolloutConfig


def launched_groups(cfg: RolloutConfig) -> int:
    """Groups a run launches: ``groups`` plus ``ceil(groups * group_redundancy)`` spares."""
    return cfg.groups + math.ceil(round(cfg.groups * cfg.group_redundancy, 9))


def plan(cfg: RolloutConfig, env, worker: int) -> list[tuple[int, str, Any, list[tuple[str, int]]]]:
    """This worker's groups: (group index, group_id, task, [(episode_id, sampling seed)]),
    over-provisioned ones included (``launched_groups``)."""
    out = []
    for k in range(cfg.group_offset, cfg.group_offset + launched_groups(cfg)):
        if k % cfg.workers != worker:
            continue
        task = env.reset(derive_seed(cfg.seed, "task", k), "train")
        gid = f"{cfg.run_id}-g{k}"
        out.append((k, gid, task, [(f"{gid}-{j}", derive_seed(cfg.seed, "sample", k, j))
                                   for j in range(cfg.group_size)]))
    return out


def retry_id(group_id: str, n: int) -> str:
    """The trajectory id of a group's ``n``-th retry (deterministic: a restart finds it)."""
    return f"{group_id}-r{n}"


def worker_share(total: int, workers: int, worker: int) -> int:
    return total // workers + (1 if worker < total % workers else 0)


def needs_retry(ep) -> bool:
    """A member without a valid evaluation for infrastructure reasons (INFRA_FAILED, or verdict UNKNOWN);
    never a straggler cancelled on purpose (``group_redundancy``)."""
    return ep.stop_reason != "cancelled" and (ep.status == "INFRA_FAILED" or ep.verdict == "UNKNOWN")


def plan_retries(cfg: RolloutConfig, harness, holder, index, state, last, wave, budget: int, summary):
    """New episodes for the failed members of ``last`` (this wave's previous round):
    one per failed member while its group has retries left (``retry_group_budget``,
    counting those already on record) and the worker's share of ``retry_run_budget``
    lasts, and only while the served policy is still the group's version (a retry
    from a newer policy would not be comparable with its group). Their CREATED
    event says ``retry_of`` (the failed trajectory) and ``retry`` (n)."""
    if cfg.retry_group_budget <= 0:     # retries off
        return [], budget
    ids = {e.episode_id for e in wave}
    used = {gid: sum(1 for n in range(cfg.retry_group_budget)      # every retry id on record or run counts
                     if retry_id(gid, n) in state or retry_id(gid, n) in ids) for gid in index}
    _, version = holder()
    out = []
    for e in last:
        if not needs_retry(e):
            continue
        gid = e.group_id
        group_version = min((m.policy_version for m in wave if m.group_id == gid), default=version)
        if used.get(gid, 0) >= cfg.retry_group_budget or budget <= 0 or version != group_version:
            summary.retries_denied += 1
            continue
        n = used[gid]
        used[gid] = n + 1
        budget -= 1
        k, task = index[gid]
        ep = harness.new_episode(episode_id=retry_id(gid, n), group_id=gid, group_size=cfg.group_size, task=task,
                                 seed=derive_seed(cfg.seed, "retry", k, n), policy_version=version,
                                 extra={"retry_of": e.episode_id, "retry": n})
        out.append(ep)
        summary.retries += 1
    return out, budget
