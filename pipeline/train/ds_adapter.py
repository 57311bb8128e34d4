"""The one adapter over DeepSpeed. Nothing else imports ``deepspeed``.

The trainer talks to a narrow strategy (OpenRLHF's shape): ``forward``,
``backward``, ``optimizer_step``, ``save``, ``load``, ``is_rank_0``, plus
``barrier`` and ``all_reduce_sum``. Gradient accumulation is caller-owned
(DeepSpeed's ``managed_gradient_accumulation: false``): the packer decides how
many micro-batches a step has, ``backward`` only accumulates, and
``optimizer_step`` is the boundary (reduction + clip + AdamW + LR schedule).

One process without a launcher needs RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
MASTER_PORT (gloo): ``single_process_env`` sets them.

ZeRO-3 partitions every parameter across ranks (all of them: the persistence
threshold is 0, so the accounting is exact and even tiny test models are
really partitioned). The model is built partitioned (``zero3_init``;
see pipeline.train.model.load_causal_lm), the LM head is gathered only around the chunked
log-prob call (see pipeline.train.model.ChunkedHead), a frozen reference model
runs as an inference-only engine under the same stage (``inference_engine``),
and the published HF export is consolidated parameter by parameter on rank 0
(``consolidated_state_dict``). ``offload`` with ZeRO-3 moves both the
parameters and the optimizer state to CPU; the optimizer stays torch's AdamW
(DeepSpeed allows a client optimizer with offload when
``zero_force_ds_cpu_optimizer`` is false), so no C++ extension is compiled and
the update is the same arithmetic as in ZeRO-0.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

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


@contextmanager
def single_process_scope() -> Iterator[None]:
    """``single_process_env`` for the duration of the block; the keys it set are removed afterwards (the
    process group stays up; the fake launcher env does not)."""
    added = single_process_env()
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError:  # pragma: no cover
        raise MissingExtraError("deepspeed", "gpu") from None
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # ZeRO-3's collectives call the torch names deprecated in favour of *_single, once per call
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    if get_accelerator().device_name() == "cpu" and os.environ.get("PIPELINE_DS_SHM") != "1":
        # The CPU accelerator compiles a shared-memory all-reduce kernel on first
        # init (45 s - 3 min here) that only inference_all_reduce uses; training
        # collectives go through torch.distributed (gloo) either way.
        comm_torch: Any = sys.modules["deepspeed.comm.torch"]
        comm_torch.build_shm_op = lambda: None
    return deepspeed


def ds_config(*, zero_stage: int, precision: str, offload: bool, max_grad_norm: float,
              inference: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of the trainer (``inference=True``: of a frozen
    model's engine: same stage and parameter offload, no optimizer state)."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage in (1, 2):
        # the default 5e8-element buckets cost 1-3.5 s/step and 2.4 GB even on a tiny model
        zero.update(reduce_bucket_size=int(5e5), allgather_bucket_size=int(5e5))
    if zero_stage == 3:
        # memory first: every parameter partitioned (threshold 0), released right after its module ran
        # (reuse distance 0: the LM head is full only for the chunked call, nothing stays gathered from
        # forward to backward), small buckets, and the optimizer stepping 1e7-element sub-groups (one
        # flat AdamW step over the whole partition makes several partition-sized temporaries)
        zero.update(reduce_bucket_size=int(5e5), stage3_prefetch_bucket_size=int(5e5),
                    stage3_param_persistence_threshold=0, stage3_max_live_parameters=int(1e7),
                    stage3_max_reuse_distance=0, sub_group_size=int(1e7))
        if offload:
            zero["offload_param"] = {"device": "cpu"}
    if offload and not inference:
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


def init_distributed() -> None:
    """The default process group (gloo on CPU, nccl on GPUs), once per process."""
    ds = _import_deepspeed()
    single_process_env()
    if not torch.distributed.is_initialized():
        ds.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    _drop_stale_groups()


def is_zero3(config: dict[str, Any] | None) -> bool:
    return bool(config and config.get("zero_optimization", {}).get("stage") == 3)


def zero3_init(config: dict[str, Any] | None):
    """Around building a model: under a ZeRO-3 config every parameter is
    partitioned as soon as its module is constructed (deepspeed.zero.Init), so
    no rank ever holds the whole model; any other config: a no-op."""
    if not is_zero3(config):
        return nullcontext()
    ds = _import_deepspeed()
    init_distributed()
    return ds.zero.Init(config_dict_or_path=config)


def gathered_for_write(param: torch.nn.Parameter):
    """The full tensor of a ZeRO-3 parameter, for rank 0 to overwrite; on exit
    rank 0's values are broadcast and every rank keeps its partition."""
    return _import_deepspeed().zero.GatheredParameters([param], modifier_rank=0)


class DeepSpeedStrategy:
    """DeepSpeed engine + torch AdamW + linear-warmup LR, behind a narrow interface."""

    def __init__(self, module: torch.nn.Module, *, lr: float, weight_decay: float, warmup_steps: int,
                 zero_stage: int, precision: str, offload: bool, max_grad_norm: float) -> None:
        ds = _import_deepspeed()
        init_distributed()
        self.max_grad_norm = max_grad_norm
        opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
        warm = max(warmup_steps, 0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        config = ds_config(zero_stage=zero_stage, precision=precision, offload=offload, max_grad_norm=max_grad_norm)
        self.engine, self.optimizer, _, self.scheduler = ds.initialize(
            model=module, optimizer=opt, lr_scheduler=sched, config=config, dist_init_required=False)
        self.zero_stage = zero_stage
        self.inference_config = ds_config(zero_stage=zero_stage, precision=precision, offload=offload,
                                          max_grad_norm=max_grad_norm, inference=True)

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

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (every rank must call this)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    @property
    def base_lr(self) -> float:
        return float(self.scheduler.base_lrs[0])

    def set_base_lr(self, lr: float) -> None:
        """This run's peak learning rate (the warmup schedule's base), from the schedule's start."""
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
        self.reset_lr()

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    # -- ZeRO-3 -------------------------------------------------------------
    def inference_engine(self, module: torch.nn.Module) -> torch.nn.Module:
        """A frozen model (the KL reference) under the same ZeRO stage, inference
        only: under ZeRO-3 its parameters are partitioned (and offloaded with
        ``offload``) exactly like the policy's, so it adds 1/world_size of a
        model per rank and no optimizer state. Build ``module`` inside
        ``load_causal_lm(..., ds_config=self.inference_config)``. Release it with
        ``release_inference_engine``."""
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
        if self.zero_stage != 3:
            return module.to(self.device)   # stages 0-2 partition optimizer state, which a frozen model has none of
        ds = _import_deepspeed()
        engine, *_ = ds.initialize(model=module, config=self.inference_config, dist_init_required=False)
        engine.eval()
        return engine

    @staticmethod
    def release_inference_engine(engine: torch.nn.Module) -> None:
        destroy = getattr(engine, "destroy", None)
        if callable(destroy):
            destroy()

    def consolidated_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """``module.state_dict()`` as full fp32 CPU tensors on rank 0 (None on the
        other ranks; every rank must call this). Under ZeRO-3 each parameter is
        gathered on its own, so rank 0 holds the full model once (the export)
        and the other ranks never do."""
        out: dict[str, torch.Tensor] = {}
        rank0 = self.is_rank_0()
        gathered = _import_deepspeed().zero.GatheredParameters if self.zero_stage == 3 else None
        first: dict[int, str] = {}
        for name, t in module.state_dict(keep_vars=True).items():
            if id(t) in first:                           # a tied weight: the same tensor, as HF expects
                if rank0:
                    out[name] = out[first[id(t)]]
                continue
            first[id(t)] = name
            if not (gathered and hasattr(t, "ds_id")):
                if rank0:
                    out[name] = t.detach().to("cpu", torch.float32)
                continue
            with gathered([t], modifier_rank=None):      # collective: every rank, same order
                if rank0:
                    out[name] = t.detach().to("cpu", torch.float32).clone()   # the gathered buffer is freed on exit
        return out if rank0 else None

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
