"""The observation budget (pure Python): tool output has its own token budget,
separate from the policy's (``max_total_tokens``).

Two caps (pipeline/rollout/settings.py ``Limits``; 0 = off):

- ``max_obs_tokens_per_turn``: the most observation tokens one tool result
  adds to the context;
- ``max_obs_tokens``: the most observation tokens of a whole episode.

An over-long tool output is cut to fit, keeping its head (``obs_keep="head"``,
the default: a query's first rows, a page's top) or its tail (``"tail"``: a
log's last lines), and a marker the policy sees, ``...(truncated N tokens)``,
takes the place of what was cut (N = the observation tokens left out; the
marker is written in the built-in character vocabulary). The cut is recorded
with the turn: the ACTION_EXECUTED event's payload carries ``output`` (what the
policy sees) and ``truncated = {"keep", "tokens", "of"}``.

With a cap set, ``max_total_tokens`` counts the policy's own tokens only, so
a verbose tool can never end an episode as the policy's failure. An episode
whose observation budget is spent (not even the marker fits) ends
INFRA_FAILED / ENV_ERROR / ``obs_budget`` with a null reward: an environment
outcome, left out of the group baseline like a tool timeout. Without caps (the
default) observations count toward ``max_total_tokens`` as they always did, but
an episode that goes past it through a tool's output alone ends the same way
(``obs_budget``), no longer REJECTED / max_length with reward 0.
"""

from __future__ import annotations

from typing import Callable

MARKER = "...(truncated {n} tokens)"


class BudgetSpent(ValueError):
    """Not even the truncation marker fits the observation budget left."""


def fit(output: str, ids: Callable[[str], list[int]], cap: int, keep: str = "head") -> tuple[str, dict | None]:
    """``output`` cut so that ``len(ids(text)) <= cap`` (``ids``: the observation
    tokens a text adds to the context, wrappers included), with the marker in
    place of the cut. Returns (text, None) when it fits as it is, (text, record)
    when cut; raises ``BudgetSpent`` when not even the marker fits (the caller
    ends the episode ``obs_budget``)."""
    if keep not in ("head", "tail"):
        raise ValueError(f"obs_keep {keep!r}: expected head or tail")
    full = len(ids(output))
    if full <= cap:
        return output, None

    def cut(k: int) -> tuple[str, int]:
        kept = output[:k] if keep == "head" else output[len(output) - k:]
        n = max(0, full - len(ids(kept)))
        marker = MARKER.format(n=n)
        return (kept + marker if keep == "head" else marker + kept), n

    lo, hi = 0, len(output)       # the longest kept prefix / suffix (in characters) that fits
    if len(ids(cut(0)[0])) > cap:
        raise BudgetSpent(f"an observation budget of {cap} tokens cannot hold the truncation marker")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(ids(cut(mid)[0])) <= cap:
            lo = mid
        else:
            hi = mid - 1
    text, n = cut(lo)
    return text, {"keep": keep, "tokens": n, "of": full}
