"""Chroma (ChromaTransformer2DModel, 8.9 B, derived from FLUX.1-schnell) from a local diffusers directory.

FLUX.1's latents, packing, position ids, shifted schedule and VAE (``FluxAdapter``), with Chroma's text path and
forward: T5 alone encodes a prompt, and its attention mask (padding masked but for its first token, as
``ChromaPipeline`` builds it) travels with the embeddings, in a precomputed store too. There is no guidance
embedding and no pooled projection: ``guidance_scale > 1`` runs true CFG against ``negative_prompt``, as one
forward over [negative; prompt], each half with its own mask (the pipeline runs two). No IP-Adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.models.base import Conditioning
from trainer.models.common import Imported
from trainer.models.flow import cfg_combine
from trainer.models.flux import FluxAdapter, FluxConfig
from trainer.models.ip_adapter import IPAdapterSettings

if TYPE_CHECKING:
    from diffusers import ChromaPipeline


@dataclass
class ChromaConfig(FluxConfig):
    """Where the Chroma weights are (transformer/, vae/, scheduler/, text_encoder/, tokenizer/) and how to run
    them; resolution must be a multiple of 2x the VAE factor (16 for the real VAE)."""

    name: str = "chroma"
    ip_adapter: IPAdapterSettings | None = None
    """Not supported for chroma: leave it unset."""

    def __post_init__(self):
        if self.ip_adapter is not None:
            raise ValueError(
                "model.ip_adapter is not supported for chroma (diffusers has no Chroma IP-Adapter to "
                "check it against): remove model.ip_adapter"
            )


class ChromaAdapter(FluxAdapter):
    """ModelAdapter for Chroma checkpoints (Chroma1-HD, Chroma1-Base): text-to-image with true CFG."""

    shard_units = Imported(
        (
            "diffusers.models.transformers.transformer_chroma:ChromaTransformerBlock",
            "diffusers.models.transformers.transformer_chroma:ChromaSingleTransformerBlock",
        )
    )
    config_class = ChromaConfig
    pipeline_class = Imported("diffusers:ChromaPipeline")
    transformer_class = Imported("diffusers:ChromaTransformer2DModel")
    label = "Chroma"
    model_name = "chroma"
    text_components = Imported(
        {"text_encoder": "transformers:T5EncoderModel", "tokenizer": "transformers:T5TokenizerFast"}
    )

    def __init__(self, config: ChromaConfig, device: torch.device | str = "cpu"):
        super().__init__(config, device)
        if config.gradient_checkpointing:
            checkpoint_single_blocks_with_mask(self.denoiser)

    @staticmethod
    def encode_text(
        pipeline: ChromaPipeline, config: ChromaConfig, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """T5 embeddings [1, L, D] of one prompt and their mask [1, L] via the pipeline's encode_prompt."""
        embeds, _, mask, _, _, _ = pipeline.encode_prompt(
            prompt=[prompt],
            device=device,
            do_classifier_free_guidance=False,
            max_sequence_length=config.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity for packed latents; with ``guidance_scale > 1`` CFG over [negative prompt; prompt] as one
        forward, the text masks extended over the image tokens by the pipeline's ``_prepare_attention_mask``."""
        embeds, mask = cond.embeds["prompt_embeds"], cond.embeds["prompt_mask"]
        n = latents.shape[0]
        # (sigma * 1000) / 1000 in the model dtype, exactly as the pipeline rounds its timestep.
        timestep = (sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        hidden = latents.to(self.dtype)
        cfg = self._runs_cfg(guidance_scale)
        if cfg:
            neg = self.prompts([self.config.negative_prompt])[0]
            embeds = torch.cat([neg["prompt_embeds"].expand(n, -1, -1), embeds])
            mask = torch.cat([neg["prompt_mask"].expand(n, -1), mask])
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        attention_mask = self.pipeline._prepare_attention_mask(len(hidden), hidden.shape[1], self.dtype, mask)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        out = net(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=self.img_ids,
            attention_mask=attention_mask,
            return_dict=False,
        )[0]
        if cfg:
            return cfg_combine(*out.chunk(2), guidance_scale)
        return out.float()


def checkpoint_single_blocks_with_mask(denoiser: nn.Module) -> None:
    """Gradient checkpointing that hands the single-stream blocks the attention mask, which diffusers' checkpointed
    path leaves out (its plain path passes it): without it a training forward would not compute the rollout's.
    The mask of the running forward is recorded by a pre-hook and bound to each checkpointed call."""
    from diffusers.models.transformers.transformer_chroma import ChromaSingleTransformerBlock

    running: dict[str, torch.Tensor | None] = {"mask": None}

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        running["mask"] = kwargs.get("attention_mask")

    def checkpoint(block: nn.Module, *args):
        extra = {"attention_mask": running["mask"]} if isinstance(block, ChromaSingleTransformerBlock) else {}
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False, **extra)

    denoiser.register_forward_pre_hook(record, with_kwargs=True)
    denoiser.enable_gradient_checkpointing(checkpoint)
