"""Sequence (context) parallelism: each sample's tokens split over the ranks of a group, attention exchanged by
Ulysses all-to-all, applied from outside to a denoiser whose diffusers class declares a context-parallel plan.

The plan (``_cp_plan`` of WanTransformer3DModel, FluxTransformer2DModel, QwenImageTransformer2DModel, ...) names
where diffusers' hooks split the token inputs and where they gather the output; the attention processors then
run diffusers' templated Ulysses attention (``TemplatedUlyssesAttention``: all-to-all from [S/P tokens, H heads]
to [S tokens, H/P heads] and back, with its own backward) over this group. Cross-attention to text keeps its keys
and values whole (Wan's attn2 passes no parallel config). Every rank of a group computes the same gathered
output, so the loss is replicated: each rank's parameter gradients hold its tokens' share, and the backend
multiplies the reduced gradients by the group size (``DDP._sum_sequence_shares``).
"""

from __future__ import annotations

import torch
from diffusers.hooks.context_parallel import ContextParallelGatherHook, ContextParallelSplitHook, _get_submodule_by_name
from diffusers.hooks.hooks import HookRegistry
from diffusers.models._modeling_parallel import (
    ContextParallelConfig,
    ContextParallelInput,
    ContextParallelOutput,
    ParallelConfig,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh


class SequenceParallel:
    """The sequence-parallel groups of a job of ``world_size`` ranks (consecutive ranks, ``size`` each) and the
    diffusers parallel config whose Ulysses mesh is the group of ``rank``."""

    def __init__(self, rank: int, world_size: int, size: int, device: torch.device):
        mesh = init_device_mesh(
            device.type, (world_size // size, 1, size), mesh_dim_names=("replica", "ring", "ulysses")
        )  # collective: every rank builds every group
        self.size = size
        self.group, self.leader = mesh["ulysses"].get_group(), rank - rank % size  # this rank's group, its first
        self.config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=size, mesh=mesh))
        self.config.setup(rank, world_size, device, mesh=mesh)

    def apply(self, denoiser: nn.Module) -> None:
        """Install the split and gather hooks of ``denoiser``'s plan and the parallel config in its attention
        processors (in place); a ValueError naming the fix for a model it cannot split."""
        plan = getattr(type(denoiser), "_cp_plan", None)
        name = type(denoiser).__name__
        if not plan:
            raise ValueError(
                f"parallel.sequence_parallel={self.size}: {name} has no context-parallel plan (diffusers' "
                "_cp_plan); use a model whose transformer has one (Wan, Flux, Flux.2, Qwen-Image) or "
                "parallel.sequence_parallel=1"
            )
        heads = getattr(getattr(denoiser, "config", None), "num_attention_heads", None)
        if heads is not None and heads % self.size:
            raise ValueError(
                f"parallel.sequence_parallel={self.size} does not divide {name}'s {heads} attention heads "
                "(Ulysses gives each rank heads/size of them): choose a divisor of the head count"
            )
        for processor in _attention_processors(denoiser, self.size):
            processor._parallel_config = self.config
        for where, entry in plan.items():
            modules = _get_submodule_by_name(denoiser, where)
            for module in modules if isinstance(modules, list) else [modules]:
                registry = HookRegistry.check_if_exists_or_initialize(module)
                if isinstance(entry, dict):
                    registry.register_hook(_CheckedSplitHook(entry, self.config.context_parallel_config), _HOOK)
                else:
                    outputs = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
                    registry.register_hook(
                        ContextParallelGatherHook(outputs, self.config.context_parallel_config), _GATHER
                    )


_HOOK, _GATHER = "sequence_parallel_split", "sequence_parallel_gather"


def _attention_processors(denoiser: nn.Module, size: int) -> list[object]:
    """The attention processors of ``denoiser``, each able to take a parallel config (ValueError for one that
    cannot: it would attend over its own tokens only, silently wrong)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    processors = []
    for module in denoiser.modules():
        if isinstance(module, Attention | AttentionModuleMixin) and module.processor is not None:
            if not hasattr(module.processor, "_parallel_config"):
                raise ValueError(
                    f"parallel.sequence_parallel={size}: the attention processor "
                    f"{type(module.processor).__name__} cannot exchange tokens between ranks (an IP-Adapter's or "
                    "a custom one); train it with parallel.sequence_parallel=1"
                )
            processors.append(module.processor)
    return processors


class _CheckedSplitHook(ContextParallelSplitHook):
    """diffusers' split hook, with a one-line ValueError for a sequence that does not divide over the group
    (diffusers asserts). A tensor of another rank than the plan's passes whole, as in diffusers (Wan 2.1's
    timestep: one per sample, not one per token)."""

    def _prepare_cp_input(self, x: torch.Tensor, cp_input: ContextParallelInput) -> torch.Tensor:
        size = self.parallel_config.ulysses_degree
        if (
            cp_input.expected_dims is not None
            and x.dim() == cp_input.expected_dims
            and x.shape[cp_input.split_dim] % size
        ):
            raise ValueError(
                f"parallel.sequence_parallel={size} does not divide a sequence of {x.shape[cp_input.split_dim]} "
                f"tokens (input of shape {tuple(x.shape)}): choose a resolution, frame count or text length whose "
                "token count is a multiple of it"
            )
        return super()._prepare_cp_input(x, cp_input)
