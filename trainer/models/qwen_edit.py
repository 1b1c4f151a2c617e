"""Qwen-Image-Edit's conditioning: the image to edit is read twice, by the text encoder inside the prompt template
and by the transformer as reference tokens. ``Edit`` is the part that Qwen-Image-Edit, -Edit-Plus (several
references) and -Edit inpainting combine with the Qwen-Image adapter (registry data, ``MODELS``).

Qwen2.5-VL sees the references inside the prompt template, so the embeddings of an instruction depend on its images
and are encoded per (prompt, images) pair, the negative prompt's per item; the transformer attends to the
references' VAE latents (posterior mean, as the pipelines take it), packed and appended to the latent tokens with
their own grids in ``img_shapes``; their output is dropped. The pipelines resize references to about 1024^2 pixels;
here they come at ``model.resolution`` (square, ``data.image_size``), which is the same at the real resolution, and
at 8 bits, as the pipelines take images. Edit-Plus reads each reference at ``condition_size`` for the text encoder
(the pipeline's 384^2-pixel area); Edit inpainting edits ``ImageInputs.image`` inside ``.mask`` only (with
``conditioning.INPAINT``, its source's latents those reference tokens).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.models.base import Conditioning, ImageInputs, ragged_prompts
from trainer.models.common import Imported
from trainer.models.inputs import reject_image_inputs, require_image_input, require_references
from trainer.models.latents import vae_input_key

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


class EditText:
    """Qwen-Image-Edit's text path: Qwen2.5-VL with its processor, reading each prompt with its images."""

    text_components = Imported(
        {
            "text_encoder": "transformers:Qwen2_5_VLForConditionalGeneration",
            "tokenizer": "transformers:Qwen2Tokenizer",
            "processor": image_processor_class,
        }
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length")

    @staticmethod
    def prompt_encoder(model, config, device):
        """Refused: there are no prompt embeddings to precompute without the images (``--latents`` works)."""
        raise ValueError(
            "qwen_image_edit's prompt embeddings depend on the image to edit: there is nothing to "
            "precompute with --out; precompute the references' VAE latents with --latents"
        )

    @staticmethod
    def encode_text(
        pipeline: QwenImageEditPipeline, config, device: torch.device, prompt: str, image=None
    ) -> dict[str, torch.Tensor]:
        """Unpadded [L, D] embeddings of one prompt read with its image (a PIL image, or a list) via encode_prompt."""
        embeds, _ = pipeline.encode_prompt(
            [prompt], image=image, device=device, max_sequence_length=config.max_sequence_length
        )
        return {"prompt_embeds": embeds[0]}


@dataclass(frozen=True)
class Edit:
    """The images to edit, read by the text encoder and attended to by the transformer: 1 to ``most`` references
    per item; ``resize``: the text encoder reads each at ``model.condition_size`` (Edit-Plus), else the one image
    as given; ``source``: the ImageInputs field they come from ("image" for Edit inpainting, with its mask)."""

    most: int = 1
    resize: bool = False
    source: str = "reference"
    encodes_text = True
    reads_trajectory = False

    @property
    def fields(self) -> tuple[str, ...]:
        return ("image", "mask") if self.source == "image" else ("reference",)

    @torch.no_grad()
    def encode_prompts(self, adapter, prompts: list[str], inputs: ImageInputs | None) -> Conditioning:
        """Instruction embeddings read with each item's references (each distinct pair encoded once, in its own
        forward), right-padded to the longest with ``prompt_mask``; the negative prompt's, read with the same
        images (``negative_embeds``: one length for every image of the model's resolution, so unpadded); the
        references' packed latents, one after the other along the tokens."""
        name, size = adapter.config.name, (adapter.resolution, adapter.resolution)
        reject_image_inputs(name, inputs, allowed=self.fields)
        mask = None
        if self.source == "image":
            image = require_image_input(name, inputs, "image", len(prompts), 3, size)
            mask = require_image_input(name, inputs, "mask", len(prompts), 1, size)
            inputs = ImageInputs(reference=image)
        pipeline = adapter.pipeline_class.__name__
        references = require_references(name, inputs, len(prompts), size, self.most, pipeline)
        pixels = (references.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)  # [B, N, 3, H, W]
        keys = ["|".join(vae_input_key(p) for p in row) for row in pixels]
        images = {key: self.text_images(adapter, row) for key, row in zip(keys, pixels, strict=True)}
        text = [self.encoded(adapter, prompt, key, images[key]) for prompt, key in zip(prompts, keys, strict=True)]
        negative = [self.encoded(adapter, adapter.config.negative_prompt, key, images[key]) for key in keys]
        assert len({len(n) for n in negative}) == 1, "images of one size give negative prompts of one length"
        x = (pixels.flatten(0, 1).to(adapter.device, torch.float32) / 255 * 2 - 1).to(adapter.dtype)[:, :, None]
        latents = (adapter.image_latents(x).mode().float() - adapter.latents_mean) / adapter.latents_std
        b, c, _, h, w = latents.shape
        packed = adapter.pipeline._pack_latents(latents, b, c, h, w)
        cond = ragged_prompts(text, reference=packed.reshape(len(prompts), -1, packed.shape[-1]))
        cond.embeds["negative_embeds"] = torch.stack(negative)
        if mask is None:
            return cond
        return dataclasses.replace(cond, image=cond.reference, mask=adapter.inpaint_mask(mask))

    def check(self, adapter, cond: Conditioning) -> None:
        """Nothing to check before the forward: the adapter's model input asks for the reference tokens."""

    def velocity(self, adapter, v: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        return v

    def encoded(self, adapter, prompt: str, key: str, image) -> torch.Tensor:
        """[L, D] embeddings of ``prompt`` read with the image whose 8-bit pixels hash to ``key``, cached on the
        adapter (``text_cache``, the least recently used dropped past ``TEXT_CACHE``)."""
        cache = adapter.text_cache
        if (prompt, key) in cache:
            cache.move_to_end((prompt, key))
        else:
            embeds = EditText.encode_text(adapter.pipeline, adapter.config, adapter.device, prompt, image)
            cache[prompt, key] = embeds["prompt_embeds"]
            if len(cache) > TEXT_CACHE:
                cache.popitem(last=False)
        return cache[prompt, key]

    def text_images(self, adapter, pixels):
        """What the text encoder reads of one item's references (uint8 [N, 3, H, W]): the one PIL image, or with
        ``resize`` every reference resized to ``condition_size`` as the Plus pipeline resizes its condition images."""
        from PIL import Image

        if not self.resize:
            return Image.fromarray(pixels[0].permute(1, 2, 0).numpy())
        side = adapter.config.condition_size
        return [
            adapter.pipeline.image_processor.resize(Image.fromarray(p.permute(1, 2, 0).numpy()), side, side)
            for p in pixels
        ]


EDIT = Edit()
EDIT_PLUS = Edit(most=4, resize=True)
"""Qwen-Image-Edit-2509 is trained with 1 to 3 references; one more is allowed."""
EDIT_SOURCE = Edit(source="image")
"""Edit inpainting's image to edit: ``ImageInputs.image``, repainted inside ``ImageInputs.mask``."""
