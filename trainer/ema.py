"""Exponential moving average of the trainable weights, kept per shard so it works under every backend.

    ema <- decay ema + (1 - decay) theta      every ``every`` optimizer steps
Evaluation (and sampling) can run with the EMA weights swapped in; it saves and loads its own checkpoint
state (``trainer.state.Stateful``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from trainer.state import State


class EMA:
    """Shadow copies of ``tensors`` (the backend's local shards of the trainable parameters)."""

    def __init__(self, tensors: list[torch.Tensor], decay: float, every: int, per_rank: bool = False):
        if not 0 < decay < 1 or every < 1:
            raise ValueError(f"train.ema_decay={decay} must be in (0, 1) and train.ema_every={every} >= 1")
        self.tensors = tensors
        self.per_rank = per_rank
        """Whether ``tensors`` are shards (each rank keeps its own EMA); an EMA of whole weights is the same on
        every rank: kept once, it resumes on any number of ranks and exports."""
        self.decay, self.every = decay, every
        self.shadow = [t.detach().clone().float() for t in tensors]

    @torch.no_grad()
    def reset(self) -> None:
        """Restart the average at the current weights (e.g. when RL begins after the warm-up)."""
        for s, t in zip(self.shadow, self.tensors, strict=True):
            s.copy_(t)

    @torch.no_grad()
    def step(self, optimizer_step: int) -> None:
        """Called after optimizer step ``optimizer_step`` (counted from 1); updates every ``every`` steps."""
        if optimizer_step % self.every:
            return
        torch._foreach_lerp_(self.shadow, [t.float() for t in self.tensors], 1.0 - self.decay)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped(self) -> Iterator[None]:
        """The EMA weights in place of the trained ones inside the block; the trained ones after it."""
        saved = [t.detach().clone() for t in self.tensors]
        for t, s in zip(self.tensors, self.shadow, strict=True):
            t.copy_(s)
        try:
            yield
        finally:
            for t, s in zip(self.tensors, saved, strict=True):
                t.copy_(s)

    def state(self) -> dict[str, torch.Tensor]:
        return {f"{i:05d}": s for i, s in enumerate(self.shadow)}

    @torch.no_grad()
    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        if len(state) != len(self.shadow):
            raise ValueError(f"the checkpoint's EMA has {len(state)} tensors, this model {len(self.shadow)}")
        for i, s in enumerate(self.shadow):
            saved = state[f"{i:05d}"]
            if saved.shape != s.shape:
                raise ValueError(f"the checkpoint's EMA tensor {i} is {tuple(saved.shape)} where this rank's shard is "
                                 f"{tuple(s.shape)}: the EMA is kept per shard, so resume with the parallel.backend "
                                 "and number of ranks the checkpoint was made with")
            s.copy_(saved)

    def checkpoint_state(self) -> dict[str, State]:
        return {"ema": State(self.state(), self.per_rank)}

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        if "ema" not in saved:
            raise ValueError(f"{source} holds no EMA weights for this rank but train.ema_decay > 0: resume with the "
                             "EMA settings the run started with (and, where the backend shards the weights, the "
                             "same number of ranks)")
        self.load_state(saved["ema"])
