"""The one adapter over DeepSpeed. Nothing else imports ``deepspeed``.

The trainer talks to a narrow strategy (OpenRLHF's shape): ``forward``,
``backward``, ``optimizer_step``, ``save``, ``load``, ``is_rank_0``, plus
``barrier`` and ``all_reduce_sum``. Gradient accumulation is caller-owned
(DeepSpeed's ``managed_gradient_accumulation: false``): the packer decides how
many micro-batches a step has, ``backward`` only accumulates, and
``optimizer_step`` is the boundary (reduction + clip + AdamW + LR schedule).

One process without a launcher needs RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
MASTER_PORT (gloo): ``single_process_env`` sets them (shared/VERIFIED.md).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import IntegrityError, MissingExtraError, NotFoundError


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def single_process_env() -> list[str]:
    """Set the env a launcher would, for one process, if no launcher did.
    Returns the keys it set (the caller removes them afterwards, so an
    in-process caller, e.g. the demo, does not leak a fake launcher env into
    engines it starts later)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return []
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    values = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    added = [k for k in LAUNCHER_ENV if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    return added


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError:  # pragma: no cover
        raise MissingExtraError("deepspeed", "gpu") from None
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    if get_accelerator().device_name() == "cpu" and os.environ.get("PIPELINE_DS_SHM") != "1":
        # The CPU accelerator compiles a shared-memory all-reduce kernel on first
        # init (45 s - 3 min here) that only inference_all_reduce uses; training
        # collectives go through torch.distributed (gloo) either way.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


def ds_config(*, zero_stage: int, precision: str, offload: bool, max_grad_norm: float) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage in (1, 2):
        # default buckets cost 1-3.5 s/step and 2.4 GB on a tiny model (VERIFIED.md)
        zero.update(reduce_bucket_size=int(5e5), allgather_bucket_size=int(5e5))
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,      # bookkeeping only: batches are token-budgeted
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,   # the caller owns the step boundary
        "gradient_clipping": float(max_grad_norm),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,     # torch AdamW: no extension to compile
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def _drop_stale_groups() -> None:
    """Forget process groups DeepSpeed cached against an earlier default group.

    DeepSpeed caches its world / data-parallel groups in module globals. If
    something else in the process tore torch.distributed down and set it up
    again in between (vLLM's in-process engine does), those groups are no longer
    registered and the next ``deepspeed.initialize`` fails with "Group ... is not
    registered". Unregistered ones are dropped so DeepSpeed recreates them."""
    from deepspeed.utils import groups
    from torch.distributed import distributed_c10d as c10d

    registered = c10d._world.pg_group_ranks
    for name in dir(groups):
        if not (name.startswith("_") and name.endswith("_GROUP")):
            continue
        value = getattr(groups, name)
        if isinstance(value, dict):
            if any(g not in registered for g in value.values()):
                setattr(groups, name, {})
        elif value is not None and not isinstance(value, (int, str)) and value not in registered:
            setattr(groups, name, None)


class DeepSpeedStrategy:
    """DeepSpeed engine + torch AdamW + linear-warmup LR, behind a narrow interface."""

    def __init__(self, module: torch.nn.Module, *, lr: float, weight_decay: float, warmup_steps: int,
                 zero_stage: int, precision: str, offload: bool, max_grad_norm: float) -> None:
        ds = _import_deepspeed()
        single_process_env()
        if not torch.distributed.is_initialized():
            ds.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
        _drop_stale_groups()
        self.max_grad_norm = max_grad_norm
        opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
        warm = max(warmup_steps, 0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        config = ds_config(zero_stage=zero_stage, precision=precision, offload=offload, max_grad_norm=max_grad_norm)
        self.engine, self.optimizer, _, self.scheduler = ds.initialize(
            model=module, optimizer=opt, lr_scheduler=sched, config=config, dist_init_required=False)
        self.zero_stage = zero_stage

    # -- identity -----------------------------------------------------------
    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    def is_rank_0(self) -> bool:
        return self.rank == 0

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    # -- the step -------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        # losses arrive normalized over the whole step: no 1/gas scaling
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> dict[str, float | None]:
        """Reduce, clip, update, advance the LR. Returns grad norm (pre-clip) and the step's LR."""
        lr = float(self.engine.get_lr()[0])
        own_norm = None
        if self.zero_stage == 0 and self.world_size == 1:
            # DeepSpeed clips fp32 ZeRO-0 grads without keeping the norm; one process = exact
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            own_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = own_norm
        return {"grad_norm": None if norm is None else float(norm), "lr": lr}

    # -- collectives --------------------------------------------------------
    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    # -- state ----------------------------------------------------------------
    def save(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        """Model, optimizer and scheduler state (every rank calls this)."""
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=True)

    def load(self, directory: Path, tag: str, *, scheduler: bool = True) -> dict[str, Any]:
        """Restore model, optimizer and (unless ``scheduler=False``) LR scheduler;
        returns the client state. DeepSpeed only warns and returns (None, None)
        on a missing checkpoint: here that is an error, never a silent fresh start."""
        if not (Path(directory) / tag).is_dir():
            raise NotFoundError(f"DeepSpeed state {directory}/{tag} does not exist")
        path, client_state = self.engine.load_checkpoint(str(directory), tag=tag,
                                                         load_lr_scheduler_states=scheduler)
        if path is None:
            raise IntegrityError(f"DeepSpeed could not load {directory}/{tag}",
                                 hint="the checkpoint is incomplete; rerun without --resume to start over")
        return dict(client_state or {})

    def reset_lr(self) -> None:
        """After loading another run's optimizer state: this run's LR schedule, from its start."""
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["initial_lr"] = base
            group["lr"] = base * self.scheduler.lr_lambdas[0](0)
        self.scheduler.last_epoch = 0
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()
