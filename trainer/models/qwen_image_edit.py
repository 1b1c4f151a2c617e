"""Qwen-Image-Edit (``QwenImageEditPipeline``): Qwen-Image that also reads the image to edit, twice.

The text encoder, Qwen2.5-VL, sees the reference image inside the prompt template (so the embeddings of an
instruction depend on its image and are encoded per (prompt, image) pair, the negative prompt's per image),
and the transformer attends to the reference's VAE latents (posterior mean, as the pipeline takes it),
packed and appended to the latent tokens with their own grid in ``img_shapes``; their output is dropped.
The pipeline resizes the reference to about 1024^2 pixels; here it comes at ``model.resolution`` (square,
``data.image_size``), which is the same at the real resolution, and at 8 bits, as the pipeline takes images.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.models.base import Conditioning, ImageInputs
from trainer.models.common import Imported
from trainer.models.inputs import reject_image_inputs, require_references
from trainer.models.latents import vae_input_key
from trainer.models.qwen_image import QwenImageAdapter, QwenImageConfig, pad_text

if TYPE_CHECKING:
    from diffusers import QwenImageEditPipeline

TEXT_CACHE = 256
"""(prompt, image) pairs whose embeddings are kept between calls (the least recently used are dropped):
an evaluation's fixed items are encoded once, and the cache stays bounded whatever the dataset's size."""


@functools.cache
def image_processor_class() -> type:
    """Qwen2-VL's processor for text and images alone: its constructor without the video processor, which
    editing never calls and which transformers defines only where torchvision is installed."""
    from transformers import Qwen2VLProcessor

    class ImageProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageProcessor


@dataclass
class QwenImageEditConfig(QwenImageConfig):
    """Where the Qwen-Image-Edit weights are (Qwen-Image's folders plus processor/) and how to run them."""

    name: str = "qwen_image_edit"
    """Registry name of the adapter."""

    def __post_init__(self):
        if self.text_embeddings:
            raise ValueError(
                "model.text_embeddings is set, but qwen_image_edit's prompt embeddings depend on the "
                "image to edit (its text encoder reads it): unset it"
            )
        if self.ip_adapter is not None:
            raise ValueError("model.ip_adapter is set, but the qwen_image_edit adapter takes no IP-Adapter: unset it")


class QwenImageEditAdapter(QwenImageAdapter):
    """ModelAdapter for Qwen-Image-Edit: needs ``ImageInputs.reference`` (the image to edit) per prompt."""

    config_class = QwenImageEditConfig
    pipeline_class = Imported("diffusers:QwenImageEditPipeline")
    model_name = "qwen_image_edit"
    encodes_image_inputs = True
    max_references = 1
    """Reference images per item its pipeline takes."""
    text_components = Imported(
        {
            "text_encoder": "transformers:Qwen2_5_VLForConditionalGeneration",
            "tokenizer": "transformers:Qwen2Tokenizer",
            "processor": image_processor_class,
        }
    )

    def __init__(self, config: QwenImageEditConfig, device: torch.device | str = "cpu"):
        super().__init__(config, device)
        self._text_cache: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()

    @staticmethod
    def prompt_encoder(model, config, device):
        """Refused: there are no prompt embeddings to precompute without the images (``--latents`` works)."""
        raise ValueError(
            "qwen_image_edit's prompt embeddings depend on the image to edit: there is nothing to "
            "precompute with --out; precompute the references' VAE latents with --latents"
        )

    @staticmethod
    def encode_text(
        pipeline: QwenImageEditPipeline, config: QwenImageEditConfig, device: torch.device, prompt: str, image=None
    ) -> dict[str, torch.Tensor]:
        """Unpadded [L, D] embeddings of one prompt read with its image (a PIL image, or a list) via encode_prompt."""
        embeds, _ = pipeline.encode_prompt(
            [prompt], image=image, device=device, max_sequence_length=config.max_sequence_length
        )
        return {"prompt_embeds": embeds[0]}

    def _encoded(self, prompt: str, key: str, image) -> torch.Tensor:
        """[L, D] embeddings of ``prompt`` read with the image whose 8-bit pixels hash to ``key``, cached."""
        cache = self._text_cache
        if (prompt, key) in cache:
            cache.move_to_end((prompt, key))
        else:
            cache[prompt, key] = self.encode_text(self.pipeline, self.config, self.device, prompt, image)[
                "prompt_embeds"
            ]
            if len(cache) > TEXT_CACHE:
                cache.popitem(last=False)
        return cache[prompt, key]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Instruction embeddings read with each item's references (each distinct pair encoded once, in its own
        forward), right-padded to the longest with ``prompt_mask``; the negative prompt's, read with the same
        images (``negative_embeds``: one length for every image of the model's resolution, so unpadded); the
        references' packed latents, one after the other along the tokens."""
        reject_image_inputs(self.model_name, inputs, allowed=("reference",))
        references = self._references(inputs, len(prompts))
        pixels = (references.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)  # [B, N, 3, H, W]
        keys = ["|".join(vae_input_key(p) for p in row) for row in pixels]
        images = {key: self._text_images(row) for key, row in zip(keys, pixels, strict=True)}
        text = [self._encoded(prompt, key, images[key]) for prompt, key in zip(prompts, keys, strict=True)]
        negative = [self._encoded(self.config.negative_prompt, key, images[key]) for key in keys]
        assert len({len(n) for n in negative}) == 1, "images of one size give negative prompts of one length"
        length = max(len(t) for t in text)
        embeds, mask = pad_text(text, length)
        x = (pixels.flatten(0, 1).to(self.device, torch.float32) / 255 * 2 - 1).to(self.dtype)[:, :, None]
        latents = (self.image_latents(x).mode().float() - self.latents_mean) / self.latents_std
        b, c, _, h, w = latents.shape
        packed = self.pipeline._pack_latents(latents, b, c, h, w)
        return Conditioning(
            embeds={"prompt_embeds": embeds, "prompt_mask": mask, "negative_embeds": torch.stack(negative)},
            reference=packed.reshape(len(prompts), -1, packed.shape[-1]),
            ragged=("prompt_embeds", "prompt_mask"),
            text_mask="prompt_mask",
            padded=any(len(t) < length for t in text),
        )

    def _references(self, inputs: ImageInputs | None, batch_size: int) -> torch.Tensor:
        """``ImageInputs.reference`` checked, as [B, N, 3, H, W] (1 to ``max_references`` per item)."""
        return require_references(
            self.model_name,
            inputs,
            batch_size,
            (self.resolution, self.resolution),
            self.max_references,
            self.pipeline_class.__name__,
        )

    def _text_images(self, pixels):
        """What the text encoder reads of one item's references (uint8 [N, 3, H, W]): the one PIL image."""
        from PIL import Image

        return Image.fromarray(pixels[0].permute(1, 2, 0).numpy())

    def missing_prompts(self, prompts, guidance_scales) -> list[str]:
        """None: the text encoders always encode (``model.text_embeddings`` is refused)."""
        return []

    def _negative_text(self, cond: Conditioning, length: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Each item's negative prompt read with its image (no padding: all ones mask)."""
        negative = cond.embeds["negative_embeds"]
        return negative, torch.ones(negative.shape[:2], dtype=torch.long, device=negative.device), False

    def _model_input(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        if cond.reference is None:
            raise ValueError("qwen_image_edit needs Conditioning.reference: encode prompts with ImageInputs.reference")
        grid = (1, self.tokens_side, self.tokens_side)
        references = cond.reference.shape[1] // x.shape[1]
        return torch.cat([x, cond.reference.to(x.dtype)], dim=1), [grid] * (1 + references)
