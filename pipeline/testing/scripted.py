"""A scripted policy engine for harness tests: the k-th turn of an episode writes ``turns[k]``
(the turn is the number of ``<obs>`` markers in its context; the last entry repeats)."""

from __future__ import annotations

from pipeline import vocab
from pipeline.rollout.engine import Completion


class Scripted:
    def __init__(self, turns: list[str]):
        self.turns = turns

    def generate(self, requests, sampling):
        out = []
        for r in requests:
            k = list(r.context).count(vocab.OBS_ID)
            ids = vocab.encode(self.turns[min(k, len(self.turns) - 1)])
            out.append([Completion(ids, [0.0] * len(ids), "stop")])
        return out

    def close(self):
        pass
