"""Entry point of one training process under a launcher (torchrun / deepspeed):

    python -m torch.distributed.run --nproc_per_node 2 -m pipeline.train.worker JOB.json

JOB.json (written by ``train_snapshot(..., nproc=N)``, or with ``"mode": "follow"``
by ``pipeline.train.follow.follow(..., nproc=N)``) names the lake, snapshot,
config and options; rank 0 writes the TrainResult / FollowResult (or the error)
to its ``result`` path.
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
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "pipeline.train.worker", str(spec)]
        previous = None
        if stop_file is not None:
            previous = signal.signal(signal.SIGTERM, lambda signum, frame: Path(stop_file).touch())
        try:
            code = subprocess.run(cmd, env=env).returncode
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


def main(argv: list[str]) -> int:
    from pipeline.config import load_config
    from pipeline.errors import PipelineError
    from pipeline.lake.delta import Lake
    from pipeline.train.config import TrainConfig
    from pipeline.train.run import train_snapshot

    job = json.loads(Path(argv[0]).read_text())
    res: Any
    cfg = load_config(TrainConfig, None, {k: (list(v) if isinstance(v, tuple) else v) for k, v in job["config"].items()})
    import os

    rank = int(os.environ.get("RANK", "0"))
    try:
        if job.get("mode") == "follow":
            from pipeline.train.follow import follow

            res = follow(Lake(job["lake"]), cfg, from_checkpoint=job["from_checkpoint"], stop_after=job["stop_after"],
                         idle_timeout_s=job["idle_timeout_s"], stop_file=job["stop_file"], progress=job["progress"])
        else:
            res = train_snapshot(Lake(job["lake"]), job["snapshot_id"], cfg, from_checkpoint=job["from_checkpoint"],
                                 resume=job["resume"], force=job["force"], progress=job["progress"],
                                 crash_at=job.get("crash_at"))
    except PipelineError as exc:
        if rank == 0:   # the launching process prints it as one error line: no traceback here
            Path(job["result"]).write_text(json.dumps({"error": exc.message, "hint": exc.hint}))
        return 2
    if rank == 0:
        Path(job["result"]).write_text(json.dumps(res.to_dict(), default=str))
    return 0


def _finish(code: int) -> None:
    """Leave without interpreter teardown (native runtimes were seen to abort there,
    after the checkpoint was published), once every rank is done."""
    import logging
    import os

    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    except Exception:   # a peer already gone: the exit code below still tells the launcher
        pass
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("PIPELINE_DRILL_ABORT_AT_EXIT") == "1" and os.environ.get("RANK", "0") == "0":
        os.abort()   # failure drill: the teardown abort seen in the wild, after the result was written
    os._exit(code)


if __name__ == "__main__":
    import os as _os

    from pipeline.cli import quiet_third_party

    with quiet_third_party(_os.environ.get("PIPELINE_VERBOSE") == "1"):
        _code = main(sys.argv[1:])
    _finish(_code)
