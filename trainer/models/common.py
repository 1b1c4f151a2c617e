"""Functions every adapter shares: dtypes, LoRA / full fine-tuning set-up, the reference network, saving and
loading trainable weights, CFG arithmetic and the validation of per-item image inputs.

Adapters compose these functions instead of inheriting from a base class, so each adapter file still reads
top to bottom as one model family's story.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

import torch
from torch import nn

from trainer.models.base import ImageInputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

LORA_WEIGHTS = "adapter_model.safetensors"
LORA_CONFIG = "adapter_config.json"


@dataclass
class LoraSettings:
    """LoRA on the attention projections (peft); the disabled adapter is the reference policy."""

    rank: int = 32
    """Adapter rank: capacity of the update; 32-64 is common for SD3/FLUX RL."""
    alpha: int = 64
    """Scale numerator: the update is scaled by alpha / rank."""
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module names that get adapters; attention projections as in Flow-GRPO."""


@dataclass
class DiffusersModelConfig:
    """Fields every adapter's config has; each adapter's config subclasses it, setting its own ``name``
    and defaults and adding its own fields."""

    name: str = ""
    """Registry name of the adapter (``trainer.models.MODELS``)."""
    path: str = ""
    """Local diffusers-format directory of the weights (model_index.json and one folder per component)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and forward dtype of the denoiser, encoders and VAE; sampler math is float32 regardless."""
    resolution: int = 0
    """Image side in pixels; 0 takes the model's default (its sample size times the VAE factor)."""
    lora: LoraSettings | None = None
    """LoRA settings; None trains the full denoiser (and a frozen copy serves as reference)."""
    gradient_checkpointing: bool = False
    """Recompute block activations in backward: less memory, about 30% more compute."""


def freeze(*modules: nn.Module | None) -> None:
    """No gradients and eval mode (dropout off) for frozen encoders and VAEs; ``None`` entries are skipped."""
    for module in modules:
        if module is not None:
            module.requires_grad_(False).eval()


def prepare_denoiser(denoiser: nn.Module, lora: LoraSettings | None, gradient_checkpointing: bool) -> None:
    """Make ``denoiser`` trainable as configured: LoRA adapters on a frozen base, or every weight."""
    if lora is not None:
        from peft import LoraConfig

        denoiser.requires_grad_(False)
        denoiser.add_adapter(LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, init_lora_weights="gaussian", target_modules=lora.target_modules,
        ))
    if gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()


def reference_network(denoiser: nn.Module, lora: LoraSettings | None) -> nn.Module:
    """LoRA: the same network with its adapter disabled (no extra memory). Full fine-tuning: a frozen copy
    of the weights as they are now (costs one more denoiser)."""
    if lora is not None:
        return AdapterDisabled(denoiser)
    return copy.deepcopy(denoiser).requires_grad_(False).eval()


class AdapterDisabled(nn.Module):
    """Calls a peft-adapted diffusers model with its adapters switched off."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, *args, **kwargs):
        self.net.disable_adapters()
        try:
            return self.net(*args, **kwargs)
        finally:
            self.net.enable_adapters()


def save_trainable(denoiser: nn.Module, lora: bool, directory: str) -> None:
    """LoRA: ``adapter_model.safetensors`` + ``adapter_config.json`` (peft format); otherwise the whole
    denoiser with ``save_pretrained``."""
    os.makedirs(directory, exist_ok=True)
    if not lora:
        denoiser.save_pretrained(directory)
        return
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(denoiser).items()}
    save_file(state, os.path.join(directory, LORA_WEIGHTS))
    peft_config = denoiser.peft_config["default"].to_dict()
    peft_config["target_modules"] = sorted(peft_config["target_modules"])
    with open(os.path.join(directory, LORA_CONFIG), "w") as f:
        json.dump(peft_config, f, indent=2, default=str)


def load_trainable(denoiser: nn.Module, lora: bool, directory: str) -> None:
    """Load what ``save_trainable`` wrote into ``denoiser`` in place; a mismatch raises a ValueError."""
    if not lora:
        loaded = type(denoiser).from_pretrained(directory, torch_dtype=denoiser.dtype)
        denoiser.load_state_dict(loaded.state_dict())
        return
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    path = os.path.join(directory, LORA_WEIGHTS)
    if not os.path.isfile(path):
        raise ValueError(f"{directory!r} holds no LoRA weights ({LORA_WEIGHTS}); was it saved with LoRA on?")
    state = load_file(path)
    expected = get_peft_model_state_dict(denoiser)
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in state):
        raise ValueError(f"LoRA weights in {directory!r} do not match this model's adapter (different "
                         "target_modules or rank than model.lora)")
    set_peft_model_state_dict(denoiser, state)


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale * (cond - uncond), in float32."""
    uncond, cond = uncond.float(), cond.float()
    return uncond + scale * (cond - uncond)


def reject_image_inputs(model: str, inputs: ImageInputs | None, allowed: Sequence[str] = ()) -> None:
    """ValueError when ``inputs`` carries a field that ``model`` does not use."""
    if inputs is None:
        return
    extra = [f.name for f in fields(inputs) if f.name not in allowed and getattr(inputs, f.name) is not None]
    if extra:
        raise ValueError(f"the {model} adapter takes no ImageInputs.{', .'.join(extra)}"
                         + (f" (it uses {', '.join(allowed)})" if allowed else " (it is a text-to-image model)"))


def require_image_input(
    model: str, inputs: ImageInputs | None, name: str, batch_size: int, channels: int,
    size: tuple[int, int] | None = None, multiple_of: int = 1,
) -> torch.Tensor:
    """``inputs.<name>`` checked to be [batch_size, channels, H, W] (H, W = ``size`` if given, else
    multiples of ``multiple_of``), or a ValueError that names the input and what was expected."""
    value = None if inputs is None else getattr(inputs, name)
    what = f"ImageInputs.{name}"
    if value is None:
        raise ValueError(f"the {model} adapter needs {what} ([B, {channels}, H, W] in [0, 1]); none was given")
    if value.ndim != 4 or value.shape[0] != batch_size or value.shape[1] != channels:
        raise ValueError(f"{what} has shape {tuple(value.shape)}; the {model} adapter expects "
                         f"[{batch_size}, {channels}, H, W] (one per prompt)")
    if size is not None and tuple(value.shape[-2:]) != tuple(size):
        raise ValueError(f"{what} is {tuple(value.shape[-2:])} pixels; the {model} adapter generates "
                         f"{tuple(size)} (model.resolution)")
    if value.shape[-2] % multiple_of or value.shape[-1] % multiple_of:
        raise ValueError(f"{what} sides {tuple(value.shape[-2:])} must be multiples of {multiple_of}")
    return value


def rectified_flow_target(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_sigma = (1 - sigma) x0 + sigma noise and the velocity target noise - x0 (flow models)."""
    s = sigma.float().reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise, noise - x0


def shifted_flow_sigmas(scheduler, num_steps: int, image_seq_len: int, device: torch.device) -> torch.Tensor:
    """FLUX / Qwen-Image schedule, set as their pipelines set it: sigmas linspace(1, 1/T, T) shifted by
    mu = calculate_shift(image_seq_len) under the scheduler's dynamic shifting; returns sigmas[0..T]."""
    import numpy as np
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    mu = calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    retrieve_timesteps(scheduler, num_steps, device, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas.to(torch.float32)
