"""The reference's parameter swap where a forward gathers its weights from the backend's own shards (FSDP2,
ZeRO-3): passing other values to the call cannot replace them, so the frozen values (this rank's shards of
them) are written into the shards for the call and the live ones back after it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn


class ShardSwap:
    """This rank's shards of ``named`` parameters as they are now, swapped into the live shards around each
    call (``trainer.models.reference.Swap``); checkpoints keep one copy per rank."""

    per_rank = True

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        local_shards: Callable[[Iterable[nn.Parameter]], list[torch.Tensor]],
    ):
        self.params = [p for _, p in named]  # the same objects for the whole run: their shards change in place
        self.local_shards = local_shards
        self.frozen = {name: shard.clone() for (name, _), shard in zip(named, local_shards(self.params), strict=True)}

    def call(self, net: nn.Module, args: tuple, kwargs: dict):
        with self._written_into_shards():
            return net(*args, **kwargs)

    @contextlib.contextmanager
    def _written_into_shards(self) -> Iterator[None]:
        # The policy's forward computed with gathered copies of its weights (FSDP2's unsharded parameters,
        # ZeRO-3's gathered ones), and its backward gathers them again: the shards may change in between.
        with torch.no_grad():
            targets = self.local_shards(self.params)
            live = [t.clone() for t in targets]
            for target, value in zip(targets, self.frozen.values(), strict=True):
                target.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for target, value in zip(targets, live, strict=True):
                    target.copy_(value)
