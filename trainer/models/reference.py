"""The reference policy: described as data by the model layer (``ReferenceSpec``), made callable by whoever runs
the network. ``ReferenceSpec.build`` makes it for a single-device network; a parallel backend passes its own
copy function and, where its forward gathers weights from its own shards, its own ``swap``.

    FrozenCopy      a frozen copy of every weight (full fine-tuning; or refreshed from the policy)
    ReferenceView   the policy's own network with LoRA disabled and / or some parameters swapped for their
                    values as the reference was taken (a trained IP-Adapter's), costing only those values
"""

from __future__ import annotations

import copy as copying
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from trainer.state import State


def frozen_copy(net: nn.Module) -> nn.Module:
    """A frozen, eval-mode deep copy (one process; a parallel backend has its own, which gathers sharded
    weights)."""
    return copying.deepcopy(net).requires_grad_(False).eval()


class Swap(Protocol):
    """Frozen values of some parameters and how a forward runs with them in place of the live ones."""

    frozen: dict[str, torch.Tensor]
    """Parameter name -> its frozen value (this rank's shard of it where ``per_rank``)."""
    per_rank: bool
    """Whether each rank holds its own part of the values (checkpoints then keep one file per rank)."""

    def call(self, net: nn.Module, args: tuple, kwargs: dict): ...


class FunctionalSwap:
    """The values as they are now, passed to the call by ``torch.func.functional_call``: for a forward that
    computes with its modules' own parameters (one device, DDP, ZeRO-2)."""

    per_rank = False

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        self.frozen = {name: p.detach().clone() for name, p in named}

    def call(self, net: nn.Module, args: tuple, kwargs: dict):
        return torch.func.functional_call(net, self.frozen, args, kwargs, strict=False)


@dataclass(frozen=True)
class ReferenceSpec:
    """What the reference policy is, as data: a frozen copy of the denoiser (``copy``), or a view of the
    policy's network with LoRA disabled (``disable_lora``) and the parameters named in ``swapped`` replaced
    by their values when the reference is built."""

    copy: bool = False
    disable_lora: bool = False
    swapped: tuple[str, ...] = ()

    def build(
        self,
        net: nn.Module,
        copy: Callable[[nn.Module], nn.Module] = frozen_copy,
        swap: Callable[[list[tuple[str, nn.Parameter]]], Swap] = FunctionalSwap,
    ) -> Reference:
        """The reference of ``net`` (the policy's network) as it is now; ``copy`` and ``swap`` are how the
        caller copies weights and runs a forward with some of them replaced."""
        if self.copy:
            return FrozenCopy(copy(net))
        names = set(self.swapped)
        named = [(name, p) for name, p in net.named_parameters() if name in names]
        assert len(named) == len(names), "swapped parameters must belong to the network"
        return ReferenceView(net, self.disable_lora, swap(named) if named else None)


class Reference(nn.Module):
    """A frozen network computing the reference policy, called like the policy; it saves and loads its own
    checkpoint state (``trainer.state.Stateful``)."""

    holds_weights: bool
    """Whether it holds its own copy of every weight (a refresh may average the policy into it), rather than
    viewing the policy's."""

    def checkpoint_state(self) -> dict[str, State]:
        raise NotImplementedError

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        raise NotImplementedError


_SETTINGS = "resume with the model.ip_adapter and model.lora settings the run started with"


class FrozenCopy(Reference):
    """A reference holding a frozen copy ``net`` of the denoiser; checkpoints keep all of its weights."""

    holds_weights = True

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, *args, **kwargs):
        return self.net(*args, **kwargs)

    def checkpoint_state(self) -> dict[str, State]:
        return {"reference": State(self.net.state_dict())}

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        if "reference_swapped" in saved:
            raise ValueError(
                f"{source} holds a view's reference snapshot where this run's reference is a copy: {_SETTINGS}"
            )
        if "reference" in saved:
            self.net.load_state_dict(saved["reference"])


class ReferenceView(Reference):
    """The policy's network ``net`` called with its LoRA adapters off (``disable_lora``) and the values of
    ``swap`` in place of their parameters: no weights of its own beyond those values."""

    holds_weights = False

    def __init__(self, net: nn.Module, disable_lora: bool, swap: Swap | None = None):
        super().__init__()
        self.net, self.disable_lora, self.swap = net, disable_lora, swap

    def forward(self, *args, **kwargs):
        if self.disable_lora:
            self.net.disable_adapters()
        try:
            if self.swap is None:
                return self.net(*args, **kwargs)
            return self.swap.call(self.net, args, kwargs)
        finally:
            if self.disable_lora:
                self.net.enable_adapters()

    def checkpoint_state(self) -> dict[str, State]:
        """The swapped-in values (a view of the policy's own weights alone keeps nothing)."""
        if self.swap is None:
            return {}
        return {"reference_swapped": State(self.swap.frozen, self.swap.per_rank)}

    @torch.no_grad()
    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        if "reference_swapped" not in saved:
            return
        values, frozen = saved["reference_swapped"], self.swap.frozen if self.swap is not None else {}
        if values.keys() != frozen.keys():
            raise ValueError(
                f"{source} holds a reference snapshot of {len(values)} tensors where this run's "
                f"reference swaps in {len(frozen)}: {_SETTINGS}"
            )
        for name, tensor in values.items():
            if tensor.shape != frozen[name].shape:
                raise ValueError(
                    f"{source} holds {name} of the reference snapshot as {tuple(tensor.shape)} "
                    f"where this rank's is {tuple(frozen[name].shape)}: resume with the "
                    "parallel.backend and number of ranks the checkpoint was made with"
                )
            frozen[name].copy_(tensor)
