"""Tiny random models for every registered adapter, saved in diffusers layout (tests and benchmarks).

Each model family's module here declares its adapters' tiny models and test facts (``TinySpec``, as diffusers'
per-pipeline tests declare ``get_dummy_components``) in its ``SPECS``; ``tiny(name)`` finds them by registry
name. ``tiny_config(name, root)`` builds the model of adapter ``name`` under ``root`` and returns that adapter's
config pointing at it, so the adapter loads it through the same ``config.path`` code it runs on real weights;
``tiny_ip_adapter(root)`` does the same for an IP-Adapter's image encoder. No network needed.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tiny_models.parts import (  # noqa: F401 (the tests' helpers, by one name)
    TEXT_LENGTH,
    build_tiny_image_encoder,
    clip_tokenizer,
    randomize_ip_adapter,
    tiny_ip_adapter,
)
from tiny_models.spec import TinySpec
from trainer.models import MODELS

FAMILIES = (
    "sd3",
    "flux",
    "chroma",
    "qwen_image",
    "flux2",
    "sd15_inpaint",
    "z_image",
    "wan",
    "qwen_image21",
    "ltx2",
    "hunyuan_video15",
)
"""The modules of this package that declare tiny models (``SPECS``: registry name -> its TinySpec's maker)."""


@functools.cache
def _specs() -> dict[str, Callable[[], TinySpec]]:
    found: dict[str, Callable[[], TinySpec]] = {}
    for family in FAMILIES:
        found.update(importlib.import_module(f"tiny_models.{family}").SPECS)
    return found


TINY_NAMES = tuple(name for name in MODELS if name in _specs())
"""Registered adapters that declare a tiny model (every one should)."""


@functools.cache
def tiny(case: str) -> TinySpec:
    """The TinySpec of adapter ``case``, or of its variant ``<name>+<suffix>`` (``TinySpec.variants``)."""
    name, _, suffix = case.partition("+")
    if name not in _specs():
        raise ValueError(f"model.name={name} has no tiny model: add it to its family's module in tests/tiny_models")
    spec = _specs()[name]()
    if not suffix:
        return spec
    if suffix not in spec.variants:
        raise ValueError(f"{name}'s TinySpec declares no variant {suffix!r} (its variants: {sorted(spec.variants)})")
    return replace(spec, variants={}, **spec.variants[suffix])


def variant_cases(name: str) -> list[str]:
    """The cases ``<name>+<suffix>`` of adapter ``name``'s declared variants."""
    return [f"{name}+{suffix}" for suffix in sorted(tiny(name).variants)]


def _folder(case: str) -> str:
    """The tiny folder of ``case``: its own for a variant with its own components, else its adapter's."""
    name, _, suffix = case.partition("+")
    return case if "components" in tiny(name).variants.get(suffix, {}) else name


def build_tiny(case: str, path: str | Path, seed: int = 0) -> Path:
    """Write the tiny random model of adapter (or variant) ``case`` to ``path`` in diffusers layout."""
    spec, path = tiny(case), Path(path)
    if spec.build is not None:
        spec.build(path, seed)
        return path
    torch.manual_seed(seed)
    MODELS[case.partition("+")[0]].pipeline_class(**spec.components(path)).save_pretrained(path)
    return path


def tiny_config(case: str, root: str | Path, **overrides: Any):
    """Build (once) the tiny model of adapter ``case`` (or of a variant, ``wan_i2v+last``) under ``root`` and return
    its adapter's config, with ``overrides`` applied (e.g. ``lora=LoraSettings(rank=4)``, ``resolution=32``)."""
    name, path = case.partition("+")[0], Path(root) / _folder(case)
    if not (path / "model_index.json").is_file():
        build_tiny(_folder(case), path)
    return replace(MODELS[name].config_class(name=name, path=str(path), **tiny(name).config), **overrides)


def run_pipeline(
    adapter,
    prompts: list[str],
    inputs,
    num_steps: int,
    guidance_scale: float,
    generator: torch.Generator,
    output_type: str = "latent",
    latents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample with the adapter's own diffusers pipeline (same components) as a rollout would: same prompts,
    image inputs, steps, guidance and generator; the reference for parity tests and benchmarks.

    Image-conditioned pipelines sample the VAE posterior of their conditioning images where the adapters
    take its mean; that draw is replaced by the mean here, the only change to the pipelines.
    """
    import contextlib
    from unittest import mock

    spec = tiny(adapter.config.name)
    if spec.pipeline_one_prompt and len(prompts) > 1:
        from trainer.models.base import ImageInputs

        def item(i: int):
            return (
                None
                if inputs is None
                else ImageInputs(**{k: v if v is None else v[i : i + 1] for k, v in vars(inputs).items()})
            )

        # The rollout's one draw for the batch: on CUDA, two draws of one item's noise differ from it
        noise = adapter.prepare_latents(len(prompts), generator)
        return torch.cat(
            [
                run_pipeline(adapter, [p], item(i), num_steps, guidance_scale, generator, output_type, noise[i : i + 1])
                for i, p in enumerate(prompts)
            ]
        )
    kwargs: dict[str, Any] = dict(
        prompt=prompts,
        num_inference_steps=num_steps,
        generator=generator,
        output_type=output_type,
        **({} if latents is None else {"latents": latents}),
    )
    if getattr(adapter, "ip_adapter", None) is not None:
        kwargs.update(ip_pipeline_kwargs(adapter, inputs))
    kwargs.update(spec.pipeline_call(adapter, inputs, guidance_scale))
    patches = dict(spec.pipeline_patches(adapter)) if spec.pipeline_patches is not None else {}
    if spec.posterior_draw is not None:
        patches[spec.posterior_draw] = lambda output, generator=None, sample_mode="sample": output.latent_dist.mode()
    with contextlib.ExitStack() as stack:
        for target, stand_in in patches.items():
            stack.enter_context(mock.patch(target, stand_in))
        components = spec.pipeline_components(adapter, guidance_scale) if spec.pipeline_components else {}
        for name, stand_in in components.items():
            stack.enter_context(mock.patch.object(adapter.pipeline, name, stand_in))
        output = adapter.pipeline(**kwargs)
    if output_type == "latent" and spec.pipeline_outputs is not None:
        return spec.pipeline_outputs(adapter, output)
    images = output.frames if adapter.modality == "video" else output.images
    if output_type == "latent" and spec.pipeline_latents is not None:
        return spec.pipeline_latents(adapter, images)
    return images


def ip_pipeline_kwargs(adapter, inputs) -> dict[str, Any]:
    """``ip_adapter_image_embeds`` for a FLUX-family pipeline: the style embedding of the first item (the
    pipeline repeats one image per IP-Adapter over the batch), and zero embeddings for the negative branch as
    the adapter uses (the pipeline would encode a black image)."""
    if not tiny(adapter.config.name).ip_pipeline:
        raise ValueError(
            f"{adapter.pipeline_class.__name__} has no IP-Adapter: there is no diffusers reference to compare with"
        )
    if not all(torch.equal(s, inputs.style[0]) for s in inputs.style):
        raise ValueError("the FLUX pipelines take one style image for the whole batch")
    embeds = adapter.ip_adapter.encoder(inputs.style[:1])[None]  # [1 image, 1 item, D]
    return {"ip_adapter_image_embeds": [embeds], "negative_ip_adapter_image_embeds": [torch.zeros_like(embeds)]}


def image_inputs(adapter, batch_size: int, seed: int = 0, optional: bool = False, case: str | None = None):
    """Random ImageInputs of the kinds ``adapter`` (or its variant ``case``) needs (``TinySpec.inputs``: images,
    binary masks, references; ``optional``: also those it only takes; with an IP-Adapter a style image, the same
    for every item as the pipelines take one), else None."""
    from trainer.models.base import ImageInputs

    g = torch.Generator().manual_seed(seed)
    side = getattr(adapter, "resolution", 16)
    size = (adapter.height, adapter.width) if adapter.modality == "video" else (side, side)  # a video's frames
    draws: dict[str, Callable[[], torch.Tensor]] = {
        "image": lambda: torch.rand(batch_size, 3, *size, generator=g),
        "mask": lambda: (torch.rand(batch_size, 1, *size, generator=g) > 0.5).float(),
        "reference": lambda: torch.rand(batch_size, *references, 3, *size, generator=g),
        "last_image": lambda: torch.rand(batch_size, 3, *size, generator=g),
    }
    spec = tiny(case or adapter.config.name)
    references = (spec.references,) if spec.references > 1 else ()
    kinds = spec.inputs + (spec.optional_inputs if optional else ())
    inputs = ImageInputs(**{kind: draws[kind]() for kind in kinds})
    if getattr(adapter, "ip_adapter", None) is not None:
        inputs.style = torch.rand(1, 3, side, side, generator=g).expand(batch_size, -1, -1, -1)
    return inputs if any(v is not None for v in vars(inputs).values()) else None


def write_text_store(config, directory: str | Path, prompts: list[str]) -> None:
    """What ``trainer.precompute`` does for ``prompts``: adapter ``config``'s text path alone (``prompt_encoder``), one
    prompt at a time, into a text-embedding store at ``directory``."""
    from trainer.models.text import TextEmbeddingStore, text_fingerprint

    encode = MODELS[config.name].prompt_encoder(config, "cpu")
    store = TextEmbeddingStore.create(str(directory), text_fingerprint(config))
    for prompt in prompts:
        store.add(prompt, encode(prompt))
    store.save()
