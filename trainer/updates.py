"""The optimizer steps an objective (an algorithm, the warm-up) plans over a batch: each step's units accumulate
gradients, the backend steps (skipping a step whose gradients are not finite), and the loss statistics are averaged."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch

from trainer.algorithms.base import LossContext, balance_ranks
from trainer.checkpoint import Progress
from trainer.config.schema import TrainConfig
from trainer.health import count_skipped


def optimizer_steps(
    objective,
    batch,
    g: torch.Generator,
    ctx: LossContext,
    backend,
    progress: Progress,
    train: TrainConfig,
    after_step: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Run ``objective``'s optimizer steps over ``batch`` (calling ``after_step`` after each, counting skipped ones
    in ``progress``); returns averaged loss statistics, the mean finite gradient norm and the steps skipped."""
    values: dict[str, list[torch.Tensor]] = defaultdict(list)
    grad_norms = []
    steps = objective.plan(batch, g)
    if backend.world.world_size > 1:
        balance_ranks(steps, backend.gather)
    for units in steps:
        for i, unit in enumerate(units):
            with backend.sync(i == len(units) - 1):
                loss, stats = objective.loss(ctx, unit)  # the unit's part of the step's loss
                backend.backward(loss)
            for k, v in stats.items():  # kept on the device: reading each one would wait for the GPU per unit
                values[k].append(torch.as_tensor(v).detach().reshape(()))
        grad_norms.append(backend.step(train.max_grad_norm))  # not finite: skipped
        count_skipped(progress, grad_norms[-1], train.max_skipped_steps)
        if after_step is not None:
            after_step()
    means = {k: float(torch.stack([x.to(v[0].device, torch.float64) for x in v]).mean()) for k, v in values.items()}
    if grad_norms:
        finite = [n for n in grad_norms if math.isfinite(n)]
        means["grad_norm"] = sum(finite) / len(finite) if finite else math.nan
        means["skipped_steps"] = len(grad_norms) - len(finite)
    return means
