"""A network's weights outside its backend: the trainable ones by name (what a checkpoint holds), the skeleton
taken before a backend wraps or shards it, and frozen copies materialized from full values."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s parameters that train, by name."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def checked_trainable(module: nn.Module, state: dict[str, torch.Tensor]) -> list[tuple[str, nn.Parameter]]:
    """``trainable(module)``, after checking that ``state`` holds exactly those names (ValueError if not)."""
    named = trainable(module)
    names = {name for name, _ in named}
    if names != set(state):
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        raise ValueError(
            f"the saved trainable weights do not match this model (missing: {missing[:5]}, "
            f"unexpected: {unexpected[:5]}); resume with the model and LoRA settings they were "
            "saved with"
        )
    return named


def skeleton(module: nn.Module) -> nn.Module:
    """A structural copy of ``module`` whose parameters live on the meta device (no memory), taken before
    a backend shards or wraps it: ``materialize`` later fills it with full weights."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False) for p in module.parameters()}
    return copy.deepcopy(module, memo)


def main_only_copy(
    rank: int, template: nn.Module, params: Iterable[tuple[str, torch.Tensor]], module: nn.Module
) -> nn.Module | None:
    """``main_copy``'s work: on rank 0, ``materialize`` on the CPU from ``(name, full value)`` pairs, each copied
    there as it comes (a generator that gathers one parameter at a time then holds one full parameter on the
    device at most; the copies never share storage with the live weights, which an export's LoRA fusion would
    change), with ``module``'s buffers. The other ranks run through ``params`` (each gather is collective)."""
    if rank != 0:
        for _ in params:
            pass
        return None
    return materialize(
        template,
        {name: value.to("cpu", copy=True) for name, value in params},
        {name: b.cpu() for name, b in module.named_buffers()},
    )


def materialize(template: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> nn.Module:
    """A frozen eval-mode copy of ``template`` holding ``params`` (full values, by name) and ``buffers``."""
    memo: dict[int, object] = {
        id(p): nn.Parameter(params[name], requires_grad=False) for name, p in template.named_parameters()
    }
    memo.update({id(b): buffers[name].detach().clone() for name, b in template.named_buffers()})
    return copy.deepcopy(template, memo).requires_grad_(False).eval()
