"""Single-process and DDP backends (FSDP2 and DeepSpeed plug in here with the same contract)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def detect_world() -> World:
    """The process's place in the job, from torchrun's environment (one process when absent)."""
    env = os.environ
    return World(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)),
                 int(env.get("LOCAL_WORLD_SIZE", 1)))


class ParallelBackend(Protocol):
    world: World
    device: torch.device

    def prepare(self, module: nn.Module, params: Iterable[nn.Parameter],
                make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> nn.Module:
        """Wrap ``module`` for training and build the optimizer over ``params``; returns the module to call."""
        ...

    def prepare_auxiliary(self, module: nn.Module,
                          make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> nn.Module:
        """Wrap an algorithm's own trainable network (e.g. a critic) with its own optimizer; it is
        synchronised, stepped, reset and checkpointed together with the main one. Returns the module to call."""
        ...

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for one forward+backward: gradients are synchronised only when ``enabled``."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, max_grad_norm: float) -> float:
        """Clip (when > 0), step the optimizer, zero gradients; returns the pre-clip gradient norm."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def reset_optimizer(self) -> None:
        """Forget the optimizer's moments (a new phase whose gradients have another scale)."""
        ...

    def optimizer_state(self) -> dict:
        """The optimizer's full state for a checkpoint (called on every rank)."""
        ...

    def load_optimizer_state(self, state: dict) -> None: ...

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (same shape on each) along dim 0, rank-major."""
        ...

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Average scalar metrics over ranks."""
        ...

    def broadcast(self, obj: object) -> object:
        """Rank 0's ``obj`` on every rank (small picklable control data only, never network input)."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class SingleProcess:
    """One process, no collectives."""

    def __init__(self, device: torch.device):
        self.world = World(0, 1, 0, 1)
        self.device = device
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[nn.Parameter] = []
        self.auxiliary: list[tuple[list[nn.Parameter], torch.optim.Optimizer]] = []

    def prepare(self, module, params, make_optimizer):
        self.params = list(params)
        self.optimizer = make_optimizer(self.params)
        return module

    def prepare_auxiliary(self, module, make_optimizer):
        params = [p for p in module.parameters() if p.requires_grad]
        self.auxiliary.append((params, make_optimizer(params)))
        return self._wrap_auxiliary(module)

    def _wrap_auxiliary(self, module: nn.Module) -> nn.Module:
        return module

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer] + [opt for _, opt in self.auxiliary]

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, max_grad_norm: float) -> float:
        norm = _clip(self.params, max_grad_norm)
        for params, _ in self.auxiliary:
            _clip(params, max_grad_norm)
        for opt in self._optimizers():
            opt.step()
            opt.zero_grad(set_to_none=True)
        return norm

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def reset_optimizer(self) -> None:
        for opt in self._optimizers():
            opt.state.clear()

    def optimizer_state(self) -> dict:
        return {"main": self.optimizer.state_dict(), "auxiliary": [opt.state_dict() for _, opt in self.auxiliary]}

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["main"])
        if len(state["auxiliary"]) != len(self.auxiliary):
            raise ValueError(f"the checkpoint holds {len(state['auxiliary'])} auxiliary optimizers, this run "
                             f"has {len(self.auxiliary)}: resume with the algorithm the checkpoint was made with")
        for (_, opt), saved in zip(self.auxiliary, state["auxiliary"], strict=True):
            opt.load_state_dict(saved)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        return dict(values)

    def broadcast(self, obj: object) -> object:
        return obj

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


def _clip(params: list[nn.Parameter], max_grad_norm: float) -> float:
    """Clip gradients to ``max_grad_norm`` (when > 0); returns the norm before clipping (0 without grads)."""
    if max_grad_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    grads = [p.grad.norm() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0


class DDP(SingleProcess):
    """torch DistributedDataParallel; gradients all-reduced in backward, skipped while accumulating."""

    def __init__(self, device: torch.device, world: World, dist_backend: str):
        super().__init__(device)
        self.world = world
        if not dist.is_initialized():
            dist.init_process_group(dist_backend, timeout=datetime.timedelta(minutes=30),
                                    device_id=device if device.type == "cuda" else None)
        self.modules: list[nn.parallel.DistributedDataParallel] = []

    def prepare(self, module, params, make_optimizer):
        self.params = list(params)
        self.optimizer = make_optimizer(self.params)
        return self._wrap_auxiliary(module)

    def _wrap_auxiliary(self, module: nn.Module) -> nn.Module:
        wrapped = nn.parallel.DistributedDataParallel(
            module, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.modules.append(wrapped)
        return wrapped

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for module in self.modules:
            stack.enter_context(module.no_sync())
        return stack

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return {k: float(v) / self.world.world_size for k, v in zip(keys, t.tolist(), strict=True)}

    def broadcast(self, obj: object) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_backend(kind: str, dist_backend: str, device: torch.device) -> ParallelBackend:
    """The backend ``kind`` names ("auto": DDP when torchrun started more than one process)."""
    world = detect_world()
    if kind == "auto":
        kind = "ddp" if world.world_size > 1 else "single"
    if kind == "single":
        if world.world_size > 1:
            raise ValueError("parallel.backend=single under torchrun with several processes; use ddp or auto")
        return SingleProcess(device)
    if dist_backend == "auto":
        dist_backend = "nccl" if device.type == "cuda" else "gloo"
    return DDP(device, world, dist_backend)

