"""The ParallelBackend contract, and its single-process and DDP implementations (FSDP2 in ``fsdp.py``,
DeepSpeed ZeRO in ``zero.py``; the optimizer step they share in ``stepping.py``, weight copies in ``weights.py``)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from trainer.distributed.stepping import (
    check_auxiliary_count,
    clip_gradients,
    finite_step,
    loss_scaler,
    refuse_low_precision_updates,
)
from trainer.distributed.weights import checked_trainable, main_only_copy, materialize, skeleton, trainable


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int = 0
    """This machine's index among the job's (torchrun's GROUP_RANK)."""
    sequence_parallel: int = 1
    """Ranks per sequence-parallel group (``parallel.sequence_parallel``): consecutive ranks that hold the same
    samples and split each one's tokens; a group is one data-parallel replica."""

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica: what data sharding, seeds and reward gathering count in."""
        return self.rank // self.sequence_parallel

    @property
    def replicas(self) -> int:
        """The number of data-parallel replicas (ranks / ``sequence_parallel``)."""
        return self.world_size // self.sequence_parallel

    @property
    def spans_machines(self) -> bool:
        """Whether the job spans more than one machine."""
        return self.world_size > self.local_world_size


def detect_world() -> World:
    """The process's place in the job, from torchrun's environment (one process when absent)."""
    env = os.environ
    return World(
        int(env.get("RANK", 0)),
        int(env.get("WORLD_SIZE", 1)),
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("LOCAL_WORLD_SIZE", 1)),
        int(env.get("GROUP_RANK", 0)),
    )


class ParallelBackend(Protocol):
    world: World
    device: torch.device
    sharded_optimizer_state: bool
    """True when ``optimizer_state()`` holds only this rank's partition: checkpoints then keep one optimizer
    file per rank and resume needs the same world size. False: rank 0's state is the whole state."""

    def prepare(
        self,
        module: nn.Module,
        params: Iterable[nn.Parameter],
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        shard_units: tuple[type[nn.Module], ...] = (),
    ) -> nn.Module:
        """Wrap ``module`` for training and build the optimizer over ``params``; returns the module to call.
        ``shard_units`` are the block classes a sharding backend shards one by one (the adapter's)."""
        ...

    def prepare_auxiliary(
        self, module: nn.Module, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    ) -> nn.Module:
        """Wrap an algorithm's own trainable network (e.g. a critic) with its own optimizer; it is
        synchronised, stepped, reset and checkpointed together with the main one. Returns the module to call."""
        ...

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Context for one forward+backward: gradients are synchronised only when ``enabled``."""
        ...

    def sampling(self) -> contextlib.AbstractContextManager:
        """Context for a run of no-grad forwards (a rollout, an evaluation): a sharding backend may keep the
        parameters gathered across them rather than gathering them in every forward. Nothing may write the
        parameters inside it."""
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
        """The optimizer state for a checkpoint, {"main": ..., "auxiliary": [...]} (collective: every rank
        calls it). See ``sharded_optimizer_state`` for whose part it holds."""
        ...

    def load_optimizer_state(self, state: dict) -> None:
        """Restore what ``optimizer_state`` returned (rank 0's, or this rank's when sharded); call it after
        the weights are loaded (DeepSpeed re-derives its master weights)."""
        ...

    def local_shards(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """The tensors holding this rank's part of each parameter (the whole parameter when unsharded),
        detached and writable in place: what EMA and other per-element state is kept over."""
        ...

    def gathered(self, params: Iterable[nn.Parameter]) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Context (collective) giving the full value of each parameter on every rank, in order. Read-only:
        write through ``local_shards`` or ``load_trainable_state``."""
        ...

    def trainable_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Full values of ``module``'s trainable parameters by name, on the CPU, for a checkpoint
        (collective; rank 0 gets them, other ranks an empty dict)."""
        ...

    def load_trainable_state(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load full values (every rank passes the same ``state``) into ``module``'s trainable parameters,
        each rank keeping its own part; a missing or unexpected name raises a ValueError."""
        ...

    def frozen_copy(self, module: nn.Module) -> nn.Module:
        """A plain (unwrapped, unsharded) copy of prepared ``module`` with its current full weights on every
        rank, frozen and in eval mode: a reference network (collective). A sharded network cannot be
        deep-copied, so this is how a full-fine-tuning reference is made under every backend."""
        ...

    def reference(self, module: nn.Module, spec) -> nn.Module:
        """The reference policy ``spec`` (a ``trainer.models.reference.ReferenceSpec``) describes, of prepared
        ``module`` as it is now, callable under this backend (collective): a ``frozen_copy``, or a view of
        ``module`` that puts the swapped parameters' frozen values in place the way this backend's forward
        reads them."""
        ...

    def main_copy(self, module: nn.Module) -> nn.Module | None:
        """``frozen_copy`` on rank 0's CPU only (None on the other ranks), gathered one parameter at a time
        (collective): what an export writes, without a full copy on any device or on any other rank."""
        ...

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (same shape on each) along dim 0, rank-major."""
        ...

    def gather_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every data-parallel replica's ``tensor`` along dim 0, replica-major: ``gather`` with one
        rank per sequence-parallel group (its ranks hold the same samples)."""
        ...

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Average scalar metrics over ranks."""
        ...

    def broadcast(self, obj: object) -> object:
        """Rank 0's ``obj`` on every rank (small picklable control data only, never network input)."""
        ...

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order (small picklable control data only, never network input)."""
        ...

    def from_group_leader(self, obj: object) -> object:
        """The ``obj`` of the first rank of this rank's sequence-parallel group, on each of its ranks (what one
        rank of a group fetched for all, e.g. its rewards); ``obj`` itself without sequence parallelism."""
        ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class SingleProcess:
    """One process, no collectives."""

    sharded_optimizer_state = False
    name = "single"
    """``parallel.backend``'s value for this class, for messages."""

    def __init__(self, device: torch.device):
        self.world = World(0, 1, 0, 1)
        self.device = device
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[nn.Parameter] = []
        self.auxiliary: list[tuple[list[nn.Parameter], torch.optim.Optimizer]] = []
        self.skeletons: dict[int, nn.Module] = {}
        self.scaler = torch.amp.GradScaler(device.type, enabled=False)
        """Dynamic loss scaling, on when the policy computes in float16 (``prepare``); a pass-through otherwise."""

    def prepare(self, module, params, make_optimizer, shard_units=()):
        self.params = list(params)
        refuse_low_precision_updates(self.params, self.name)
        self.skeletons[id(module)] = skeleton(module)
        self.optimizer = make_optimizer(self.params)
        self.scaler = loss_scaler(module, self.device)
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

    def sampling(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, max_grad_norm: float) -> float:
        """A step whose gradients are not finite is skipped (the norm returned is then inf or nan); with loss
        scaling the scale also halves, and 2000 clean steps double it."""
        self.scaler.unscale_(self.optimizer)
        norm = clip_gradients(self.params, max_grad_norm)
        finite_step(self.scaler, self.optimizer, norm)
        self._step_auxiliary(max_grad_norm)
        self.scaler.update()
        return norm

    def _step_auxiliary(self, max_grad_norm: float) -> None:
        """Clip and step each auxiliary network (replicated: its gradients are whole on every rank)."""
        for params, opt in self.auxiliary:
            self.scaler.unscale_(opt)
            finite_step(self.scaler, opt, clip_gradients(params, max_grad_norm))

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def reset_optimizer(self) -> None:
        for opt in self._optimizers():
            opt.state.clear()

    def optimizer_state(self) -> dict:
        return {
            "main": self.optimizer.state_dict(),
            "auxiliary": self._auxiliary_state(),
            "scaler": self.scaler.state_dict(),
        }

    def _auxiliary_state(self) -> list[dict]:
        return [opt.state_dict() for _, opt in self.auxiliary]

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["main"])
        self._load_auxiliary_state(state)
        self._load_scaler_state(state)

    def _load_auxiliary_state(self, state: dict) -> None:
        check_auxiliary_count(state, len(self.auxiliary))
        for (_, opt), saved in zip(self.auxiliary, state["auxiliary"], strict=True):
            opt.load_state_dict(saved)

    def _load_scaler_state(self, state: dict) -> None:
        if state.get("scaler"):  # empty when scaling is off
            self.scaler.load_state_dict(state["scaler"])

    def local_shards(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        return [p.detach() for p in params]

    @contextlib.contextmanager
    def gathered(self, params: Iterable[nn.Parameter]) -> Iterator[list[torch.Tensor]]:
        yield [p.detach() for p in params]

    def trainable_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        if self.world.rank != 0:
            return {}
        return {name: p.detach().cpu().clone() for name, p in trainable(module)}

    @torch.no_grad()
    def load_trainable_state(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        for name, p in checked_trainable(module, state):
            p.copy_(state[name])

    @torch.no_grad()
    def frozen_copy(self, module: nn.Module) -> nn.Module:
        module = getattr(module, "module", module)  # DDP's wrapper
        return materialize(
            self.skeletons[id(module)],
            {n: p.detach().clone() for n, p in module.named_parameters()},
            dict(module.named_buffers()),
        )

    def reference(self, module: nn.Module, spec) -> nn.Module:
        """Whole weights in every forward: the spec's own single-device view (a functional call)."""
        return spec.build(module, self.frozen_copy)

    @torch.no_grad()
    def main_copy(self, module: nn.Module) -> nn.Module | None:
        module = getattr(module, "module", module)  # DDP's wrapper
        params = () if self.world.rank else ((n, p.detach()) for n, p in module.named_parameters())
        return main_only_copy(self.world.rank, self.skeletons[id(module)], params, module)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        every, size = self.gather(tensor), self.world.sequence_parallel
        return every if size == 1 else every.unflatten(0, (self.world.world_size, -1))[::size].flatten(0, 1)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        return dict(values)

    def broadcast(self, obj: object) -> object:
        return obj

    def all_gather_object(self, obj: object) -> list[object]:
        return [obj]

    def from_group_leader(self, obj: object) -> object:
        return obj

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class DDP(SingleProcess):
    """torch DistributedDataParallel; gradients all-reduced in backward, skipped while accumulating."""

    name = "ddp"

    def __init__(self, device: torch.device, world: World, dist_backend: str):
        super().__init__(device)
        self.world = world
        init_process_group(device, dist_backend)
        self.modules: list[nn.Module] = []
        self.sequence = None
        if world.sequence_parallel > 1:
            from trainer.distributed.sequence import SequenceParallel  # imports diffusers: only when asked for

            self.sequence = SequenceParallel(world.rank, world.world_size, world.sequence_parallel, device)

    def prepare(self, module, params, make_optimizer, shard_units=()):
        module = super().prepare(module, params, make_optimizer, shard_units)
        return self._wrap_auxiliary(self._split_sequences(module))

    def _split_sequences(self, module: nn.Module) -> nn.Module:
        """With ``parallel.sequence_parallel`` > 1, ``module``'s tokens split over its group (in place). Applied to
        the live denoiser after its skeleton is taken, and to each frozen copy: diffusers' hooks close over the
        module they were installed on, so a deep copy's would run the original's forward."""
        if self.sequence is not None:
            self.sequence.apply(module)
        return module

    def frozen_copy(self, module: nn.Module) -> nn.Module:
        return self._split_sequences(super().frozen_copy(module))

    def step(self, max_grad_norm: float) -> float:
        self._sum_sequence_shares()
        return super().step(max_grad_norm)

    @torch.no_grad()
    def _sum_sequence_shares(self) -> None:
        """The reduction averaged the main gradients over every rank; a sequence-parallel group's ranks each held a
        share of one replica's gradient, to be summed: multiply by the group size."""
        if self.sequence is not None:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.sequence.size)

    def _wrap_auxiliary(self, module: nn.Module) -> nn.Module:
        wrapped = nn.parallel.DistributedDataParallel(
            module, device_ids=[self.device.index] if self.device.type == "cuda" else None
        )
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
        local = tensor.contiguous().to(self.device)  # NCCL gathers only GPU tensors; rewards live on the host
        parts = [torch.empty_like(local) for _ in range(self.world.world_size)]
        dist.all_gather(parts, local)
        return torch.cat(parts).to(tensor.device)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return {k: float(v) / self.world.world_size for k, v in zip(keys, t.tolist(), strict=True)}

    def broadcast(self, obj: object) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        gathered = [None] * self.world.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def from_group_leader(self, obj: object) -> object:
        if self.sequence is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.sequence.leader, group=self.sequence.group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_process_group(device: torch.device, dist_backend: str) -> None:
    """Join torchrun's process group (once per process)."""
    if not dist.is_initialized():
        dist.init_process_group(
            dist_backend, timeout=datetime.timedelta(minutes=30), device_id=device if device.type == "cuda" else None
        )
