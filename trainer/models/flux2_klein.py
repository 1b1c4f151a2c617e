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
from trainer.models.flux2 import FLUX2_9M, Flux2Adapter, Flux2Config


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


# --- tiny test model and test facts (read by tests and benches through MODELS["flux2_klein"].tiny) -----------
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""A Qwen3-style chat template for the tiny tokenizer (an empty think block when thinking is off)."""
_KLEIN_REAL = dict(
    attention_head_dim=128, num_attention_heads=24, num_layers=5, num_single_layers=20, axes_dims_rope=(32, 32, 32, 32)
)
"""FLUX.2 [klein] 4B's widths, heads and depths (the text width stays the tiny encoder's)."""


def tiny_components(path: Path) -> dict:
    """Klein: a 2-layer Qwen3 (hidden 16; all three hidden states stacked: 48 text channels), the 1x FLUX.2
    VAE, and the transformer without guidance embedding."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.models import flux2, testing

    tok = testing.qwen_tokenizer(path / "tokenizer")
    tok.chat_template = _CHAT_TEMPLATE
    tok.save_pretrained(path / "tokenizer")
    text = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return dict(
        transformer=flux2.tiny_transformer(joint_attention_dim=48, guidance_embeds=False),
        vae=flux2.tiny_vae(),
        text_encoder=Qwen3ForCausalLM(text).eval(),
        tokenizer=tok,
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0),
        is_distilled=False,
    )


def pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """The pipeline's arguments at the adapter's settings; its negative prompt is always ""."""
    assert not adapter.config.negative_prompt, "the parity reference runs the default negative prompt"
    return dict(
        height=adapter.resolution,
        width=adapter.resolution,
        guidance_scale=guidance_scale,
        max_sequence_length=adapter.config.max_sequence_length,
        text_encoder_out_layers=tuple(adapter.config.text_encoder_out_layers),
    )


def pipeline_latents(adapter, latents):
    """The Klein pipelines return latents un-normalised and unpatchified: back to the adapter's tokens."""
    return adapter.model_latents(latents)


def tiny_spec():
    """The tiny FLUX.2 [klein] and its test facts (``trainer.models.testing.TinySpec``): 16 pixels, 8x8 tokens,
    CFG at 3 (a base model)."""
    from trainer.models import testing

    return testing.TinySpec(
        components=tiny_components,
        pipeline_call=pipeline_call,
        pipeline_latents=pipeline_latents,
        config=dict(resolution=16, max_sequence_length=48, text_encoder_out_layers=[0, 1, 2]),
        guidance=3.0,
        learning=("train.learning_rate=0.05",),
        learning_epochs=24,
        optional_inputs=("reference",),
        bench_resolution=32,
        bench_guidance=4.0,
        denoiser_9m=FLUX2_9M,
        denoiser_real=_KLEIN_REAL,
    )
