"""Supervised fine-tuning with the denoising regression loss (the warm-up phase before RL).

    x_sigma = adapter.training_target(x0, eps, sigma)   (flow: (1 - sigma) x0 + sigma eps, target eps - x0)
    L = mean || model(x_sigma, sigma, c) - target ||^2,  sigma ~ logit-normal(m, s)
A fraction ``cfg_dropout`` of prompts is replaced by the empty prompt so the model also learns the
unconditional branch that CFG needs. Departures from diffusers' SD3 fine-tuning (train_dreambooth_sd3.py): no
output preconditioning (theirs, by default, weights each sample's loss by sigma^2), and noise levels unshifted
and continuous (theirs: the shift-3 scheduler's 1000-level grid; ``sigma_shift`` 3 gives its density).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.base import LossContext, set_shares
from trainer.algorithms.clean_sample import CleanUnit, NoiseDraws, logit_normal_sigmas
from trainer.algorithms.core_algos import denoising_loss
from trainer.config.fields import FiniteFloat, NonNegativeFloat, PositiveFloat, PositiveInt, Probability
from trainer.models.base import Conditioning, ImageInputs, ModelAdapter


@dataclass
class SFTConfig:
    """Supervised warm-up settings."""

    batch_size: PositiveInt = 64
    """Dataset samples per optimizer step (per rank)."""
    micro_batch_size: PositiveInt = 64
    """Samples per forward/backward; gradients accumulate up to ``batch_size``."""
    cfg_dropout: Probability = 0.1
    """Probability of training a sample with the empty prompt (the unconditional branch for CFG)."""
    logit_mean: FiniteFloat = 0.0
    """Mean of the logit-normal density of training noise levels (SD3's default)."""
    logit_std: NonNegativeFloat = 1.0
    """Std of the logit-normal density of training noise levels."""
    sigma_shift: PositiveFloat = 1.0
    """Shift of the drawn levels, sigma = shift u / (1 + (shift - 1) u): 3 trains at the levels diffusers' SD3
    fine-tuning and Flow-GRPO's SFT read off SD3's scheduler (1: the logit-normal draw itself)."""


@dataclass
class SFTBatch:
    x0: torch.Tensor  # [B, *latent_shape] targets in latent space
    noise: torch.Tensor  # [B, *latent_shape]
    sigma: torch.Tensor  # [B]
    cond: Conditioning


def supervised_latents(adapter: ModelAdapter, images: torch.Tensor) -> torch.Tensor:
    """Target images in [0, 1] encoded to the model's latents, or a ValueError naming data.image_size when they
    do not encode to the shape the model generates (build.py checks this before the warm-up)."""
    x0 = adapter.encode_images(images)
    if tuple(x0.shape[1:]) != tuple(adapter.latent_shape):
        raise ValueError(
            f"supervised images of {tuple(images.shape[-2:])} pixels encode to latents "
            f"{tuple(x0.shape[1:])}, but the model generates {tuple(adapter.latent_shape)} (model."
            "resolution): set data.image_size to the model's resolution"
        )
    return x0


class SFT:
    """Denoising regression on dataset images."""

    config_class = SFTConfig

    def __init__(self, config: SFTConfig):
        self.config = config

    def data_batch(
        self,
        adapter: ModelAdapter,
        images: torch.Tensor,
        prompts: list[str],
        generator: torch.Generator,
        inputs: ImageInputs | None = None,
    ) -> SFTBatch:
        """Target images in [0, 1] [B, C, H, W], their prompts and image inputs -> one supervised batch."""
        drop = torch.rand(len(prompts), generator=generator) < self.config.cfg_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
        x0 = supervised_latents(adapter, images)
        noise = torch.randn(x0.shape, generator=generator).to(x0.device)
        sigma = logit_normal_sigmas(
            len(prompts), self.config.logit_mean, self.config.logit_std, generator, self.config.sigma_shift
        )
        return SFTBatch(x0, noise, sigma.to(x0.device), adapter.encode_prompts(prompts, inputs))

    def plan(self, batch: SFTBatch, generator: torch.Generator) -> list[list[CleanUnit]]:
        """One optimizer step over the batch, accumulated over micro-batches (each unit's loss scaled by its
        share of the batch, so that a smaller last micro-batch counts per sample like the others)."""
        units = [
            CleanUnit(batch, idx, NoiseDraws(batch.sigma[idx], batch.noise[idx]))
            for idx in torch.arange(len(batch.sigma)).split(self.config.micro_batch_size)
        ]
        return set_shares([units], lambda unit: len(unit.rows))

    def loss(self, ctx: LossContext, unit: CleanUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, idx = unit.batch, unit.rows
        x_t, target = ctx.adapter.training_target(batch.x0[idx], unit.draw.noise, unit.draw.sigma)
        pred = ctx.adapter.predict(ctx.policy, x_t, unit.draw.sigma, batch.cond.select(idx), 1.0)
        loss = denoising_loss(pred, target)
        return loss * unit.share, {"sft_loss": loss.detach()}
