"""Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``): Qwen-Image-Edit with several reference images
per item ("Picture 1", "Picture 2", ... in the prompt template; the first is the one edited).

As ``qwen_image_edit``, with the Plus pipeline's two sizes: the text encoder reads each reference resized to
``condition_size`` square (the pipeline's 384^2-pixel area), and the transformer attends to every reference's
VAE latents, appended one after the other with their own grids. The pipeline takes one prompt per call; the
adapter batches, each item with its own references (``ImageInputs.reference`` [B, N, 3, H, W], or [B, 3, H, W]
for one; ``edit_jsonl`` rows with a list of ``image_path``). References come at ``model.resolution``, where
the pipeline resizes them to about 1024^2 pixels: the same at the real resolution.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.fields import PositiveInt
from trainer.models.common import Imported
from trainer.models.qwen_image_edit import QwenImageEditAdapter, QwenImageEditConfig


@dataclass
class QwenImageEditPlusConfig(QwenImageEditConfig):
    """Where the Qwen-Image-Edit-2509 (or 2511) weights are and how to run them."""

    name: str = "qwen_image_edit_plus"
    """Registry name of the adapter."""
    condition_size: PositiveInt = 384
    """Side in pixels of the square image the text encoder reads each reference at (the pipeline's
    CONDITION_IMAGE_SIZE area of 384^2; a multiple of 32, as the pipeline rounds it)."""

    def __post_init__(self):
        super().__post_init__()
        if self.condition_size % 32:
            raise ValueError(
                f"model.condition_size={self.condition_size} must be a multiple of 32 (the pipeline "
                "rounds its condition images' sides to 32): 384 is the pipeline's"
            )


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """ModelAdapter for Qwen-Image-Edit-Plus: needs ``ImageInputs.reference``, one to ``max_references`` images
    per prompt."""

    config_class = QwenImageEditPlusConfig
    pipeline_class = Imported("diffusers:QwenImageEditPlusPipeline")
    model_name = "qwen_image_edit_plus"
    max_references = 4
    """Qwen-Image-Edit-2509 is trained with 1 to 3 references; one more is allowed."""

    def _text_images(self, pixels):
        """Every reference of one item (uint8 [N, 3, H, W]) resized to ``condition_size`` as the pipeline
        resizes its condition images."""
        from PIL import Image

        side = self.config.condition_size
        return [
            self.pipeline.image_processor.resize(Image.fromarray(p.permute(1, 2, 0).numpy()), side, side)
            for p in pixels
        ]
