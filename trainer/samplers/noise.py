"""Gaussian noise on a model's device from a generator on any device.

``torch.randn(..., generator=g, device=d)`` raises when ``g`` lives elsewhere than ``d``; the trainers seed
CPU generators for host-side draws (which steps to train, prompt order) and may pass the same kind of
generator to a rollout on a GPU. The rule here is diffusers' ``randn_tensor``'s: draw on the generator's
device, then move. A CPU generator therefore gives the same numbers on every device (reproducible across
machines, but a serial mt19937 draw plus a copy: slow at production sizes); a generator on the model's
device (CUDA: Philox, one kernel) is the fast choice there, and the trainer uses one.
"""

from __future__ import annotations

import torch


def generator_device(generator: torch.Generator | None, default: torch.device | str = "cpu") -> torch.device:
    """Where ``generator`` draws (``default`` without one)."""
    return torch.device(default) if generator is None else generator.device


def standard_normal(
    shape: tuple[int, ...] | torch.Size, generator: torch.Generator | None, device: torch.device | str
) -> torch.Tensor:
    """N(0, I) float32 of ``shape`` on ``device``, drawn on ``generator``'s device (``device`` without one)."""
    noise = torch.randn(shape, generator=generator, device=generator_device(generator, device), dtype=torch.float32)
    return noise.to(device)  # a no-op when the generator lives on ``device``
