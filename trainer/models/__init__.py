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
    from trainer.models.sd3 import SD3Config
    from trainer.models.tiny import TinyConfig

    return {
        "tiny": ModelSpec("trainer.models.tiny:TinyAdapter", TinyConfig),
        "sd3": ModelSpec("trainer.models.sd3:SD3Adapter", SD3Config),
    }


MODELS: dict[str, ModelSpec] = _registry()


def build_adapter(config, device):
    """The ModelAdapter that ``config.name`` names, loaded on ``device``."""
    return MODELS[config.name].load()(config, device)
