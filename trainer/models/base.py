"""The contract between the training loop and a model family.

A ModelAdapter hides everything model-specific (text encoders, latent packing, CFG batching, VAE) behind a
few calls, so the trainer and the algorithms never ask which model they run. Adapters never import
``torch.distributed``: parallelism is applied from outside by a ParallelBackend, and the adapter is handed
the (possibly wrapped) network to call in ``predict``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from trainer.models.latents import ImageLatents
    from trainer.models.trainable import Trainable

IMAGE_FIELDS = ("image", "mask", "reference", "style")
"""The image tensors of ``Conditioning`` (those besides the text ``embeds``)."""
TRAJECTORY_FIELDS = ("noise", "schedule")
"""The tensors of ``Conditioning`` that bind it to one sampled trajectory (``Conditioning.starting_at``)."""


def pad_dim1(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` [B, L, ...] right-padded with zeros to [B, length, ...] (itself when L == length)."""
    if t.shape[1] == length:
        return t
    return nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, length - t.shape[1]))


def pad_text(embeds: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [L_i, D] embeddings to ``length``: ([B, length, D], mask [B, length] long)."""
    out = embeds[0].new_zeros(len(embeds), length, embeds[0].shape[-1])
    mask = torch.zeros(len(embeds), length, dtype=torch.long, device=out.device)
    for i, e in enumerate(embeds):
        out[i, : len(e)] = e
        mask[i, : len(e)] = 1
    return out, mask


def ragged_prompts(text: list[torch.Tensor], **fields) -> Conditioning:
    """Per-prompt [L_i, D] embeddings as the ragged ``prompt_embeds``, right-padded to the batch's longest prompt,
    with their ``prompt_mask``: the text conditioning of models whose prompts each keep their own length (a
    prompt's padding must not change its image). ``fields`` are the other ``Conditioning`` fields."""
    length = max(len(t) for t in text)
    embeds, mask = pad_text(text, length)
    return Conditioning(
        embeds={"prompt_embeds": embeds, "prompt_mask": mask},
        ragged=("prompt_embeds", "prompt_mask"),
        text_mask="prompt_mask",
        padded=any(len(t) < length for t in text),
        **fields,
    )


@dataclass
class Conditioning:
    """Everything a denoiser is conditioned on, batch-first, as one typed value.

    ``embeds`` holds the adapter's text tensors by name (e.g. ``prompt_embeds``, ``pooled``); the image
    fields carry inpainting (``image``, ``mask``), editing (``reference``) and IP-Adapter (``style``)
    inputs for the adapters that use them. All tensors share the batch dimension.
    """

    embeds: dict[str, torch.Tensor] = field(default_factory=dict)
    image: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    reference: torch.Tensor | None = None
    style: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    """[B, *latent_shape]: the trajectory's initial latents, for an adapter whose ``reads_trajectory`` is True
    (inpainting that blends its known region with the initial noise, as its pipeline does); set by ``rollout``."""
    schedule: torch.Tensor | None = None
    """[B, T + 1]: the trajectory's schedule (``sigmas``), set with ``noise``."""
    ragged: tuple[str, ...] = ()
    """Entries of ``embeds`` holding text right-padded along dim 1 to the batch's longest prompt, for models
    whose prompts each keep their own length (Qwen-Image); ``text_mask`` among them. ``cat`` zero-pads them
    to a common length."""
    text_mask: str | None = None
    """The [B, L] entry of ``embeds`` that is 1 at the real tokens of the ``ragged`` entries, 0 at padding."""
    padded: bool = False
    """Whether the ``ragged`` entries hold any padding: known on the host, so that a forward can drop an
    all-ones mask (as the pipelines do) without reading it from the device. Rows ``select``ed from a padded
    batch stay marked; their mask may be all ones, which changes nothing but rounding."""

    def _map(self, fn) -> Conditioning:
        changes = {k: fn(v) for k, v in self.embeds.items()}
        images = {
            name: fn(getattr(self, name))
            for name in (*IMAGE_FIELDS, *TRAJECTORY_FIELDS)
            if getattr(self, name) is not None
        }
        return replace(self, embeds=changes, **images)

    def starting_at(self, noise: torch.Tensor, schedule: torch.Tensor) -> Conditioning:
        """This conditioning bound to the trajectory that starts at ``noise`` [B, ...] on ``schedule`` [T + 1]."""
        return replace(self, noise=noise, schedule=schedule.expand(noise.shape[0], -1))

    def select(self, index: torch.Tensor | slice) -> Conditioning:
        """Rows ``index`` of every tensor."""
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> Conditioning:
        return self._map(lambda t: t.to(device))

    @staticmethod
    def cat(parts: list[Conditioning]) -> Conditioning:
        """Concatenate along the batch dimension (all parts must carry the same fields), the ``ragged``
        entries zero-padded to the longest part's length."""
        first = parts[0]
        length = {k: max(p.embeds[k].shape[1] for p in parts) for k in first.ragged}
        embeds = {
            k: torch.cat([pad_dim1(p.embeds[k], length[k]) if k in length else p.embeds[k] for p in parts])
            for k in first.embeds
        }
        images = {
            name: torch.cat([getattr(p, name) for p in parts])
            for name in (*IMAGE_FIELDS, *TRAJECTORY_FIELDS)
            if getattr(first, name) is not None
        }
        padded = any(p.padded or p.embeds[k].shape[1] < length[k] for p in parts for k in first.ragged)
        return Conditioning(embeds=embeds, **images, ragged=first.ragged, text_mask=first.text_mask, padded=padded)

    def __len__(self) -> int:
        for t in self.embeds.values():
            return t.shape[0]
        raise ValueError("empty Conditioning has no batch size")


@dataclass
class ImageInputs:
    """Per-item pixel inputs a task provides, in [0, 1], [B, C, H, W]: the image and mask to inpaint
    (mask 1 = repaint; image-to-video: the first frame), the reference image to edit ([B, N, C, H, W] for N per
    item, where the adapter takes several), the IP-Adapter style image, a video's last frame. The adapter encodes
    them into ``Conditioning``; an adapter that needs one that is missing raises a ValueError naming it."""

    image: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    reference: torch.Tensor | None = None
    style: torch.Tensor | None = None
    last_image: torch.Tensor | None = None
    """First-last-frame-to-video: the frame the video ends on, at ``image``'s size."""


class StepFunction(Protocol):
    """One stochastic reverse step with log-probability, bound to a schedule t[0..T]:
    ``(model_output, sample, index, noise_level, prev_sample=None, generator=None)`` ->
    ``(prev_sample, log_prob [B], prev_sample_mean, std)`` for the step t[index] -> t[index + 1]
    (``index`` an int, or [B] step indices per sample; DDIM steps to t[index] - N // T as diffusers' does)."""

    def __call__(
        self,
        model_output: torch.Tensor,
        sample: torch.Tensor,
        index: int | torch.Tensor,
        noise_level: float,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, ...]: ...

    def mean(
        self, model_output: torch.Tensor, sample: torch.Tensor, index: int | torch.Tensor, noise_level: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prev_sample_mean, std)`` alone: no sample drawn or scored (the reference network's KL term)."""

    def check_noise_level(self, noise_level: float) -> None:
        """A ValueError now if the step refuses ``noise_level`` (DDIM: eta outside [0, 1])."""


@runtime_checkable
class ModelAdapter(Protocol):
    """What the trainer needs from a model family: every member the loop, the algorithms and the run's tools read.
    One implementation per family file in ``trainer/models``, built as ``Adapter(config, device)``; the variant it
    runs (pipeline, conditioning parts, text path) is the registry's data for ``config.name`` (``ModelSpec``).

    The text path is data (the family class, or the variant's ``ModelSpec.text``), shared by ``encode_prompts``
    and ``trainer.precompute``: ``text_components`` (subfolder -> class), ``optional_text``, ``text_settings``
    (config fields that change embeddings), ``encode_text(pipeline, config, device, prompt)`` -> the tensors cached
    per prompt, and ``prompt_encoder(model, config, device)``, that path alone without denoiser or VAE
    (``text.prompt_encoder``). Class attributes naming diffusers or transformers classes are ``common.Imported``
    (imported when read), and the modules import those libraries inside functions: reading a config imports
    every adapter module.
    """

    modality: str
    """What it generates: "image" (``decode`` -> [B, C, H, W]) or "video" (``decode`` -> frames [B, F, C, H, W],
    ``latent_shape`` (C, F_latent, h, w), and ``fps`` and ``frames`` attributes)."""

    sampler_kind: str
    """Which step math this model's rollouts use: "flow" (velocity prediction) or "ddim" (epsilon)."""

    denoiser: nn.Module
    """The network that is trained (transformer or UNet, with LoRA layers when LoRA is on)."""

    latent_shape: tuple[int, ...]
    """Shape of one sample's latent, without the batch dimension."""

    device: torch.device
    """Where the denoiser, latents and schedules live (the trainer draws rollout noise there)."""

    shard_units: tuple[type[nn.Module], ...]
    """Block classes that FSDP shards one by one (declared as data, applied by the backend)."""

    trainable: Trainable
    """The weights the optimizer updates in ``denoiser`` (LoRA, all, or a trainable IP-Adapter): their set-up,
    saving and loading, and the reference policy they imply (``trainable.reference_spec``), which a parallel
    backend makes callable under its sharding (``trainer.models.trainable``)."""

    reads_trajectory: bool
    """Whether ``predict`` reads the rollout's initial noise and schedule (``Conditioning.noise``, ``.schedule``:
    inpainting whose soft mask blends with them), which ``rollout`` then binds to the conditioning."""

    compiled_blocks: tuple[type[nn.Module], ...]
    """Block classes ``model.compile=blocks`` compiles besides those it finds repeated in ``denoiser`` (none: every
    adapter's blocks are found)."""

    vae: nn.Module | None
    """The frozen VAE (None for a pixel-space model), which ``trainer.precompute --latents`` records through."""

    image_latents: ImageLatents
    """Where the VAE posteriors of image inputs come from (``model.image_latents``, else encoded), replaced by a
    recording one while precomputing."""

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Conditioning for ``prompts`` and optional per-item images (frozen encoders, no grad)."""
        ...

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """The distinct prompts that ``encode_prompts`` of ``prompts``, and ``predict`` at ``guidance_scales``
        (CFG's negative prompt), would fail to encode: those not in the ``model.text_embeddings`` store the
        adapter reads instead of encoding; none when it has its text encoders."""
        ...

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Initial noise x at sigma = 1, float32, drawn like the model's diffusers pipeline draws it."""
        ...

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The schedule t[0..T] for T steps, float32 on the device: decreasing noise levels with t[T] = 0
        for flow models; for DDIM models the scheduler's timesteps and the final one (t - N // T, below 0),
        divided by num_train_timesteps N, so that ``predict`` and ``training_target`` take one time unit."""
        ...

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """The reverse step (``kind``: the sampler variant, e.g. "sde", "cps", "eta", "ddim") with this
        model's schedule constants bound; a kind the model cannot use raises a ValueError."""
        ...

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Model output (velocity for flow models) at per-sample noise level ``sigma`` [B].

        With ``guidance_scale > 1`` CFG runs as one batched forward of [unconditional, conditional].
        ``net`` is the module to call: the wrapped policy, or the reference network.
        """
        ...

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(noisy input x_sigma, regression target) for the supervised denoising loss."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1], float32, [B, C, H, W]; a video model's frames [B, F, C, H, W]. Flow models decode
        differentiably in ``latents`` (the VAE is frozen, so latents without gradient build no graph): the
        differentiable-reward algorithms backpropagate through it; rollouts call it under no_grad, with the same
        numbers."""
        ...

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] [B, C, H, W] (a video model's frames [B, F, C, H, W]) -> the latents ``decode`` inverts
        (posterior mean): supervised targets."""
        ...
