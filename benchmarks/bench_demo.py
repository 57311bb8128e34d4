"""The closed loop's targets (issue 6): the default `pipeline demo` must finish
in under 5 minutes on a 2-core CPU and raise held-out (greedy) success by at
least 20 points from version 0 to the last version. Sync and async side by side.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from run import Result


def run(quick: bool = False) -> list[Result]:
    from pipeline.demo import DemoConfig, run_demo
    from pipeline.lake.delta import Lake

    out: list[Result] = []
    for mode in ("sync", "async"):
        root = Path(tempfile.mkdtemp(prefix=f"bench-demo-{mode}-"))
        try:
            cfg = DemoConfig(mode=mode, report=False, **({"iterations": 2, "groups": 8, "eval_n": 50} if quick else {}))
            t0 = time.perf_counter()
            s = run_demo(Lake(root / "lake"), cfg, out=lambda *a: None)
            secs = time.perf_counter() - t0
        finally:
            shutil.rmtree(root, ignore_errors=True)
        gain = s["heldout_gain_points"]
        out.append(Result(f"demo {mode}: held-out gain / 20 points", gain / 20.0, 1.0,
                          f"{s['heldout_first']:.3f} -> {s['heldout_last']:.3f} ({gain:+.1f} pts)", "20 pts",
                          higher_is_better=True,
                          note=f"idle {s['trainer_idle_fraction']:.0%}, lag {s['lag_distribution']}",
                          raw={"summary": s, "wall_s": secs}))
        out.append(Result(f"demo {mode}: wall time / 300 s", secs / 300.0, 1.0, f"{secs:.0f}s", "300 s",
                          raw={"wall_s": secs}))
    return out
