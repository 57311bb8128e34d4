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

    from pipeline.console import quiet_third_party
    from pipeline.procs import die_with_parent

    # never outlive the launcher (torchrun, deepspeed): its death would leave this rank training alone. A
    # watchdog, not the prctl: the launcher may start us from a thread that ends before it does
    die_with_parent(_os.getppid(), pdeathsig=False, watchdog=True)

    with quiet_third_party(_os.environ.get("PIPELINE_VERBOSE") == "1"):
        _code = main(sys.argv[1:])
    _finish(_code)
