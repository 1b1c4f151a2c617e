"""The checkpoint contract of a component that holds training state (an EMA, an algorithm's networks, the
reference policy): it names its own tensor states and says whether each rank keeps its own, so that a
checkpoint stores and restores them without knowing what they are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class State:
    """Tensors a checkpoint keeps under one name: once (``per_rank`` False: the same on every rank, written
    by rank 0) or per rank (this rank's shards of sharded weights)."""

    tensors: dict[str, torch.Tensor]
    per_rank: bool = False


class Stateful(Protocol):
    def checkpoint_state(self) -> dict[str, State]:
        """The component's tensor states by name (a name is a file of the checkpoint; empty: nothing to keep)."""
        ...

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        """Restore from ``saved``, every named state of a checkpoint (the shared ones and this rank's own), in
        place; ``source`` names the checkpoint in the ValueError a mismatch raises."""
        ...
