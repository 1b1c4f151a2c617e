"""Model adapters, registered by name in ``MODELS`` (a ``shared.registry.Registry``, like every registry). A new
model family is one file (its adapter) plus one entry here; its tiny test model lives beside the tests
(tests/tiny_models)."""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from shared.registry import Entry, Registry

logger = logging.getLogger(__name__)


def _load(name: str):
    module, attribute = name.split(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(eq=False)
class ModelSpec(Entry):
    """One registered model: an ``Entry`` whose target is its family's adapter (``MODELS[name](config, device)``
    builds it, ``.load()`` is its class), with what this variant of the family changes in it as data (the pipeline
    it reproduces, its config, the conditioning parts it combines, its text path). Every "module:Name" is imported
    on use: reading a config imports no model library."""

    adapter: str
    """"module:Class" of the family's ModelAdapter (the entry's target)."""
    pipeline: str = ""
    """"module:Class" of the diffusers pipeline it reproduces; "" for the family's (``adapter.pipeline_class``)."""
    config: str = ""
    """"module:Class" of its config dataclass (with a ``name`` field); "" for the family's."""
    parts: tuple[str, ...] = ()
    """"module:NAME" of each conditioning part it combines (``trainer.models.conditioning``), in order."""
    text: str = ""
    """"module:Name" of its text path (text components, settings, ``encode_text``); "" for the family's own."""
    loads_pipelines: tuple[str, ...] = ()
    """Saved pipelines whose weights are its own (an inpainting pipeline reads its base model's folder)."""
    path_check: str = ""
    """"module:function" (config -> problem or None) replacing the check that ``model.path`` holds weights."""
    builds: str = ""
    """"module:function" (config -> None) that writes the model at ``model.path`` where it is missing and may be
    built (the embedded tiny model): ``provide``."""

    def __post_init__(self):
        super().__init__(self.adapter)

    def provide(self, config) -> None:
        """Make sure ``model.path`` holds the model before its adapter loads it: built where this model builds its
        own (``builds``), a ValueError naming the fix where it may not be."""
        if self.builds:
            _load(self.builds)(config)

    @property
    def config_class(self) -> type:
        return _load(self.config) if self.config else super().config_class

    @property
    def pipeline_class(self) -> type:
        return _load(self.pipeline) if self.pipeline else self.load().pipeline_class

    @property
    def conditioning(self) -> tuple:
        """Its conditioning parts, loaded."""
        return tuple(_load(part) for part in self.parts)

    @property
    def encodes_image_inputs(self) -> bool:
        """Whether it VAE-encodes per-item image inputs (every conditioning part does): ``model.image_latents``."""
        return bool(self.parts)

    @property
    def reads_trajectory(self) -> bool:
        """Whether its ``predict`` reads the rollout's initial noise and schedule (a part's soft inpainting)."""
        return any(part.reads_trajectory for part in self.conditioning)

    @property
    def text_path(self):
        """What its prompts are encoded with: ``text_components``, ``optional_text``, ``text_settings`` and
        ``encode_text`` (``trainer.models.text``); the family's adapter class unless ``text`` names another."""
        return _load(self.text) if self.text else self.load()

    @property
    def text_components(self) -> dict:
        return self.text_path.text_components

    @property
    def optional_text(self) -> tuple[str, ...]:
        return self.text_path.optional_text

    @property
    def text_settings(self) -> tuple[str, ...]:
        return self.text_path.text_settings

    @property
    def encode_text(self):
        return self.text_path.encode_text

    def prompt_encoder(self, config, device):
        """Its text path alone as prompt -> tensors (``trainer.precompute``; ``text.prompt_encoder``, or the text
        path's own where it needs more than the text encoders or refuses)."""
        return self.text_path.prompt_encoder(self, config, device)


MODELS = Registry(
    {
        "tiny": ModelSpec(
            "trainer.models.sd3:SD3Adapter",
            config="trainer.models.tiny:TinyConfig",
            path_check="trainer.models.tiny:path_problem",
            builds="trainer.models.tiny:build_missing",
        ),
        "sd3": ModelSpec("trainer.models.sd3:SD3Adapter"),
        "flux": ModelSpec("trainer.models.flux:FluxAdapter"),
        "flux_fill": ModelSpec(
            "trainer.models.flux:FluxAdapter",
            "diffusers:FluxFillPipeline",
            parts=("trainer.models.flux:FILL_CHANNELS",),
        ),
        "flux_kontext": ModelSpec(
            "trainer.models.flux:FluxAdapter",
            "diffusers:FluxKontextPipeline",
            parts=("trainer.models.flux:KONTEXT_REFERENCE",),
        ),
        "chroma": ModelSpec("trainer.models.chroma:ChromaAdapter"),
        "chroma_inpaint": ModelSpec(
            "trainer.models.chroma:ChromaAdapter",
            "diffusers:ChromaInpaintPipeline",
            parts=("trainer.models.conditioning:INPAINT",),
            loads_pipelines=("ChromaPipeline",),
        ),
        "sd15_inpaint": ModelSpec(
            "trainer.models.sd15_inpaint:SD15InpaintAdapter", parts=("trainer.models.sd15_inpaint:MASKED_IMAGE",)
        ),
        "qwen_image": ModelSpec("trainer.models.qwen_image:QwenImageAdapter"),
        "z_image": ModelSpec("trainer.models.z_image:ZImageAdapter"),
        "qwen_image21": ModelSpec("trainer.models.qwen_image21:QwenImage21Adapter"),
        "qwen_image_edit": ModelSpec(
            "trainer.models.qwen_image:QwenImageAdapter",
            "diffusers:QwenImageEditPipeline",
            config="trainer.models.qwen_image:QwenImageEditConfig",
            parts=("trainer.models.qwen_edit:EDIT",),
            text="trainer.models.qwen_edit:EditText",
        ),
        "qwen_image_edit_plus": ModelSpec(
            "trainer.models.qwen_image:QwenImageAdapter",
            "diffusers:QwenImageEditPlusPipeline",
            config="trainer.models.qwen_image:QwenImageEditPlusConfig",
            parts=("trainer.models.qwen_edit:EDIT_PLUS",),
            text="trainer.models.qwen_edit:EditText",
        ),
        "qwen_image_inpaint": ModelSpec(
            "trainer.models.qwen_image:QwenImageAdapter",
            "diffusers:QwenImageInpaintPipeline",
            parts=("trainer.models.conditioning:INPAINT",),
            loads_pipelines=("QwenImagePipeline",),
        ),
        "qwen_image_edit_inpaint": ModelSpec(
            "trainer.models.qwen_image:QwenImageAdapter",
            "diffusers:QwenImageEditInpaintPipeline",
            config="trainer.models.qwen_image:QwenImageEditConfig",
            parts=("trainer.models.qwen_edit:EDIT_SOURCE", "trainer.models.conditioning:INPAINT"),
            text="trainer.models.qwen_edit:EditText",
            loads_pipelines=("QwenImageEditPipeline",),
        ),
        "flux2": ModelSpec(
            "trainer.models.flux2:Flux2Adapter", parts=("trainer.models.conditioning:FLUX2_REFERENCES",)
        ),
        "flux2_klein": ModelSpec(
            "trainer.models.flux2:Flux2Adapter",
            "diffusers:Flux2KleinPipeline",
            config="trainer.models.flux2:Flux2KleinConfig",
            parts=("trainer.models.conditioning:FLUX2_REFERENCES",),
            text="trainer.models.flux2:KleinText",
        ),
        "flux2_klein_inpaint": ModelSpec(
            "trainer.models.flux2:Flux2Adapter",
            "diffusers:Flux2KleinInpaintPipeline",
            config="trainer.models.flux2:Flux2KleinConfig",
            parts=("trainer.models.conditioning:SOFT_INPAINT", "trainer.models.conditioning:FLUX2_REFERENCES"),
            text="trainer.models.flux2:KleinText",
            loads_pipelines=("Flux2KleinPipeline",),
        ),
        "wan": ModelSpec("trainer.models.wan:WanAdapter"),
        "tiny_wan": ModelSpec(
            "trainer.models.wan:WanAdapter",
            config="trainer.models.tiny_wan:TinyWanConfig",
            path_check="trainer.models.tiny_wan:path_problem",
            builds="trainer.models.tiny_wan:build_missing",
        ),
        "wan22": ModelSpec("trainer.models.wan:WanAdapter", config="trainer.models.wan:Wan22Config"),
        "wan_i2v": ModelSpec(
            "trainer.models.wan:WanAdapter",
            "diffusers:WanImageToVideoPipeline",
            parts=("trainer.models.wan_parts:FIRST_FRAME",),
        ),
        "wan22_i2v": ModelSpec(
            "trainer.models.wan:WanAdapter",
            "diffusers:WanImageToVideoPipeline",
            config="trainer.models.wan:Wan22Config",
            parts=("trainer.models.wan_parts:FIRST_FRAME",),
        ),
        "wan_ti2v": ModelSpec(
            "trainer.models.wan:WanAdapter",
            config="trainer.models.wan:WanTI2VConfig",
            parts=("trainer.models.conditioning:PINNED_FIRST_FRAME",),
        ),
        "ltx2": ModelSpec("trainer.models.ltx2:LTX2Adapter", parts=("trainer.models.conditioning:PINNED_FIRST_FRAME",)),
        "hunyuan_video15": ModelSpec("trainer.models.hunyuan_video15:HunyuanVideo15Adapter"),
        "hunyuan_video15_i2v": ModelSpec(
            "trainer.models.hunyuan_video15:HunyuanVideo15Adapter",
            "diffusers:HunyuanVideo15ImageToVideoPipeline",
            parts=("trainer.models.hunyuan_video15_parts:FIRST_FRAME",),
        ),
    },
    key="model.name",
)
"""Model name (``model.name``) -> its ``ModelSpec``: its family's adapter and variant. Adding a variant of a family:
one entry here (and a preset); adding a family: its adapter file and one entry."""


def image_encoding_models() -> list[str]:
    """Registered models whose adapter VAE-encodes image inputs (``ModelSpec.encodes_image_inputs``), so that
    ``model.image_latents`` can serve them."""
    return [name for name, spec in MODELS.items() if spec.encodes_image_inputs]


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
    if hint := other_models_pipeline(config):
        logger.warning(hint)
    return MODELS[config.name](config, device)


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
    spec = MODELS[config.name]
    if spec.path_check:
        return _load(spec.path_check)(config)
    if not path.is_dir() or not any(path.iterdir()):
        return (
            f"model.path={config.path!r} is not a diffusers {spec.pipeline_class.__name__} directory "
            f"({'an empty folder' if path.is_dir() else 'no such folder'}); {weights_fix(config.path)}"
        )
    return None


def other_models_pipeline(config) -> str | None:
    """What to tell a user whose ``model.path`` was saved by the pipeline of another registered model (its
    ``model_index.json``), or None. A warning, not an error: FLUX.1-dev and Kontext weights have the same
    shapes, so only this file tells them apart, and a fine-tune may have been saved by either pipeline."""
    index = Path(config.path) / "model_index.json"
    if not index.is_file():
        return None
    saved = json.loads(index.read_text()).get("_class_name")
    ours = MODELS[config.name].pipeline_class.__name__
    if saved == ours or saved in MODELS[config.name].loads_pipelines:
        return None
    owners = sorted(name for name, spec in MODELS.items() if spec.pipeline_class.__name__ == saved)
    if not owners:
        return None
    return (
        f"model.path={config.path!r} was saved by a {saved} (model_index.json), the pipeline of "
        f"model.name={owners[0]}, and model.name={config.name} runs it as a {ours}: set "
        f"model.name={owners[0]} if these are its weights"
    )
