"""A verifier's evidence, confidence and per-turn rewards (Verification) reach the landed trajectory row
(verifier_evidence, verifier_confidence, turn_rewards: issue 41, items 3 and 5); a verifier that breaks
their contract (turn rewards that do not number the policy turns, a confidence outside [0, 1]) ends the
episode INFRA_FAILED with the reason, never a row with made-up values."""

from __future__ import annotations

import random

import pytest

from pipeline.rollout.engine import Sampling
from pipeline.rollout.envs.base import Task, Verification
from pipeline.rollout.harness import Harness
from pipeline.rollout.settings import Faults, Limits
from pipeline.rollout.spool import Spool, ship
from pipeline.testing.scripted import Scripted


class Judged:
    """One tool call (it echoes), then an answer; the verifier says what it saw and how sure it is."""

    name = "judged-test"
    version = env_version = verifier_version = "1"
    prompt_template_rev = "j:{n}=/1"
    multi_turn = True
    idempotent = True

    def __init__(self, turn_rewards=(0.25, 1.0), confidence=0.8):
        self.turn_rewards, self.confidence = turn_rewards, confidence

    def reset(self, seed, split="train"):
        n = random.Random(seed).randint(10, 99)
        return Task(f"judged-{n}", f"j:{n}=", answer=n, difficulty="easy")

    def step(self, task, action, *, key):
        return action

    def verify(self, task, answer, num_tool_calls):
        ok = answer == str(task.answer)
        return Verification("PASS" if ok else "FAIL", float(ok), {"exact": float(ok)},
                            evidence=f"answer {answer!r} vs reference {task.answer}", confidence=self.confidence,
                            turn_rewards=None if self.turn_rewards is None else list(self.turn_rewards))


def _run(tmp_path, env):
    task = env.reset(3)
    engine = Scripted([f"<call>{task.answer}</call>", f"<ans>{task.answer}<eos>"])
    spool = Spool(tmp_path / "spool", "w", fsync=False)
    h = Harness(env, lambda: (engine, 0), spool, run_id="judged", worker_id="w", sampling=Sampling(1.0, 1.0, 64),
                limits=Limits(max_turns=4, max_tokens_per_turn=64, max_total_tokens=256), faults=Faults())
    ep = h.new_episode(episode_id="judged-g0-0", group_id="g0", group_size=1, task=task, seed=3, policy_version=0)
    h.run([ep])
    return ep, spool, task


def test_evidence_confidence_and_turn_rewards_land_with_the_row(tmp_path, lake):
    ep, spool, task = _run(tmp_path, Judged())
    assert (ep.status, ep.verdict, ep.reward) == ("ACCEPTED", "PASS", 1.0)
    rep = ship(lake, spool, command="test")
    assert rep.trajectories == 1 and rep.quarantined == 0
    row = lake.read("trajectories", columns=["verifier_evidence", "verifier_confidence", "turn_rewards"]).to_pylist()
    assert row == [{"verifier_evidence": f"answer '{task.answer}' vs reference {task.answer}",
                    "verifier_confidence": 0.8, "turn_rewards": [0.25, 1.0]}]


@pytest.mark.parametrize("env,why", [(Judged(turn_rewards=(1.0,)), "1 turn rewards for 2 policy turns"),
                                     (Judged(confidence=1.5), "confidence 1.5 is not a number in [0, 1]")],
                         ids=["turn-count", "confidence"])
def test_a_verifier_breaking_the_contract_is_an_infra_failure_with_its_reason(tmp_path, env, why):
    ep, spool, _ = _run(tmp_path, env)
    assert (ep.status, ep.verdict, ep.reward) == ("INFRA_FAILED", "UNKNOWN", None)
    assert ep.turn_rewards is None and ep.confidence is None
    terminal = [r for r in spool.records() if r.get("event_type") == "TERMINAL"]
    assert why in terminal[0]["payload"]
