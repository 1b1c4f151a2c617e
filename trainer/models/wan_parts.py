"""Wan's pieces besides its adapter (trainer/models/wan.py): Wan 2.2's two experts as one denoiser, and the
image-to-video conditioning parts (registry data, ``ModelSpec.parts``): the first frame VAE-encoded with its
mask as extra input channels (Wan 2.1 I2V also attends to its CLIP embedding; Wan 2.2 TI2V-5B's pinned frame is the
shared ``conditioning.PINNED_FIRST_FRAME``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainer.models.base import Conditioning, ImageInputs
from trainer.models.conditioning import VIDEO_SIZE
from trainer.models.inputs import require_image_input


class WanExperts(nn.Module):
    """Wan 2.2's two experts as one denoiser: rows whose timestep >= ``boundary`` run ``transformer`` (high
    noise), the others ``transformer_2``, a batch with both split and joined back. Choosing reads the timesteps
    on the host, once per forward, as the pipeline's loop does. The experts not in ``trained`` stay frozen."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary: float, trained: tuple[str, ...]):
        super().__init__()
        self.transformer, self.transformer_2, self.boundary = transformer, transformer_2, boundary
        self.trained = trained

    def _trained(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.trained]

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kwargs) -> tuple[torch.Tensor]:
        """The experts' ``forward(..., return_dict=False)`` per row."""
        kwargs.pop("return_dict", None)
        high = self.high_noise(timestep)
        count = int(high.sum())
        if count in (0, len(high)):
            ran, idle = (self.transformer, self.transformer_2) if count else (self.transformer_2, self.transformer)
            out = ran(hidden_states=hidden_states, timestep=timestep, **kwargs, return_dict=False)
            zero = self._idle_zero(idle)
            return out if zero is None else (out[0] + zero, *out[1:])
        out = hidden_states.new_empty(
            hidden_states.shape[0], self.transformer.config.out_channels, *hidden_states.shape[2:]
        )
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            picked = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            out[rows] = expert(hidden_states=hidden_states[rows], timestep=timestep[rows], **picked, return_dict=False)[
                0
            ]
        return (out,)

    @staticmethod
    def _idle_zero(expert: nn.Module) -> torch.Tensor | None:
        """A zero tied to the trainable weights of an expert that ran no row of a forward that builds a graph (None
        when there is no graph or nothing of it trains): a loss whose rows all ran the other expert still
        backpropagates, and every trainable weight gets its (zero) gradient, as DDP and FSDP expect."""
        if not torch.is_grad_enabled():
            return None
        params = [p for p in expert.parameters() if p.requires_grad]
        return torch.stack([p.sum() for p in params]).sum() * 0.0 if params else None

    def high_noise(self, timestep: torch.Tensor) -> torch.Tensor:
        """[B] bool: the rows the high noise expert runs (per-token timesteps: by their largest)."""
        t = timestep if timestep.ndim == 1 else timestep.amax(1)
        return t >= self.boundary

    def requires_grad_(self, requires_grad: bool = True) -> WanExperts:
        super().requires_grad_(requires_grad)
        for name in ("transformer", "transformer_2"):
            if name not in self.trained:
                getattr(self, name).requires_grad_(False)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def peft_config(self) -> dict:
        return self._trained()[0].peft_config

    def add_adapter(self, config) -> None:
        for expert in self._trained():
            expert.add_adapter(config)

    def disable_adapters(self) -> None:
        for expert in self._trained():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self._trained():
            expert.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        self.transformer.enable_gradient_checkpointing()
        self.transformer_2.enable_gradient_checkpointing()

    def save_lora_adapter(self, directory: str) -> None:
        """Each trained expert's LoRA in diffusers' format, under ``directory``/``transformer`` (``_2``)."""
        for name in self.trained:
            getattr(self, name).save_lora_adapter(str(Path(directory) / name))

    def fuse_lora(self) -> None:
        for expert in self._trained():
            expert.fuse_lora()

    def unload_lora(self) -> None:
        for expert in self._trained():
            expert.unload_lora()

    def save_pretrained(self, directory: str) -> None:
        """Both experts, as ``transformer/`` and ``transformer_2/`` of ``directory``."""
        self.transformer.save_pretrained(str(Path(directory) / "transformer"))
        self.transformer_2.save_pretrained(str(Path(directory) / "transformer_2"))

    @classmethod
    def from_pretrained(cls, directory: str, torch_dtype: torch.dtype | None = None) -> WanExperts:
        """What ``save_pretrained`` wrote (its weights; routing is the loading adapter's)."""
        from diffusers import WanTransformer3DModel

        experts = [
            WanTransformer3DModel.from_pretrained(str(Path(directory) / name), torch_dtype=torch_dtype)
            for name in ("transformer", "transformer_2")
        ]
        return cls(*experts, boundary=0.0, trained=())


@dataclass(frozen=True)
class FirstFrame:
    """The first frame (``ImageInputs.image`` [B, 3, H, W] at the video's size) as ``WanImageToVideoPipeline``
    conditions on it (Wan 2.1 I2V, 2.2 I2V A14B): the video [frame, zeros...] VAE-encoded (posterior mean, where
    the pipeline takes the mode too) and normalised, after a mask of ``vae_scale_factor_temporal`` channels that is
    1 on the first latent frame, concatenated to the latents at every forward; with an image encoder (2.1) the
    frame's CLIP hidden states (second to last layer) as ``encoder_hidden_states_image``. Wan 2.2 TI2V-5B pins its
    frame instead (``conditioning.PINNED_FIRST_FRAME``)."""

    pinned = False
    fields = ("image",)
    reads_trajectory = False
    encodes_text = False

    def channels(self, z_dim: int, temporal: int) -> int:
        """Input channels it adds to the transformer's."""
        return temporal + z_dim

    def components(self, path: Path, dtype: torch.dtype, device: torch.device) -> dict:
        """The pipeline's ``image_encoder`` (CLIPVisionModel) and ``image_processor`` where the folder has them."""
        from transformers import CLIPImageProcessor, CLIPVisionModel

        if not (path / "image_encoder").is_dir():
            return {}
        encoder = CLIPVisionModel.from_pretrained(path, subfolder="image_encoder", torch_dtype=dtype).to(device)
        processor = CLIPImageProcessor.from_pretrained(path, subfolder="image_processor")
        return {"image_encoder": encoder.requires_grad_(False).eval(), "image_processor": processor}

    @torch.no_grad()
    def encode(self, adapter, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: the condition channels [B, 4 + C, F, h, w]; ``image_embeds`` (an entry of
        ``Conditioning.embeds``): its CLIP hidden states, with an image encoder."""
        size = (adapter.height, adapter.width)
        because = "it generates the video from that first frame"
        image = require_image_input(
            adapter.config.name, inputs, "image", batch_size, 3, size, because=because, sized_by=VIDEO_SIZE
        )
        pixels = (image.to(adapter.device, torch.float32) * 2 - 1)[:, :, None]
        pixels = torch.cat([pixels, pixels.new_zeros(batch_size, 3, adapter.frames - 1, *size)], dim=2)
        latents = adapter.image_latents(pixels.to(adapter.vae.dtype)).mode().float()
        mean, inv_std = adapter.latent_statistics(torch.float32)
        latents = (latents - mean) * inv_std
        temporal = adapter.pipeline.vae_scale_factor_temporal
        mask = latents.new_zeros(batch_size, temporal, *latents.shape[2:])
        mask[:, :, 0] = 1
        out = {"image": torch.cat([mask, latents], dim=1)}
        if getattr(adapter.pipeline, "image_encoder", None) is not None:
            out["image_embeds"] = clip_hidden_states(adapter.pipeline, image)
        return out

    def join(self, adapter, latents: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, dict]:
        """The transformer's input (float32) and extra forward arguments, as the pipeline builds them."""
        if cond.image is None:
            raise ValueError(f"{adapter.config.name} needs Conditioning.image: encode prompts with ImageInputs.image")
        extra = {}
        if "image_embeds" in cond.embeds:
            extra["encoder_hidden_states_image"] = cond.embeds["image_embeds"].to(adapter.dtype)
        return torch.cat([latents, cond.image], dim=1), extra

    def velocity(self, adapter, v: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        """The network's velocity: the condition channels are input only."""
        return v


def clip_hidden_states(pipeline, image: torch.Tensor) -> torch.Tensor:
    """``WanImageToVideoPipeline.encode_image`` of ``image`` [B, 3, H, W] in [0, 1] given as the 8-bit pictures
    a user passes it: CLIP's second to last hidden states [B, N, D]. One forward per distinct picture, so that a
    row's tokens do not depend on its batch-mates (batched matmuls round differently)."""
    from PIL import Image

    from trainer.models.latents import vae_input_key

    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
    seen: dict[str, torch.Tensor] = {}
    rows = []
    for picture in pixels:
        key = vae_input_key(picture)
        if key not in seen:
            seen[key] = pipeline.encode_image([Image.fromarray(picture.numpy())], image.device)
        rows.append(seen[key])
    return torch.cat(rows)


FIRST_FRAME = FirstFrame()
"""Wan 2.1 I2V and Wan 2.2 I2V A14B: the first frame as condition channels (and CLIP tokens where 2.1 has them)."""
