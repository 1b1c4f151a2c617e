"""A moving average of the policy's trainable weights, run as a view of the policy's network with the averaged
values swapped in: DGPO's and AWM's EMA policy (the authors' ``ema_ref`` / ``ema`` LoRA branch) and AWM's
sampling policy (decay 0, a copy).

    ema <- d ema + (1 - d) theta,   d = min(cap, ramp * optimizer steps) (ramp 0: d = cap)
The values are kept as the backend's reference views keep theirs (``trainer.models.reference``): whole weights
passed to a functional call, or this rank's shards written into the live ones around the call; with LoRA that
is the adapter's size, not a second denoiser. Checkpoints keep them under the average's own name.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.models.reference import ReferenceSpec
from trainer.state import State


def ramped_decay(cap: float, ramp: float, steps: int) -> float:
    """d = min(cap, ramp * steps), at least 0: the authors' linear ramp of the EMA policy's decay (ramp 0: cap)."""
    return max(0.0, min(cap, ramp * steps)) if ramp > 0 else cap


class EMAPolicy:
    """The policy's trainable weights averaged over its optimizer steps, callable like the policy (``predict``)."""

    def __init__(self, name: str):
        self.name = name
        """The checkpoint state's name (one per algorithm's average)."""
        self.view: Any = None
        self.live: Any = None

    def setup(self, adapter: Any, backend: Any) -> None:
        """Start the average at the policy's trainable weights, viewed the way ``backend`` swaps weights in."""
        named = [(n, p) for n, p in adapter.denoiser.named_parameters() if p.requires_grad]
        self.view = backend.reference(adapter.denoiser, ReferenceSpec(swapped=tuple(n for n, _ in named)))
        params = [p for _, p in named]
        self.live = lambda: backend.local_shards(params)  # the live values, as the view keeps its own
        assert list(self.view.swap.frozen) == [n for n, _ in named]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """ema <- decay ema + (1 - decay) theta; decay 0 copies the policy's weights exactly."""
        assert self.view is not None, "EMAPolicy.setup runs first (Algorithm.setup)"
        averaged = list(self.view.swap.frozen.values())
        if decay == 0.0:
            torch._foreach_copy_(averaged, self.live())
        else:
            torch._foreach_lerp_(averaged, self.live(), 1.0 - decay)

    def predict(self, ctx: Any, x_t: torch.Tensor, sigma: torch.Tensor, cond: Any) -> torch.Tensor:
        """The averaged policy's prediction (no CFG, no grad)."""
        assert self.view is not None, "EMAPolicy.setup runs first (Algorithm.setup)"
        with torch.no_grad():
            return ctx.adapter.predict(self.view, x_t, sigma, cond, 1.0)

    def checkpoint_state(self) -> dict[str, State]:
        if self.view is None:
            return {}
        return {self.name: State(dict(self.view.swap.frozen), self.view.swap.per_rank)}

    @torch.no_grad()
    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        if self.view is None:
            return
        frozen = self.view.swap.frozen
        values = saved.get(self.name)
        if values is None or values.keys() != frozen.keys():
            raise ValueError(
                f"{source} holds no {self.name} weights of this model: resume with the algorithm, "
                "model.lora and parallel settings the run started with"
            )
        for name, tensor in values.items():
            if tensor.shape != frozen[name].shape:
                raise ValueError(
                    f"{source} holds {self.name} {name} as {tuple(tensor.shape)} where this rank's is "
                    f"{tuple(frozen[name].shape)}: resume with the parallel.backend and number of "
                    "ranks the checkpoint was made with"
                )
            frozen[name].copy_(tensor)
