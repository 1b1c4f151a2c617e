"""FLUX.2 [klein] (Flux2KleinPipeline): FLUX.2's transformer and VAE (``trainer.models.flux2``) with a Qwen3 text
encoder (its chat template, hidden states of layers 9, 18 and 27) and no guidance embedding.

Guidance is Klein's: the base models run true CFG against ``negative_prompt`` when ``guidance_scale > 1``
(pred = uncond + scale * (cond - uncond), one batched forward over [negative; prompt]); the step-distilled ones
(``is_distilled`` in model_index.json) ignore the guidance scale, as their pipeline does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.models.common import Imported
from trainer.models.flux2 import Flux2Adapter, Flux2Config


@dataclass
class Flux2KleinConfig(Flux2Config):
    """FLUX.2 [klein] weights (4B or 9B, base or distilled); the settings of FLUX.2."""

    name: str = "flux2_klein"
    text_encoder_out_layers: tuple[int, ...] = (9, 18, 27)
    """Qwen3 hidden states stacked into the prompt embeddings (the pipeline's default)."""


class Flux2KleinAdapter(Flux2Adapter):
    """ModelAdapter for FLUX.2 [klein] checkpoints (text-to-image)."""

    config_class = Flux2KleinConfig
    pipeline_class = Imported("diffusers:Flux2KleinPipeline")
    model_name = "flux2_klein"
    label = "FLUX.2 [klein]"
    guidance_embedded = False
    text_components = Imported(
        {"text_encoder": "transformers:Qwen3ForCausalLM", "tokenizer": "transformers:Qwen2Tokenizer"}
    )

    def _pipeline_settings(self, path: Path) -> dict[str, Any]:
        """``is_distilled`` from model_index.json (step-distilled checkpoints run no CFG)."""
        index = path / "model_index.json"
        saved = json.loads(index.read_text()) if index.is_file() else {}
        self.distilled = bool(saved.get("is_distilled", False))
        return {"is_distilled": self.distilled}

    def _runs_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1.0 and not self.distilled
