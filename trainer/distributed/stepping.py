"""The optimizer step every backend shares: clipping, dynamic loss scaling, skipping a step whose gradients are
not finite, and the checks on what an optimizer may update or load."""

from __future__ import annotations

import math

import torch
from torch import nn


def finite_step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, norm: float) -> None:
    """Step ``optimizer`` through ``scaler`` unless the gradients' ``norm`` (the same on every rank: taken over
    the reduced gradients) is not finite, then zero the gradients. An enabled scaler skips such a step itself; in
    bf16 or float32 one NaN would otherwise make every weight NaN."""
    if scaler.is_enabled() or math.isfinite(norm):
        scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def clip_gradients(params: list[nn.Parameter], max_grad_norm: float) -> float:
    """Clip gradients to ``max_grad_norm`` (when > 0); returns the norm before clipping (0 without grads)."""
    if max_grad_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    grads = [p.grad.norm() for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0


def loss_scaler(
    module: nn.Module,
    device: torch.device,
    compute_dtype: torch.dtype | None = None,
    scaler_class: type = torch.amp.GradScaler,
) -> torch.amp.GradScaler:
    """Dynamic loss scaling, enabled when ``module`` computes in float16 (its weights, or ``compute_dtype``):
    the loss is multiplied by the scale (65536 at first) before backward, so that gradients below fp16's
    smallest value (6e-8) do not flush to zero in the network's backward, and divided out before clipping."""
    fp16 = compute_dtype == torch.float16 or any(p.dtype == torch.float16 for p in module.parameters())
    return scaler_class(device.type, enabled=fp16)


def refuse_low_precision_updates(params: list[nn.Parameter], backend: str) -> None:
    """ValueError for trainable weights in bf16/fp16 under a backend whose optimizer updates them in place (no
    float32 master copy): bf16 rounds away Adam steps below 1/256 of a weight, and in fp16 Adam's eps underflows.
    LoRA and IP-Adapter weights are float32 already (``trainer.models.trainable``); this is full fine-tuning."""
    low = sorted({str(p.dtype).removeprefix("torch.") for p in params if p.dtype in (torch.bfloat16, torch.float16)})
    if low:
        raise ValueError(
            f"full fine-tuning with model.dtype={low[0]} under parallel.backend={backend} would update the weights "
            f"in {low[0]}, losing small optimizer steps. Use model.dtype=float32 (parallel.backend=fsdp2 with "
            f"parallel.param_dtype={low[0]} still computes in {low[0]}), parallel.backend=zero2/zero3 with "
            f"parallel.param_dtype={low[0]} (float32 master weights), or LoRA (model.lora), whose weights stay "
            "float32"
        )


def check_auxiliary_count(state: dict, expected: int) -> None:
    if len(state["auxiliary"]) != expected:
        raise ValueError(
            f"the checkpoint holds {len(state['auxiliary'])} auxiliary optimizers, this run "
            f"has {expected}: resume with the algorithm the checkpoint was made with"
        )
