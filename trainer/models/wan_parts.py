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
from trainer.models.inputs import VIDEO_SIZE, as_8bit, require_image_input


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
    """The first frame (``ImageInputs.image`` [B, 3, H, W] at the video's size), and optionally the last
    (``ImageInputs.last_image``), as ``WanImageToVideoPipeline`` conditions on them (Wan 2.1 I2V and FLF2V, 2.2 I2V
    A14B): the video [first, zeros..., last] VAE-encoded (posterior mean, where the pipeline takes the mode too) and
    normalised, after a mask of ``vae_scale_factor_temporal`` channels that is 1 on the given frames, concatenated
    to the latents at every forward; with an image encoder (2.1) the frames' CLIP hidden states (second to last
    layer) as ``encoder_hidden_states_image``: one frame's for I2V, both frames' for FLF2V (whose transformer has
    ``pos_embed_seq_len``). Wan 2.2 TI2V-5B pins its first frame instead (``conditioning.PINNED_FIRST_FRAME``)."""

    pinned = False
    fields = ("image", "last_image")
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
        ``Conditioning.embeds``): the frames' CLIP hidden states [B, N, D] (FLF2V: the first's and the last's tokens
        one after the other, [B, 2N, D]), with an image encoder."""
        size = (adapter.height, adapter.width)
        last = self.last_frame(adapter, batch_size, inputs)
        because = "it generates the video from that first frame"
        image = require_image_input(
            adapter.config.name, inputs, "image", batch_size, 3, size, because=because, sized_by=VIDEO_SIZE
        )
        frames = [image] if last is None else [image, last]
        pixels = torch.stack([f.to(adapter.device, torch.float32) * 2 - 1 for f in frames], dim=2)
        zeros = pixels.new_zeros(batch_size, 3, adapter.frames - len(frames), *size)
        pixels = torch.cat([pixels[:, :, :1], zeros, pixels[:, :, 1:]], dim=2)
        latents = adapter.image_latents(pixels.to(adapter.vae.dtype)).mode().float()
        mean, inv_std = adapter.latent_statistics(torch.float32)
        latents = (latents - mean) * inv_std
        temporal = adapter.pipeline.vae_scale_factor_temporal
        mask = latents.new_zeros(batch_size, temporal, *latents.shape[2:])
        mask[:, :, 0] = 1  # the first pixel frame fills the first latent frame's channels
        if last is not None:
            mask[:, -1, -1] = 1  # the last pixel frame: the last of those the last latent frame holds
        out = {"image": torch.cat([mask, latents], dim=1)}
        if getattr(adapter.pipeline, "image_encoder", None) is not None:
            out["image_embeds"] = clip_hidden_states(adapter.pipeline, image, last)
        return out

    def last_frame(self, adapter, batch_size: int, inputs: ImageInputs | None) -> torch.Tensor | None:
        """``inputs.last_image`` checked against the first frame and the model (None without one), or a ValueError
        naming the fix: a Wan 2.1 FLF2V transformer needs both frames' CLIP tokens and an I2V one takes one
        frame's."""
        name, last = adapter.config.name, None if inputs is None else inputs.last_image
        paired = clip_pairs(adapter)
        if last is None:
            if paired:
                raise ValueError(
                    f"model.path={adapter.config.path!r} holds a Wan 2.1 first-last-frame (FLF2V) transformer "
                    f"(pos_embed_seq_len={paired}): give ImageInputs.last_image too (data.image_inputs: "
                    "[image, last_image])"
                )
            return None
        if inputs.image is None:
            raise ValueError(
                "ImageInputs.last_image needs ImageInputs.image: a first-last-frame video starts from a first frame"
            )
        if last.shape != inputs.image.shape:
            raise ValueError(
                f"ImageInputs.last_image is {tuple(last.shape)} and ImageInputs.image {tuple(inputs.image.shape)}: "
                "give the last frame at the first frame's size (the video's), one per prompt"
            )
        if adapter.frames < 2:
            raise ValueError(f"model.frames={adapter.frames} has no last frame: set model.frames to 5 or more")
        if getattr(adapter.pipeline, "image_encoder", None) is not None and not paired:
            raise ValueError(
                f"model.path={adapter.config.path!r} holds a Wan 2.1 I2V transformer, which attends to one "
                "frame's CLIP tokens (no pos_embed_seq_len): point model.path at a Wan 2.1 FLF2V checkpoint for a "
                "first and last frame, or drop ImageInputs.last_image"
            )
        size = (adapter.height, adapter.width)
        return require_image_input(name, inputs, "last_image", batch_size, 3, size, sized_by=VIDEO_SIZE)

    def join(self, adapter, latents: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, dict]:
        """The transformer's input (float32) and extra forward arguments, as the pipeline builds them."""
        if cond.image is None:
            raise ValueError(f"{adapter.config.name} needs Conditioning.image: encode prompts with ImageInputs.image")
        extra = {}
        if "image_embeds" in cond.embeds:
            tokens = cond.embeds["image_embeds"].to(adapter.dtype)
            if clip_pairs(adapter):  # [B, 2N, D] -> [2B, N, D]: the embedder pairs consecutive rows back
                tokens = tokens.reshape(2 * tokens.shape[0], tokens.shape[1] // 2, tokens.shape[2])
            extra["encoder_hidden_states_image"] = tokens
        return torch.cat([latents, cond.image], dim=1), extra

    def velocity(self, adapter, v: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        """The network's velocity: the condition channels are input only."""
        return v


def clip_pairs(adapter) -> int | None:
    """The transformer's ``pos_embed_seq_len`` where it attends to two frames' CLIP tokens (Wan 2.1 FLF2V: its
    image embedder views [2B, N, D] as [B, 2N, D] and adds a position table of 2N), else None."""
    transformer = getattr(adapter.pipeline, "transformer", None)
    return getattr(transformer.config, "pos_embed_seq_len", None) if transformer is not None else None


def clip_hidden_states(pipeline, image: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
    """``WanImageToVideoPipeline.encode_image`` of ``image`` [B, 3, H, W] in [0, 1] given as the 8-bit pictures
    a user passes it: CLIP's second to last hidden states [B, N, D]; with ``last`` the pipeline's one forward over
    [first, last] per row, its tokens joined as [B, 2N, D]. One forward per distinct row, so that a row's tokens
    do not depend on its batch-mates (batched matmuls round differently)."""
    from PIL import Image

    from trainer.models.latents import vae_input_key

    rows_of = [as_8bit(image)] if last is None else [as_8bit(image), as_8bit(last)]
    seen: dict[str, torch.Tensor] = {}
    rows = []
    for row in zip(*rows_of, strict=True):
        key = "".join(vae_input_key(picture) for picture in row)
        if key not in seen:
            tokens = pipeline.encode_image([Image.fromarray(picture.numpy()) for picture in row], image.device)
            seen[key] = tokens.reshape(1, -1, tokens.shape[-1])
        rows.append(seen[key])
    return torch.cat(rows)


FIRST_FRAME = FirstFrame()
"""Wan 2.1 I2V and Wan 2.2 I2V A14B: the first frame as condition channels (and CLIP tokens where 2.1 has them)."""
