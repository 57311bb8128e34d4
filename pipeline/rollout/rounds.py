"""A worker's ledger of its groups (pipeline/rollout/worker.py): which are open,
which complete, and with over-provisioning (``group_redundancy``) when it has
enough of them.

A group is *complete* once every episode it started ended on its own (none
cancelled) under one policy version. Without ``straggler_policy=carry`` the
worker needs its share of ``groups`` complete, and then the rest is cancelled
(``cancel``). With ``carry`` (continuous mode) each round needs its share: a
round then *closes*, and its episodes still running are *carried* (they go on
into the next round and no newer policy waits for them); once every round of
``rounds`` has closed, what still runs is cancelled.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

from pipeline.rollout.plan import launched_groups, retry_id, worker_share

if TYPE_CHECKING:
    from pipeline.rollout.config import RolloutConfig
    from pipeline.rollout.episode import Episode


class GroupLedger:
    """The groups of one worker, the rounds they belong to and, with ``carry``, the
    episodes in flight that must keep one policy version (``live``) and those carried."""

    def __init__(self, cfg: RolloutConfig, worker: int, *, cancel: Callable[[], None]) -> None:
        self.cfg = cfg
        self.cancel = cancel            # called once the run has the groups it needs: end what still runs
        # over-provisioning: the groups this worker needs complete (its share of `groups`); None = all of them
        self.need = worker_share(cfg.groups, cfg.workers, worker) if cfg.group_redundancy > 0 else None
        self.carry = cfg.straggler_policy == "carry"
        self.round: dict[str, int] = {}                 # group -> its round (0, 1, ...)
        self.opened: dict[str, int] = {}                # group -> its episodes not yet terminal (this invocation)
        self.spoiled: set[str] = set()                  # groups with a cancelled member or two policy versions
        self.versions: dict[str, set[int]] = {}
        self.complete = 0
        self.complete_in: Counter[int] = Counter()      # round -> its complete groups
        self.closed: set[int] = set()                   # carry: rounds that have their groups
        self.live: dict[str, str] = {}                  # carry: episodes in flight, not carried -> group
        self.carried: set[str] = set()                  # carry: episodes carried past their round's close

    def add_groups(self, groups: list[tuple[int, str, Any, list]], state: dict[str, Any]) -> None:
        """Planned groups (``plan``), with what is on record (``state``: None = ended): a group
        complete on record (a restart) counts, every member and retry ended."""
        cfg = self.cfg
        for k, gid, _, _ in groups:
            self.round[gid] = (k - cfg.group_offset) // launched_groups(cfg)
        if self.need is None:
            return
        for _, gid, _, members in groups:
            ids = [eid for eid, _ in members] + [retry_id(gid, n) for n in range(cfg.retry_group_budget)
                                                 if retry_id(gid, n) in state]
            if all(eid in state and state[eid] is None for eid in ids):
                self.complete += 1
                if self.carry:
                    self._round_complete(self.round[gid])
        if not self.carry and self.complete >= self.need:
            self.cancel()

    def closed_group(self, gid: str) -> bool:
        """The group's round has its groups (carry): none of its unstarted episodes starts."""
        return self.round[gid] in self.closed

    def started(self, ep: Episode) -> None:
        """An episode of the group starts (new, resumed or a retry)."""
        gid = ep.group_id
        self.opened[gid] = self.opened.get(gid, 0) + 1
        self.versions.setdefault(gid, set()).add(ep.policy_version)
        if self.carry:
            if self.closed_group(gid):
                self.carried.add(ep.episode_id)
            else:
                self.live[ep.episode_id] = gid

    def ended(self, ep: Episode) -> None:
        """An episode ended: it no longer holds a policy switch back."""
        self.live.pop(ep.episode_id, None)

    def progress(self, ep: Episode) -> None:
        """Over-provisioning, after ``ep`` ended (its retries, if any, ``started``): its group is
        complete once all its episodes ended (none cancelled, one policy version); with enough
        complete groups the rest is cancelled, or (carry) the round closes."""
        gid = ep.group_id
        self.opened[gid] -= 1
        if ep.stop_reason == "cancelled" or len(self.versions.get(gid, ())) > 1:
            self.spoiled.add(gid)
        if self.opened[gid] == 0 and gid not in self.spoiled:
            self.complete += 1
            if self.carry:
                self._round_complete(self.round[gid])
            elif self.need is not None and self.complete >= self.need:
                self.cancel()

    def _round_complete(self, rnd: int) -> None:
        """carry: one more complete group in round ``rnd``. With ``need`` of them the round
        closes: its episodes still running are carried on (into the next round). Once every
        round of the run (``rounds``) has closed, what still runs is cancelled instead: there
        is no next round to carry it into."""
        self.complete_in[rnd] += 1
        if rnd in self.closed or self.need is None or self.complete_in[rnd] < self.need:
            return
        self.closed.add(rnd)
        if self.cfg.rounds and len(self.closed) >= self.cfg.rounds:
            self.cancel()
            return
        for eid, gid in list(self.live.items()):
            if self.closed_group(gid):
                del self.live[eid]
                self.carried.add(eid)
