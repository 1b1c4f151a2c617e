"""Model adapters, registered by name. A new model family is one file (its adapter) plus one line here; its tiny
test model lives beside the tests (tests/tiny_models)."""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    adapter: str
    """"module:Class" of the ModelAdapter, imported on use."""

    @property
    def config_class(self) -> type:
        """The adapter's config dataclass (``config_class`` on the adapter; it has a ``name`` field)."""
        return self.load().config_class

    def load(self):
        module, cls = self.adapter.split(":")
        return getattr(importlib.import_module(module), cls)


MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("trainer.models.tiny:TinyAdapter"),
    "sd3": ModelSpec("trainer.models.sd3:SD3Adapter"),
    "flux": ModelSpec("trainer.models.flux:FluxAdapter"),
    "flux_fill": ModelSpec("trainer.models.flux_fill:FluxFillAdapter"),
    "flux_kontext": ModelSpec("trainer.models.flux_kontext:FluxKontextAdapter"),
    "chroma": ModelSpec("trainer.models.chroma:ChromaAdapter"),
    "chroma_inpaint": ModelSpec("trainer.models.chroma_inpaint:ChromaInpaintAdapter"),
    "sd15_inpaint": ModelSpec("trainer.models.sd15_inpaint:SD15InpaintAdapter"),
    "qwen_image": ModelSpec("trainer.models.qwen_image:QwenImageAdapter"),
    "z_image": ModelSpec("trainer.models.z_image:ZImageAdapter"),
    "qwen_image_edit": ModelSpec("trainer.models.qwen_image_edit:QwenImageEditAdapter"),
    "qwen_image_edit_plus": ModelSpec("trainer.models.qwen_image_edit_plus:QwenImageEditPlusAdapter"),
    "qwen_image_inpaint": ModelSpec("trainer.models.qwen_image_inpaint:QwenImageInpaintAdapter"),
    "qwen_image_edit_inpaint": ModelSpec("trainer.models.qwen_image_edit_inpaint:QwenImageEditInpaintAdapter"),
    "flux2": ModelSpec("trainer.models.flux2:Flux2Adapter"),
    "flux2_klein": ModelSpec("trainer.models.flux2_klein:Flux2KleinAdapter"),
    "flux2_klein_inpaint": ModelSpec("trainer.models.flux2_klein_inpaint:Flux2KleinInpaintAdapter"),
}
"""Model name -> its adapter. Adding a model: its adapter file and one line here (and a preset)."""


def image_encoding_models() -> list[str]:
    """Registered models whose adapter VAE-encodes image inputs (``encodes_image_inputs``), so that
    ``model.image_latents`` can serve them."""
    return [name for name, spec in MODELS.items() if getattr(spec.load(), "encodes_image_inputs", False)]


def build_adapter(config, device):
    """The ModelAdapter that ``config.name`` names, loaded on ``device``, with the process's attention kernel set
    as ``config.attention`` names it (``auto``: torch's order, until a trainer's probe chooses; see
    ``trainer.models.attention``). On CUDA float32 matmuls may use TF32."""
    import torch

    from trainer.models.attention import use_attention

    use_attention(getattr(config, "attention", "auto"))
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the float32 matmuls left (LoRA computes in model.dtype)
        torch.backends.cudnn.allow_tf32 = True
    if (problem := model_path_problem(config)) is not None:
        raise ValueError(problem)
    adapter_class = MODELS[config.name].load()
    hint = other_models_pipeline(config, adapter_class)
    if hint:
        logger.warning(hint)
    return adapter_class(config, device)


def model_path_problem(config) -> str | None:
    """Why ``model.path`` cannot be ``config.name``'s model folder, found without reading a weight (the run's
    pre-flight asks before anything is built), or None: a file, a missing folder (an adapter that builds its own
    model, the tiny one, says where it may), a folder with nothing in it."""
    from trainer.models.common import weights_fix

    path = Path(config.path)
    if path.is_file():
        return (
            f"model.path={config.path!r} is a file: name the model's folder (a diffusers pipeline's, with "
            "model_index.json)"
        )
    adapter_class = MODELS[config.name].load()
    if (own := getattr(adapter_class, "path_problem", None)) is not None:
        return own(config)
    if not path.is_dir() or not any(path.iterdir()):
        return (
            f"model.path={config.path!r} is not a diffusers {adapter_class.pipeline_class.__name__} directory "
            f"({'an empty folder' if path.is_dir() else 'no such folder'}); {weights_fix(config.path)}"
        )
    return None


def other_models_pipeline(config, adapter_class: type) -> str | None:
    """What to tell a user whose ``model.path`` was saved by the pipeline of another registered model (its
    ``model_index.json``), or None. A warning, not an error: FLUX.1-dev and Kontext weights have the same
    shapes, so only this file tells them apart, and a fine-tune may have been saved by either pipeline."""
    index = Path(config.path) / "model_index.json"
    if not index.is_file():
        return None
    saved = json.loads(index.read_text()).get("_class_name")
    ours = adapter_class.pipeline_class.__name__
    if saved == ours or saved in getattr(adapter_class, "loads_pipelines", ()):
        return None
    owners = sorted(name for name, spec in MODELS.items() if spec.load().pipeline_class.__name__ == saved)
    if not owners:
        return None
    return (
        f"model.path={config.path!r} was saved by a {saved} (model_index.json), the pipeline of "
        f"model.name={owners[0]}, and model.name={config.name} runs it as a {ours}: set "
        f"model.name={owners[0]} if these are its weights"
    )
