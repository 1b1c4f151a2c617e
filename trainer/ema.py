"""Exponential moving average of the trainable weights, kept per shard so it works under every backend.

    ema <- decay ema + (1 - decay) theta      every ``every`` optimizer steps
Evaluation (and sampling) can run with the EMA weights swapped in; it saves and loads its own checkpoint
state (``trainer.state.Stateful``). ``Shadow``, the swappable float32 copy it keeps, also holds other
lagged weights (DiffusionNFT's old policy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from trainer.state import State


class Shadow:
    """Float32 copies of ``tensors`` (the backend's local shards of the trainable parameters) that can be put in
    their place for a while (``swapped``) and are kept in checkpoints as one state."""

    what = "shadow copy"
    """What the copies are called in the messages about a checkpoint that does not fit them."""

    def __init__(self, tensors: list[torch.Tensor], per_rank: bool = False):
        self.tensors = tensors
        self.per_rank = per_rank
        """Whether ``tensors`` are shards (each rank keeps its own copies); copies of whole weights are the same
        on every rank: kept once, they resume on any number of ranks and export."""
        self.shadow = [t.detach().clone().float() for t in tensors]

    @torch.no_grad()
    def reset(self) -> None:
        """Restart the copies at the current weights."""
        for s, t in zip(self.shadow, self.tensors, strict=True):
            s.copy_(t)

    @torch.no_grad()
    def follow(self, decay: float) -> None:
        """copies <- decay copies + (1 - decay) weights (decay 0: a copy of the weights, bit for bit)."""
        if decay == 0.0:
            self.reset()
        else:
            torch._foreach_lerp_(self.shadow, [t.float() for t in self.tensors], 1.0 - decay)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped(self) -> Iterator[None]:
        """The copies in place of the trained weights inside the block; the trained ones after it, bit for bit.
        Written through ``.data``, which autograd does not version: a graph built on the trained weights before
        the block (a loss not yet backpropagated) stays valid, as they are back before its backward."""
        saved = [t.detach().clone() for t in self.tensors]
        for t, s in zip(self.tensors, self.shadow, strict=True):
            t.data.copy_(s)
        try:
            yield
        finally:
            for t, s in zip(self.tensors, saved, strict=True):
                t.data.copy_(s)

    def state(self) -> dict[str, torch.Tensor]:
        return {f"{i:05d}": s for i, s in enumerate(self.shadow)}

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        if len(state) != len(self.shadow):
            raise ValueError(f"the checkpoint's {self.what} has {len(state)} tensors, this model {len(self.shadow)}")
        for i, s in enumerate(self.shadow):
            saved = state[f"{i:05d}"]
            if saved.shape != s.shape:
                raise ValueError(
                    f"the checkpoint's {self.what} tensor {i} is {tuple(saved.shape)} where this rank's "
                    f"shard is {tuple(s.shape)}: the {self.what} is kept per shard, so resume with the "
                    "parallel.backend and number of ranks the checkpoint was made with"
                )
            s.copy_(saved)


class EMA(Shadow):
    """Shadow copies of ``tensors`` (the backend's local shards of the trainable parameters)."""

    what = "EMA"

    def __init__(self, tensors: list[torch.Tensor], decay: float, every: int, per_rank: bool = False):
        if not 0 < decay < 1 or every < 1:
            raise ValueError(f"train.ema_decay={decay} must be in (0, 1) and train.ema_every={every} >= 1")
        super().__init__(tensors, per_rank)
        self.decay, self.every = decay, every

    @torch.no_grad()
    def step(self, optimizer_step: int) -> None:
        """Called after optimizer step ``optimizer_step`` (counted from 1); updates every ``every`` steps."""
        if optimizer_step % self.every == 0:
            self.follow(self.decay)

    def checkpoint_state(self) -> dict[str, State]:
        return {"ema": State(self.state(), self.per_rank)}

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        if "ema" not in saved:
            raise ValueError(
                f"{source} holds no EMA weights for this rank but train.ema_decay > 0: resume with the "
                "EMA settings the run started with (and, where the backend shards the weights, the "
                "same number of ranks)"
            )
        self.load_state(saved["ema"])
