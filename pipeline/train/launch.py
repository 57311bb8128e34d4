"""The parent side of multi-process training: run a job in N processes under
torchrun, each running :mod:`pipeline.train.worker`, and return rank 0's
result. Kept apart from the worker (which imports the trainers that call this),
so the train package has no import circle.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def launch(job: dict[str, Any], nproc: int, *, failed: str, hint: str, stop_file: str | None = None) -> dict[str, Any]:
    """Run ``job`` in ``nproc`` processes under torchrun (this module in each);
    return rank 0's result dict (``worker_exit_codes`` added when the launcher
    exited non-zero after a result was written). A worker's PipelineError is
    raised here; no result at all raises PipelineError(``failed``, ``hint``).
    ``stop_file``: SIGTERM to this process touches it (the resident trainer's
    rank 0 polls it) instead of ending this process."""
    import os
    import signal
    import socket
    import subprocess
    import tempfile

    from pipeline.errors import PipelineError

    with tempfile.TemporaryDirectory(prefix="pipeline-train-") as tmp:
        spec = Path(tmp) / "job.json"
        out = Path(tmp) / "result.json"
        spec.write_text(json.dumps(job | {"result": str(out)}))
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        from pipeline.policy_store import run_tag

        env["PIPELINE_RUN_TAG"] = run_tag()    # every rank writes the one checkpoint directory of this run
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "pipeline.train.worker", str(spec)]
        previous = None
        if stop_file is not None:
            previous = signal.signal(signal.SIGTERM, lambda signum, frame: Path(stop_file).touch())
        from pipeline.procs import Terminated, child_argv, deferred, stop_children

        proc = subprocess.Popen(child_argv(cmd), env=env)   # torchrun dies with this process; its workers with it
        try:
            code = proc.wait()
        except (KeyboardInterrupt, Terminated) as exc:
            # stopped: torchrun forwards the signal to the workers and waits for them (docs/signals.md)
            with deferred():
                stop_children([proc], signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT, timeout=60)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if not out.is_file():
            raise PipelineError(f"{failed} (exit code {code})", hint=hint)
        data = json.loads(out.read_text())
        if "error" in data:
            raise PipelineError(data["error"], hint=data.get("hint"))
        if code != 0:
            # published and verified by rank 0, yet a process died afterwards (e.g. SIGABRT while native
            # runtimes shut down): the caller must hear about it, not get a silent success
            data["worker_exit_codes"] = [code]
        return data
