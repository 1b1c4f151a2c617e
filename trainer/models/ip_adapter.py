"""IP-Adapter (image prompt) conditioning for FLUX and Qwen-Image: a style image steers generation through
decoupled cross-attention, trainable by itself (base frozen: "IP-Adapter GRPO") or together with LoRA.

    e     = E(style)                              frozen image encoder, one image per forward  [B, D]
    c     = LayerNorm(reshape(W_p e + b_p))       image projection to N tokens of width C      [B, N, C]
    h_img += scale * softmax(q k^T / sqrt(d)) v,   k = W_k c + b_k,  v = W_v c + b_v
in every double-stream block, with q the image tokens' query after QK-norm and before RoPE (the image-prompt
tokens have no position). E is CLIPVisionModelWithProjection (``image_embeds``, as XLabs' FLUX IP-Adapter) or
SigLIP's SiglipVisionModel (pooled output). C is the transformer's ``joint_attention_dim`` (the text encoder
width: 4096 for FLUX, 3584 for Qwen-Image), so the image tokens live where the text features live.

FLUX uses diffusers' own classes (``ImageProjection`` in ``MultiIPAdapterImageProjection`` as the
transformer's ``encoder_hid_proj``, ``FluxIPAdapterAttnProcessor`` in each double-stream block, fed through
``joint_attention_kwargs["ip_adapter_image_embeds"]``), so outputs equal ``FluxPipeline`` with
``load_ip_adapter``; diffusers adds the result to the image stream after the block's feed-forward, as XLabs
does. Qwen-Image has no IP-Adapter in diffusers: ``QwenImageIPAdapterAttnProcessor`` adds the result to the
image stream's attention output (before the block's gate), and a forward pre-hook on the transformer projects
``attention_kwargs["ip_adapter_image_embeds"]`` with ``encoder_hid_proj`` inside its forward (so a parallel
wrapper of the transformer sees every IP-Adapter weight used in its forward).

Weight format: one safetensors file in the layout ``FluxPipeline.load_ip_adapter`` reads, for both models
(XLabs' original FLUX IP-Adapter file, whose keys name the same tensors differently, is read too):
    image_proj.proj.weight [N*C, D]   image_proj.proj.bias [N*C]   image_proj.norm.weight [C]   .norm.bias [C]
    ip_adapter.{k}.to_k_ip.weight [H*d, C]  .to_k_ip.bias [H*d]  .to_v_ip.weight [H*d, C]  .to_v_ip.bias [H*d]
for double-stream block k = 0, 1, ... (H heads of width d). Resampler-based checkpoints (InstantX) are not
this format. Fresh weights: PyTorch's default init except ``to_v_ip`` = 0, so a new IP-Adapter leaves the
model's output exactly unchanged (gradients reach the other IP weights once v is non-zero, after one step).

CFG: the unconditional branch gets zero image embeddings, as diffusers' SD IP-Adapters do (``FluxPipeline``
would encode a black image unless ``negative_ip_adapter_image_embeds`` is given).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.config.fields import LocalPath, NonNegativeFloat, OptionalLocalPath, PositiveInt
from trainer.models.base import ImageInputs
from trainer.models.inputs import require_image_input

if TYPE_CHECKING:
    from diffusers.models.embeddings import ImageProjection

IP_WEIGHTS = "ip_adapter.safetensors"
FLUX_LOADER_ROWS_16 = 65536
"""diffusers' FLUX IP-Adapter loader (``FluxTransformer2DLoadersMixin``, behind ``FluxPipeline.load_ip_adapter``)
takes no token count: it reads 16 image tokens from an ``image_proj.proj.weight`` of this many rows (16 x FLUX.1's
4096-wide text features), and 4 from any other."""
IMAGE_ENCODERS = {"CLIPVisionModelWithProjection": "image_embeds", "SiglipVisionModel": "pooler_output"}
"""Supported image encoder classes -> the output field used as the image embedding."""


@dataclass
class IPAdapterSettings:
    """The IP-Adapter of a FLUX-family or Qwen-Image model (``model.ip_adapter``)."""

    image_encoder: LocalPath = ""
    """Local directory of the image encoder saved with ``save_pretrained``: CLIPVisionModelWithProjection
    (e.g. clip-vit-large-patch14 for XLabs' FLUX IP-Adapter) or SiglipVisionModel, with the
    ``preprocessor_config.json`` whose mean and std normalise the pixels."""
    weights: OptionalLocalPath = None
    """IP-Adapter weights: a safetensors file in the format above, or a directory holding ``ip_adapter.safetensors``
    (what ``adapter.trainable.save`` writes). None: fresh weights that leave the model's output unchanged."""
    num_tokens: PositiveInt = 4
    """Image-prompt tokens N per image (4 in XLabs' FLUX IP-Adapter); must match the loaded weights. FLUX: 4, or
    16 on FLUX.1's 4096-wide text features, the counts diffusers' ``FluxPipeline.load_ip_adapter`` reads."""
    scale: NonNegativeFloat = 1.0
    """Weight of the image-prompt attention; 0 turns the IP-Adapter off (output equals the base model)."""
    trainable: bool = True
    """Train the IP-Adapter weights. The base denoiser is then frozen unless ``model.lora`` adds LoRA (trained
    together). False: the IP-Adapter is frozen and the denoiser trains as ``model.lora`` says."""

    def __post_init__(self):
        if not self.image_encoder:
            raise ValueError(
                "model.ip_adapter.image_encoder is empty: set it to the local directory of a "
                "CLIPVisionModelWithProjection or SiglipVisionModel"
            )


def refuse_unloadable_flux_tokens(num_tokens: int, width: int | None = None) -> None:
    """ValueError for a FLUX IP-Adapter of ``num_tokens`` image tokens that diffusers' loader would read as another
    count, failing with a shape error on the exported file: any count but 4 and 16, and, once the transformer's
    ``joint_attention_dim`` ``width`` is known, a count whose projection rows it reads otherwise."""
    if num_tokens not in (4, 16):
        raise ValueError(
            f"model.ip_adapter.num_tokens={num_tokens}: diffusers' FluxPipeline.load_ip_adapter, which "
            "reads the exported IP-Adapter, knows 4 image tokens, and 16 on FLUX.1's 4096-wide text "
            "features; set 4 (XLabs' FLUX IP-Adapter) or 16"
        )
    if width is None:
        return
    loadable = [n for n in (4, 16) if (n * width == FLUX_LOADER_ROWS_16) == (n == 16)]
    if num_tokens not in loadable:
        read = 16 if num_tokens * width == FLUX_LOADER_ROWS_16 else 4
        raise ValueError(
            f"model.ip_adapter.num_tokens={num_tokens} on this transformer (joint_attention_dim={width}): "
            f"diffusers' FluxPipeline.load_ip_adapter would read its {num_tokens * width} projection rows "
            f"as {read} image tokens; it reads {' or '.join(map(str, loadable)) or 'no count'} correctly "
            "here" + (f": set model.ip_adapter.num_tokens={loadable[0]}" if loadable else "")
        )


class ImageEncoder:
    """A frozen image encoder and its preprocessing: resize (bicubic, antialiased) so the short side is the
    encoder's ``image_size``, centre-crop a square, normalise with the processor config's mean and std (CLIP's
    and SigLIP's processors do the same on square inputs)."""

    def __init__(self, directory: str, dtype: torch.dtype, device: torch.device):
        import transformers

        path = Path(directory)
        if not (path / "config.json").is_file() or not (path / "preprocessor_config.json").is_file():
            raise ValueError(
                f"model.ip_adapter.image_encoder={directory!r} needs config.json and "
                "preprocessor_config.json (an image encoder and its processor saved with save_pretrained)"
            )
        architecture = (json.loads((path / "config.json").read_text()).get("architectures") or ["?"])[0]
        if architecture not in IMAGE_ENCODERS:
            raise ValueError(
                f"model.ip_adapter.image_encoder={directory!r} is a {architecture}; supported: "
                f"{', '.join(IMAGE_ENCODERS)}"
            )
        self.model = getattr(transformers, architecture).from_pretrained(path, torch_dtype=dtype).to(device)
        self.model.requires_grad_(False).eval()
        self.output = IMAGE_ENCODERS[architecture]
        config = self.model.config
        self.embed_dim = config.projection_dim if self.output == "image_embeds" else config.hidden_size
        self.size = config.image_size
        processor = json.loads((path / "preprocessor_config.json").read_text())
        self.mean = torch.tensor(processor["image_mean"], device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(processor["image_std"], device=device).view(1, 3, 1, 1)
        self.dtype, self.device = dtype, device

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] -> normalised [B, 3, S, S] encoder inputs."""
        x = images.to(self.device, torch.float32)
        h, w = x.shape[-2:]
        scale = self.size / min(h, w)
        x = nn.functional.interpolate(
            x,
            size=(max(self.size, round(h * scale)), max(self.size, round(w * scale))),
            mode="bicubic",
            antialias=True,
            align_corners=False,
        )
        top, left = (x.shape[-2] - self.size) // 2, (x.shape[-1] - self.size) // 2
        x = x[..., top : top + self.size, left : left + self.size].clamp(0, 1)
        return (x - self.mean) / self.std

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Image embeddings [B, D], one image per forward: an embedding must not depend on its batch."""
        pixels = self.pixels(images).to(self.dtype)
        return torch.cat([getattr(self.model(pixel_values=p[None]), self.output) for p in pixels])


class QwenImageIPAdapterAttnProcessor(nn.Module):
    """Qwen-Image's joint attention plus image-prompt attention on the image stream.

    The text/image joint attention is diffusers' ``QwenDoubleStreamAttnProcessor2_0`` unchanged; the image
    queries are projected once more (``to_q``, QK-norm; no RoPE) to attend over the IP tokens' keys and values,
    and ``scale`` times that is added to the image output: one extra query projection of the image tokens per
    block buys an exact base path. Same attributes as ``FluxIPAdapterAttnProcessor`` (one K/V pair per
    IP-Adapter in ``to_k_ip``/``to_v_ip``, ``scale`` a list), so both share one weight format.
    """

    def __init__(
        self,
        hidden_size: int,
        cross_attention_dim: int,
        num_tokens: tuple[int, ...] = (4,),
        scale: float = 1.0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

        super().__init__()
        self.attend = dispatch_attention_fn
        self.hidden_size, self.cross_attention_dim = hidden_size, cross_attention_dim
        self.scale = [scale] * len(num_tokens)
        self.to_k_ip = nn.ModuleList(
            [nn.Linear(cross_attention_dim, hidden_size, device=device, dtype=dtype) for _ in num_tokens]
        )
        self.to_v_ip = nn.ModuleList(
            [nn.Linear(cross_attention_dim, hidden_size, device=device, dtype=dtype) for _ in num_tokens]
        )
        self.joint = QwenDoubleStreamAttnProcessor2_0()

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        ip_hidden_states: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        img_out, txt_out = self.joint(
            attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask, image_rotary_emb
        )
        if ip_hidden_states is None:
            return img_out, txt_out
        head_dim = attn.inner_dim // attn.heads
        query = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        for tokens, scale, to_k, to_v in zip(ip_hidden_states, self.scale, self.to_k_ip, self.to_v_ip, strict=True):
            key = to_k(tokens).flatten(1, -2).unflatten(-1, (-1, head_dim))  # [B, images * N, heads, d]
            value = to_v(tokens).flatten(1, -2).unflatten(-1, (-1, head_dim))
            out = self.attend(query, key, value)
            img_out = img_out + scale * out.flatten(2, 3).to(img_out.dtype)
        return img_out, txt_out


def _project_image_embeds(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the Qwen-Image transformer: ``attention_kwargs["ip_adapter_image_embeds"]`` ->
    ``["ip_hidden_states"]`` through ``encoder_hid_proj``, as FluxTransformer2DModel.forward does itself."""
    attention_kwargs = kwargs.get("attention_kwargs")
    if not attention_kwargs or "ip_adapter_image_embeds" not in attention_kwargs:
        return None
    attention_kwargs = dict(attention_kwargs)
    attention_kwargs["ip_hidden_states"] = module.encoder_hid_proj(attention_kwargs.pop("ip_adapter_image_embeds"))
    return args, {**kwargs, "attention_kwargs": attention_kwargs}


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The tensors of an IP-Adapter weights file (or of ``ip_adapter.safetensors`` in directory ``path``), with
    XLabs' original key names (``ip_adapter_proj_model.*``, ``double_blocks.{k}.processor.ip_adapter_double_
    stream_{k,v}_proj.*``) renamed to the format above, as ``FluxPipeline.load_ip_adapter`` renames them."""
    from safetensors.torch import load_file

    file = os.path.join(path, IP_WEIGHTS) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(
            f"IP-Adapter weights {path!r}: no such file (a .safetensors file, or a directory holding {IP_WEIGHTS})"
        )
    state = {}
    for key, value in load_file(file).items():
        if key.startswith("ip_adapter_proj_model."):
            key = "image_proj." + key.removeprefix("ip_adapter_proj_model.")
        elif key.startswith("double_blocks."):
            key = "ip_adapter." + key.removeprefix("double_blocks.").replace("processor.", "").replace(
                "ip_adapter_double_stream_k_proj", "to_k_ip"
            ).replace("ip_adapter_double_stream_v_proj", "to_v_ip")
        state[key] = value
    return state


class IPAdapter:
    """The IP-Adapter attached to one denoiser: its frozen image encoder, the image projection (the
    transformer's ``encoder_hid_proj``) and one attention processor per double-stream block, all inside the
    denoiser module so that parallel wrappers and ``denoiser.parameters()`` see them; ``parameter_names``
    are their weights' names there."""

    def __init__(self, denoiser: nn.Module, settings: IPAdapterSettings, dtype: torch.dtype, device: torch.device):
        from diffusers.models.embeddings import ImageProjection, MultiIPAdapterImageProjection
        from diffusers.models.transformers.transformer_flux import (
            FluxIPAdapterAttnProcessor,
            FluxTransformer2DModel,
        )

        self.settings = settings
        self.encoder = ImageEncoder(settings.image_encoder, dtype, device)
        state = read_weights(settings.weights) if settings.weights else None
        config = denoiser.config
        width, inner = config.joint_attention_dim, config.num_attention_heads * config.attention_head_dim
        self.projection = ImageProjection(
            image_embed_dim=self.encoder.embed_dim, cross_attention_dim=width, num_image_text_embeds=settings.num_tokens
        )
        flux = isinstance(denoiser, FluxTransformer2DModel)
        processor_class = FluxIPAdapterAttnProcessor if flux else QwenImageIPAdapterAttnProcessor
        self.processors = [
            processor_class(
                hidden_size=inner, cross_attention_dim=width, num_tokens=(settings.num_tokens,), scale=settings.scale
            )
            for _ in denoiser.transformer_blocks
        ]
        if state is None:
            for processor in self.processors:
                nn.init.zeros_(processor.to_v_ip[0].weight)
                nn.init.zeros_(processor.to_v_ip[0].bias)
        else:
            self.load_state_dict(state, settings.weights)
        for block, processor in zip(denoiser.transformer_blocks, self.processors, strict=True):
            block.attn.set_processor(processor.to(device, dtype))
        denoiser.encoder_hid_proj = MultiIPAdapterImageProjection([self.projection]).to(device, dtype)
        if not flux:
            denoiser.register_forward_pre_hook(_project_image_embeds, with_kwargs=True)
        ids = {id(p) for p in self.parameters()}
        self.parameter_names = [name for name, p in denoiser.named_parameters() if id(p) in ids]

    @property
    def trainable(self) -> bool:
        """Whether the IP-Adapter trains (``trainer.models.trainable.AddedWeights``)."""
        return self.settings.trainable

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in (self.projection, *self.processors) for p in m.parameters()]

    def trainable_layers(self) -> list[nn.Module]:
        """The modules holding every IP-Adapter weight, each called on activations (the image projection, and
        each processor's key / value layers)."""
        return [self.projection] + [layer for p in self.processors for layer in (*p.to_k_ip, *p.to_v_ip)]

    def image_kwargs(self, style: torch.Tensor, unconditional_first: bool, dtype: torch.dtype) -> dict:
        """``ip_adapter_image_embeds`` for image embeddings ``style`` [B, D] (one IP-Adapter, one image per
        item: [B, 1, D]); with ``unconditional_first`` zeros for a leading CFG batch half."""
        if unconditional_first:
            style = torch.cat([torch.zeros_like(style), style])
        return {"ip_adapter_image_embeds": [style[:, None].to(dtype)]}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in the file format of this module's docstring."""
        return _file_state(self.projection, self.processors)

    def load_state_dict(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Copy ``state`` (file format) into the modules; a file for another model raises a ValueError."""
        own = self.state_dict()
        if set(state) != set(own):
            missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            raise ValueError(
                f"IP-Adapter weights {source!r} do not fit this model ({len(self.processors)} "
                f"double-stream blocks): missing {missing[:3]}, unexpected {extra[:3]}"
            )
        rows, dim = state["image_proj.proj.weight"].shape
        width = self.projection.norm.weight.shape[0]
        if dim != self.encoder.embed_dim:
            raise ValueError(
                f"IP-Adapter weights {source!r} take {dim}-dim image embeddings; "
                f"model.ip_adapter.image_encoder gives {self.encoder.embed_dim}"
            )
        if rows != self.settings.num_tokens * width and rows % width == 0:
            raise ValueError(
                f"IP-Adapter weights {source!r} have {rows // width} image tokens; set "
                f"model.ip_adapter.num_tokens={rows // width}"
            )
        for key, value in state.items():
            if value.shape != own[key].shape:
                raise ValueError(
                    f"IP-Adapter weights {source!r}: {key} is {tuple(value.shape)}, this model "
                    f"expects {tuple(own[key].shape)} (weights of another model)"
                )
        with torch.no_grad():
            for key, value in state.items():
                own[key].copy_(value)

    def save(self, directory: str) -> None:
        """Write ``ip_adapter.safetensors`` into ``directory``."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        save_file({k: v.cpu().contiguous() for k, v in self.state_dict().items()}, os.path.join(directory, IP_WEIGHTS))

    def load(self, directory: str) -> None:
        """Load what ``save`` wrote into ``directory``."""
        self.load_state_dict(read_weights(directory), directory)


def _file_state(projection: ImageProjection, processors: list[nn.Module]) -> dict[str, torch.Tensor]:
    state = {
        "image_proj.proj.weight": projection.image_embeds.weight,
        "image_proj.proj.bias": projection.image_embeds.bias,
        "image_proj.norm.weight": projection.norm.weight,
        "image_proj.norm.bias": projection.norm.bias,
    }
    for k, processor in enumerate(processors):
        for kind in ("to_k_ip", "to_v_ip"):
            layer = getattr(processor, kind)[0]
            state[f"ip_adapter.{k}.{kind}.weight"] = layer.weight
            state[f"ip_adapter.{k}.{kind}.bias"] = layer.bias
    return {k: v.detach() for k, v in state.items()}


def detach_ip_adapter(denoiser: nn.Module) -> dict[str, torch.Tensor] | None:
    """Take the IP-Adapter out of ``denoiser`` (the module itself or a plain copy of it, e.g. for an export): returns
    its weights in the file format (None without one) and leaves the blocks' default attention processors and no
    ``encoder_hid_proj``, so that ``save_pretrained`` writes the base model, which diffusers loads as it is."""
    from diffusers.models.embeddings import MultiIPAdapterImageProjection
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxTransformer2DModel
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    projection = getattr(denoiser, "encoder_hid_proj", None)
    if not isinstance(projection, MultiIPAdapterImageProjection):
        return None
    state = _file_state(
        projection.image_projection_layers[0], [block.attn.processor for block in denoiser.transformer_blocks]
    )
    default = FluxAttnProcessor if isinstance(denoiser, FluxTransformer2DModel) else QwenDoubleStreamAttnProcessor2_0
    for block in denoiser.transformer_blocks:
        block.attn.set_processor(default())
    denoiser.encoder_hid_proj = None
    return state


def split_style(
    model: str, ip_adapter: IPAdapter | None, inputs: ImageInputs | None, batch_size: int
) -> tuple[torch.Tensor | None, ImageInputs | None]:
    """(image embeddings of ``inputs.style`` [B, D], the other inputs) for a model with an IP-Adapter, which
    needs the style image (ValueError naming ``ImageInputs.style``); (None, ``inputs``) for one without (whose
    adapter then rejects a style image)."""
    if ip_adapter is None:
        return None, inputs
    style = require_image_input(model, inputs, "style", batch_size, 3, because="model.ip_adapter is set")
    return ip_adapter.encoder(style), replace(inputs, style=None)
