"""Model adapters, registered by name. A new model family is one file plus one line here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    adapter: str        # "module:Class" of the ModelAdapter, imported on use
    config_class: type  # its config dataclass (has a ``name`` field)

    def load(self):
        import importlib

        module, cls = self.adapter.split(":")
        return getattr(importlib.import_module(module), cls)


def _registry() -> dict[str, ModelSpec]:
    from trainer.models.flux import FluxConfig
    from trainer.models.flux_fill import FluxFillConfig
    from trainer.models.flux_kontext import FluxKontextConfig
    from trainer.models.qwen_image import QwenImageConfig
    from trainer.models.sd3 import SD3Config
    from trainer.models.sd15_inpaint import SD15InpaintConfig
    from trainer.models.tiny import TinyConfig

    return {
        "tiny": ModelSpec("trainer.models.tiny:TinyAdapter", TinyConfig),
        "sd3": ModelSpec("trainer.models.sd3:SD3Adapter", SD3Config),
        "flux": ModelSpec("trainer.models.flux:FluxAdapter", FluxConfig),
        "flux_fill": ModelSpec("trainer.models.flux_fill:FluxFillAdapter", FluxFillConfig),
        "flux_kontext": ModelSpec("trainer.models.flux_kontext:FluxKontextAdapter", FluxKontextConfig),
        "sd15_inpaint": ModelSpec("trainer.models.sd15_inpaint:SD15InpaintAdapter", SD15InpaintConfig),
        "qwen_image": ModelSpec("trainer.models.qwen_image:QwenImageAdapter", QwenImageConfig),
    }


MODELS: dict[str, ModelSpec] = _registry()


def build_adapter(config, device):
    """The ModelAdapter that ``config.name`` names, loaded on ``device``."""
    return MODELS[config.name].load()(config, device)
