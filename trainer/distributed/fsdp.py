"""FSDP2: ``torch.distributed.fsdp.fully_shard`` over the adapter's block classes, then the root.

Each rank holds a 1/world slice of every parameter, gradient and optimizer moment (DTensors sharded on
dim 0); a block's full parameters exist only during its forward and backward. Checkpoints store full
(gathered) tensors: the trainable weights by name and the optimizer state from
``torch.distributed.checkpoint.state_dict`` with ``full_state_dict=True`` (offloaded to the CPU, written by
rank 0), so a checkpoint does not depend on the world size or the backend it was written under.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.distributed.backend import DDP, World
from trainer.distributed.stepping import check_auxiliary_count, finite_step, loss_scaler, refuse_low_precision_updates
from trainer.distributed.swap import ShardSwap
from trainer.distributed.weights import checked_trainable, main_only_copy, materialize, skeleton, trainable

logger = logging.getLogger(__name__)


def upcast_hint(module: nn.Module, param_dtype: torch.dtype) -> str | None:
    """What to tell a user whose bf16/fp16 weights FSDP2 would gather in a wider ``param_dtype`` (it casts
    every gathered parameter to it): the forwards then run at that dtype's speed and memory, which a
    low-precision model.dtype rarely means. None when nothing is upcast."""
    width = torch.finfo(param_dtype).bits
    low = sorted(
        {
            str(p.dtype).removeprefix("torch.")
            for p in module.parameters()
            if p.is_floating_point() and torch.finfo(p.dtype).bits < width
        }
    )
    if not low:
        return None
    wanted = str(param_dtype).removeprefix("torch.")
    return (
        f"fsdp2 gathers the model's {low[0]} weights as parallel.param_dtype={wanted}: forwards and backwards "
        f"run in {wanted}. Set parallel.param_dtype={low[0]} to compute in {low[0]}"
    )


class FSDP2(DDP):
    """Fully sharded data parallelism (per-parameter sharding, FSDP2)."""

    name = "fsdp2"

    def __init__(
        self,
        device: torch.device,
        world: World,
        dist_backend: str,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        cpu_offload: bool,
        gather_for_sampling: bool = True,
    ):
        super().__init__(device, world, dist_backend)
        self.gather_for_sampling = gather_for_sampling
        self.shard_options = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
        if cpu_offload:
            self.shard_options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        self.aux_modules: list[nn.Module] = []

    def prepare(self, module, params, make_optimizer, shard_units=()):
        param_dtype = self.shard_options["mp_policy"].param_dtype
        hint = upcast_hint(module, param_dtype)
        if hint is not None and self.world.rank == 0:
            logger.warning(hint)
        self.scaler = loss_scaler(module, self.device, param_dtype, ShardedGradScaler)
        self.params = self._shard(module, params, shard_units)
        self._split_sequences(module)
        self.optimizer = make_optimizer(self.params)
        return module

    def prepare_auxiliary(self, module, make_optimizer):
        params = self._shard(module, [p for p in module.parameters() if p.requires_grad], ())
        self.auxiliary.append((params, make_optimizer(params)))
        self.aux_modules.append(module)
        return module

    def _shard(
        self, module: nn.Module, params: Iterable[nn.Parameter], shard_units: tuple[type[nn.Module], ...]
    ) -> list[nn.Parameter]:
        """Shard ``module`` in place (each ``shard_units`` block, then the root); returns the sharded
        parameters that replace ``params`` (fully_shard registers new DTensor parameters)."""
        params = list(params)
        refuse_low_precision_updates(params, self.name)
        wanted = {id(p) for p in params}
        names = [name for name, p in module.named_parameters() if id(p) in wanted]
        assert len(names) == len(wanted), "params must belong to the module"
        self.skeletons[id(module)] = skeleton(module)
        for block in module.modules():
            if shard_units and isinstance(block, shard_units) and block is not module:
                fully_shard(block, **self.shard_options)
        # Explicit for the root too (FSDP2 otherwise keeps the root's gathered parameters after a forward):
        # writes into the shards (EMA swap, loading) must be seen by the next forward.
        fully_shard(module, reshard_after_forward=True, **self.shard_options)
        self.modules.append(module)
        sharded = dict(module.named_parameters())
        return [sharded[name] for name in names]

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        return self._gradient_sync(enabled)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """With ``gather_for_sampling``, each block stays unsharded after its first forward until the context
        ends (one all-gather per block per rollout instead of one per denoising step), then every block
        reshards, so the next forward gathers the weights the optimizer (or an EMA swap) wrote."""
        if not self.gather_for_sampling:
            yield
            return
        for module in self.modules:
            module.set_reshard_after_forward(False)
        try:
            yield
        finally:
            for module in self.modules:
                module.set_reshard_after_forward(True)
                for block in module.modules():
                    if isinstance(block, FSDPModule):
                        block.reshard()

    @contextlib.contextmanager
    def _gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Without sync, gradients accumulate unsharded on each rank and are reduce-scattered in the next
        synchronised backward."""
        for module in self.modules:
            module.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            for module in self.modules:
                module.set_requires_gradient_sync(True)

    def step(self, max_grad_norm: float) -> float:
        self._sum_sequence_shares()
        for opt in self._optimizers():
            self.scaler.unscale_(opt)  # ShardedGradScaler: whether any rank's shard overflowed, agreed by all
        norms = [_clip_sharded(self.params, max_grad_norm)]
        norms += [_clip_sharded(params, max_grad_norm) for params, _ in self.auxiliary]
        for opt, norm in zip(self._optimizers(), norms, strict=True):
            finite_step(self.scaler, opt, norm)  # a norm reduced over every rank's shards: one decision
        self.scaler.update()
        return norms[0]

    def optimizer_state(self) -> dict:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "main": get_optimizer_state_dict(self.modules[0], self.optimizer, options=options),
            "auxiliary": [
                get_optimizer_state_dict(m, opt, options=options)
                for m, (_, opt) in zip(self.aux_modules, self.auxiliary, strict=True)
            ],
            "scaler": self.scaler.state_dict(),
        }

    def load_optimizer_state(self, state: dict) -> None:
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.modules[0], self.optimizer, state["main"], options=options)
        check_auxiliary_count(state, len(self.auxiliary))
        for m, (_, opt), saved in zip(self.aux_modules, self.auxiliary, state["auxiliary"], strict=True):
            set_optimizer_state_dict(m, opt, saved, options=options)
        self._load_scaler_state(state)

    @torch.no_grad()
    def local_shards(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        return [p.to_local() if isinstance(p, DTensor) else p.detach() for p in params]

    @contextlib.contextmanager
    def gathered(self, params: Iterable[nn.Parameter]) -> Iterator[list[torch.Tensor]]:
        with torch.no_grad():
            yield [_full(p) for p in params]

    @torch.no_grad()
    def trainable_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        state = {}
        for name, p in trainable(module):  # one parameter at a time: never the whole model at once
            full = _full(p).cpu()
            if self.world.rank == 0:
                state[name] = full
        return state

    @torch.no_grad()
    def load_trainable_state(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        for name, p in checked_trainable(module, state):
            if isinstance(p, DTensor):
                full = state[name].to(p.device, p.dtype)
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(state[name])

    @torch.no_grad()
    def frozen_copy(self, module: nn.Module) -> nn.Module:
        """Unsharded on every rank (not sharded again): its forwards then need no collective (but their
        sequence-parallel group's, whose ranks call it alike), so replicas may call it different numbers of
        times; it costs one full denoiser per rank."""
        params = {name: _full(p).to(self.device) for name, p in module.named_parameters()}
        return self._split_sequences(materialize(self.skeletons[id(module)], params, dict(module.named_buffers())))

    def reference(self, module: nn.Module, spec) -> nn.Module:
        """The forward gathers the weights from this rank's shards: swapped values are written into them."""
        return spec.build(module, self.frozen_copy, lambda named: ShardSwap(named, self.local_shards))

    @torch.no_grad()
    def main_copy(self, module: nn.Module) -> nn.Module | None:
        gathered = ((name, _full(p)) for name, p in module.named_parameters())
        return main_only_copy(self.world.rank, self.skeletons[id(module)], gathered, module)


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole value of ``p`` (collective for a DTensor; on the device the shard lives on)."""
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _clip_sharded(params: list[nn.Parameter], max_grad_norm: float) -> float:
    """``clip_grad_norm_`` over DTensor gradients: the norm is reduced over the shards of every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
