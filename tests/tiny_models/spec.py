"""What the shared tests need to know about one adapter's tiny model (as diffusers' per-pipeline tests declare
``get_dummy_components``): how to build it, how its pipeline is called, which inputs and tolerances apply."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class TinySpec:
    """One adapter's tiny test model and the facts the shared tests need about it (its family's module in this
    package declares it). Either ``components`` or ``build`` makes the model."""

    pipeline_call: Callable[[Any, Any, float], dict[str, Any]]
    """(adapter, ImageInputs or None, guidance) -> the diffusers pipeline's arguments besides prompts,
    steps, generator and output type: the parity reference's call."""
    components: Callable[[Path], dict[str, Any]] | None = None
    """Directory -> the adapter's ``pipeline_class`` components (random, tokenizers written there)."""
    build: Callable[[Path, int], Any] | None = None
    """(directory, seed) -> writes the model itself: a model that builds its own (the embedded tiny one)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """Config fields besides ``path`` for the tests' size: 64 latent tokens."""
    guidance: float = 3.0
    """Guidance scale of the tests: batched CFG, or the FLUX family's guidance embedding."""
    inputs: tuple[str, ...] = ()
    """The ``ImageInputs`` fields it needs: ("image", "mask") or ("reference",) (drawn in this order)."""
    optional_inputs: tuple[str, ...] = ()
    """``ImageInputs`` fields it takes without needing them (FLUX.2's reference images): drawn on request."""
    references: int = 1
    """Reference images per item the tiny inputs draw: several give ``reference`` [B, N, 3, H, W]."""
    data: str = "prompt_file"
    """The tiny dataset format that gives those inputs (``tiny_data.tiny_dataset``)."""
    pipeline_latents: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    """(adapter, its pipeline's ``output_type="latent"`` result) -> the adapter's latents, for a pipeline that
    post-processes its latent output (FLUX.2 Klein un-normalises and unpatchifies it); None: they are the same."""
    pipeline_outputs: Callable[[Any, Any], torch.Tensor] | None = None
    """(adapter, its pipeline's whole ``output_type="latent"`` output) -> the adapter's latents, for a pipeline
    with several outputs (LTX-2's video and audio latents, which its rollouts carry as one tensor)."""
    posterior_draw: str | None = None
    """The diffusers function with which its pipeline samples the conditioning images' VAE posterior,
    which the parity check replaces by the posterior's mean (as the adapter takes)."""
    pipeline_patches: Callable[[Any], Mapping[str, Any]] | None = None
    """adapter -> {diffusers function: its stand-in} during the parity reference's call, for a pipeline constant
    the tiny model cannot run at (Qwen-Image-Edit's reference area of 1024^2 pixels)."""
    pipeline_components: Callable[[Any, float], Mapping[str, Any]] | None = None
    """(adapter, guidance) -> {component name: stand-in} set on the adapter's pipeline during the parity
    reference's call, for a pipeline that takes its guidance from a component (HunyuanVideo 1.5's ``guider``)."""
    pipeline_one_prompt: bool = False
    """Whether its pipeline takes one prompt per call (QwenImageEditPlusPipeline): the parity reference calls it
    per prompt, in order, on the same generator (the noise of a batch is its items' draws in turn)."""
    ip_adapter: bool = False
    """Whether the suites also run it with a trainable IP-Adapter (``<name>+ip``)."""
    ip_pipeline: bool = False
    """Whether its pipeline takes ``ip_adapter_image_embeds``: the ``+ip`` case's parity check runs."""
    text_store: bool = True
    """Whether its prompt embeddings can be precomputed (``model.text_embeddings``): not where they read an image."""
    same_shapes: tuple[str, ...] = ()
    """Registered models whose weights this adapter loads (only training tells them apart)."""
    learning: tuple[str, ...] = ()
    """Config overrides of the learning test (tests/integration/test_adapter_learning.py); a video model without
    them is a strict xfail there (not yet measured to learn)."""
    learning_epochs: int = 12
    """RL epochs of the learning test."""
    compiled_ratio_atol: float = 1e-6
    """Largest |ratio - 1| of the on-policy check under ``model.compile=blocks`` (CPU float32): inductor's
    no-grad rollout graphs and grad training graphs may round differently where it fuses them differently."""
    compiled_ratio_atol_bf16: float = 0.0
    """The same on CUDA in bfloat16, where above the suite's common bound (bench/RESULTS_GPU.md)."""
    device_reads_per_forward: int = 0
    """Reads of a device value per denoiser forward that its pipeline makes too (Wan 2.2's choice of expert by
    timestep): the no-device-read check allows that many per forward."""
    video_compression: tuple[int, int] | None = None
    """A video model's (frames, pixels) compression in its tiny folder, the VAE's times the transformer's patch:
    frames are ``frames`` k + 1, sides multiples of ``pixels``; the shared size checks derive their cases from it
    (tests/video_checks.py)."""
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Further cases the shared suites run this adapter in, with no registry name of their own: suffix -> the
    fields of this spec that differ (``VARIANT_FIELDS``: the model and its inputs; ``wan_i2v``'s ``"last"`` is case
    ``wan_i2v+last``, a first and a last frame on an FLF2V checkpoint). One that keeps ``components`` loads this
    adapter's tiny folder."""
    slow_dtype_cases: bool = False
    """Its CPU bfloat16 / float16 conformance cases run in the slow tier: for a variant whose reduced-precision
    numerics are its parent adapter's (tested in the default tier) and whose tiny model is slow on the CPU."""

    def __post_init__(self):
        assert (self.components is None) != (self.build is None), "a TinySpec has components or a build, not both"
        assert all(set(v) <= VARIANT_FIELDS for v in self.variants.values()), f"a variant changes {VARIANT_FIELDS}"


VARIANT_FIELDS = frozenset({"components", "inputs", "optional_inputs", "references"})
"""What a variant may change: how its pipeline is called, its guidance and tolerances stay its adapter's, so the
suites read those from the adapter's registry name."""
