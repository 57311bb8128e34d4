"""Environments for the drills (imported by worker subprocesses as ``drill_envs:Class``)."""

from __future__ import annotations

from pipeline.rollout.envs.arithmetic import ArithmeticTool


class SideEffectCalculator(ArithmeticTool):
    """The calculator, declared NOT idempotent: as if each call moved money. A
    restarted worker may never re-run a call whose outcome it cannot prove."""

    name = "drill-side-effect-calculator"
    idempotent = False
