"""What every diffusers adapter shares about its configuration and loading: the dtypes, the config fields
every adapter has, the checked denoiser load and freezing of encoders. The other shared helpers live by
concern: ``trainable`` (trained weights, reference), ``text``, ``latents``, ``flow``, ``inputs``.

Adapters compose these functions instead of inheriting from a base class, so each adapter file still reads
top to bottom as one model family's story.
"""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from trainer.config.fields import LocalPath, NonNegativeInt, hub_id
from trainer.models.trainable import LoraSettings

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Imported:
    """A class attribute of library classes named "module:Name" (one, a tuple or a dict of them; a function
    returning a class also serves), imported when first read. Reading a config imports every adapter module for
    its config class; importing diffusers and transformers there would cost every config error seconds."""

    def __init__(self, names: Any):
        self.names = names
        self.value: Any = None

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if self.value is None:
            names = self.names
            if isinstance(names, str):
                self.value = _imported(names)
            elif isinstance(names, tuple):
                self.value = tuple(_imported(name) for name in names)
            else:
                self.value = {key: _imported(name) for key, name in names.items()}
        return self.value


def _imported(name: Any) -> type:
    if callable(name):
        return name()
    module, attribute = name.split(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass
class DiffusersModelConfig:
    """Fields every adapter's config has; each adapter's config subclasses it, setting its own ``name``
    and defaults and adding its own fields."""

    name: str = ""
    """Registry name of the adapter (``trainer.models.MODELS``)."""
    path: LocalPath = ""
    """Local diffusers-format directory of the weights (model_index.json and one folder per component)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and forward dtype of the denoiser, encoders and VAE; sampler math is float32 regardless. Trained
    LoRA / IP-Adapter weights stay float32 (the optimizer's precision); full fine-tuning in bf16/fp16 needs
    float32 master weights from the backend (zero2/zero3, or float32 here with fsdp2's param_dtype). fp16
    backward passes are loss-scaled."""
    resolution: NonNegativeInt = 0
    """Image side in pixels; 0 takes the model's default (its sample size times the VAE factor)."""
    lora: LoraSettings | None = None
    """LoRA settings; None trains the full denoiser (and a frozen copy serves as reference), or nothing of it
    when a trainable IP-Adapter (``ip_adapter.trainable``) is the policy."""
    gradient_checkpointing: bool = False
    """Recompute block activations in backward: less memory, about 30% more compute."""
    compile: Literal["none", "blocks", "full"] = "none"
    """torch.compile the denoiser: "blocks" compiles each repeated block (transformer blocks, a UNet's
    resnets and attentions; one compile per block class), "full" its whole forward (a little faster, about 3x
    the compile time), "none" runs eagerly. Rollout, training and reference use the same compiled code."""
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    """The torch.compile backend of ``model.compile``: "inductor" generates fused kernels (the speed-up);
    "aot_eager" captures the same forward and backward graphs and runs torch's own kernels, without code
    generation: a quick check that compiling composes with the rest of a run (tests, bisecting a failure)."""
    attention: Literal["auto", "math", "flash", "efficient", "cudnn"] = "auto"
    """The SDPA kernel of the whole run (rollout, training, reference, evaluation). "auto": on CUDA, the
    fastest of cudnn / flash / efficient / math whose forward+backward of this model's blocks is finite and
    matches math's, probed at start-up (printed and logged); elsewhere torch's own order. A named kernel runs
    every call it supports, math the rest (trainer/models/attention.py)."""
    negative_prompt: str = ""
    """The prompt of CFG's unconditional branch (the pipelines' default: the empty prompt)."""
    text_embeddings: LocalPath = ""
    """Directory written by ``python -m trainer.precompute``: prompt embeddings are read from it and the text
    encoders and tokenizers are not loaded at all (FLUX's T5 and Qwen-Image's Qwen2.5-VL take 9-16 GB).
    "" encodes prompts with the model's own text encoders."""
    image_latents: LocalPath = ""
    """Directory written by ``python -m trainer.precompute --latents DIR``: the VAE posteriors of the dataset's
    image inputs (the inpainting models' masked image, the editing models' references), read instead of
    VAE-encoding the same images at every rollout; an input not in it is encoded (the VAE stays loaded:
    rollouts decode with it). Adapters that VAE-encode no image input refuse it. "" encodes every input."""

    @classmethod
    def migrate(cls, raw: dict) -> dict:
        """Older configs (a run's saved config.yaml) had ``cudnn_attention``: true reads as attention=cudnn,
        false as the attention given (auto chooses by a probe, which rejects a failing cuDNN), with a warning."""
        if "cudnn_attention" not in raw:
            return raw
        raw = dict(raw)
        if raw.pop("cudnn_attention"):
            raw["attention"] = "cudnn"
        logger.warning(
            "warning: model.cudnn_attention is deprecated and read as model.attention=%s: replace it by "
            "model.attention (one of auto, math, flash, efficient, cudnn)",
            raw.get("attention", "auto"),
        )
        return raw


def weights_fix(path: str) -> str:
    """What to do where ``model.path`` holds no weights: download a Hub id it reads as, or point it at a copy."""
    if hub_id(path):
        return (
            f"{path!r} reads as a Hugging Face Hub id, and the trainer reads local folders only: "
            f"`hf download {path} --local-dir DIR`, then model.path=DIR"
        )
    return "point model.path at a local copy of the weights"


def denoiser_config(cls: type, config: Any, subfolder: str, label: str) -> dict[str, Any]:
    """The config diffusers saved for the denoiser in ``model.path``'s ``subfolder``, once it is known to be a
    ``cls``'s: a directory of no diffusers model, or of another model, fails with a message naming the fix
    (diffusers would report a weight of the wrong shape instead, or load it). Read before any weight, so that
    an adapter can check what it will feed the denoiser without loading billions of parameters first."""
    file = Path(config.path) / subfolder / "config.json"
    if not file.is_file():
        raise ValueError(
            f"model.path={config.path!r} is not a diffusers {label} directory (no {subfolder}/config.json); "
            f"{weights_fix(config.path)}"
        )
    saved = json.loads(file.read_text())
    if saved.get("_class_name") != cls.__name__:
        raise ValueError(
            f"model.path={config.path!r} holds a {saved.get('_class_name')} in {subfolder}/, and "
            f"model.name={config.name} loads a {cls.__name__}: point model.path at a {label} directory, "
            "or set model.name to the adapter of the model there"
        )
    return saved


def load_denoiser(cls: type, config: Any, subfolder: str, label: str, **load: Any) -> nn.Module:
    """``cls.from_pretrained(model.path, subfolder=...)`` once ``denoiser_config`` accepts the directory."""
    denoiser_config(cls, config, subfolder, label)
    return cls.from_pretrained(Path(config.path), subfolder=subfolder, **load)


def freeze(*modules: nn.Module | None) -> None:
    """No gradients and eval mode (dropout off) for frozen encoders and VAEs; ``None`` entries are skipped."""
    for module in modules:
        if module is not None:
            module.requires_grad_(False).eval()
