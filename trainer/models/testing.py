"""Tiny random models for every adapter, saved in diffusers layout (tests and benchmarks).

Each adapter's file declares its own tiny model and test facts in a ``tiny_spec()`` returning a ``TinySpec``
(as diffusers' per-pipeline tests declare ``get_dummy_components``); the registry exposes it as
``MODELS[name].tiny``. This module holds what they share: the tokenizers, text encoders and VAE parts the
components are built from (the real architectures at test sizes), and the functions that read the specs.
``tiny_config(name, root)`` builds the model of adapter ``name`` under ``root`` and returns that adapter's
config pointing at it, so the adapter loads it through the same ``config.path`` code it runs on real
weights; ``tiny_ip_adapter(root)`` does the same for an IP-Adapter's image encoder. No network needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from trainer.models import MODELS

CLIP_TEXT = dict(
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=2,
    projection_dim=32,
    max_position_embeddings=77,
    hidden_act="gelu",
)
T5_ENCODER = dict(
    d_model=32,
    d_kv=8,
    d_ff=37,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
)
VAE_1X = dict(
    sample_size=32,
    in_channels=3,
    out_channels=3,
    block_out_channels=(4,),
    layers_per_block=1,
    norm_num_groups=1,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.0609,
    scaling_factor=1.5035,
)
"""One-block VAE without downsampling: latents have the image's size (fast, and enough to test the code)."""
CLIP_VISION = dict(
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=2,
    image_size=32,
    patch_size=8,
    projection_dim=24,
    hidden_act="gelu",
)
"""16 patches of 8x8 pixels; 24-dim image embeddings (unlike every text width, so a mix-up fails)."""
TEXT_LENGTH = 16
"""Tokens per prompt for every tiny text encoder (CLIP model_max_length, T5 max_sequence_length)."""


@dataclass(frozen=True)
class TinySpec:
    """One adapter's tiny test model and the facts the shared tests and benches need about it, declared by
    its file's ``tiny_spec()``. Either ``components`` or ``build`` makes the model."""

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
    """The tiny dataset format that gives those inputs (``trainer.data.testing.tiny_dataset``)."""
    pipeline_latents: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    """(adapter, its pipeline's ``output_type="latent"`` result) -> the adapter's latents, for a pipeline that
    post-processes its latent output (FLUX.2 Klein un-normalises and unpatchifies it); None: they are the same."""
    posterior_draw: str | None = None
    """The diffusers function with which its pipeline samples the conditioning images' VAE posterior,
    which the parity check replaces by the posterior's mean (as the adapter takes)."""
    pipeline_patches: Callable[[Any], Mapping[str, Any]] | None = None
    """adapter -> {diffusers function: its stand-in} during the parity reference's call, for a pipeline constant
    the tiny model cannot run at (Qwen-Image-Edit's reference area of 1024^2 pixels)."""
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
    """Config overrides of the learning test (tests/integration/test_adapter_learning.py)."""
    learning_epochs: int = 12
    """RL epochs of the learning test."""
    bench_resolution: int | None = None
    """bench/adapters.py's ``model.resolution``: 256 image tokens; None keeps ``config``'s."""
    bench_guidance: float = 4.5
    """bench/adapters.py's guidance scale."""
    denoiser_9m: Mapping[str, Any] = field(default_factory=dict)
    """Denoiser config changes for about 9 M parameters (bench ``--denoiser 9m``)."""
    denoiser_real: Mapping[str, Any] = field(default_factory=dict)
    """Denoiser config changes to the published widths, heads and depths (bench ``--denoiser real``)."""
    compiled_ratio_atol: float = 1e-6
    """Largest |ratio - 1| of the on-policy check under ``model.compile=blocks`` (CPU float32): inductor's
    no-grad rollout graphs and grad training graphs may round differently where it fuses them differently."""
    compiled_ratio_atol_bf16: float = 0.0
    """The same on CUDA in bfloat16, where above the suite's common bound (bench/RESULTS_GPU.md)."""
    slow_dtype_cases: bool = False
    """Its CPU bfloat16 / float16 conformance cases run in the slow tier: for a variant whose reduced-precision
    numerics are its parent adapter's (tested in the default tier) and whose tiny model is slow on the CPU."""
    denoiser_variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Other published sizes of the same architecture by name, as ``denoiser_real`` (bench case ``name@variant``
    with ``--denoiser real``, e.g. ``sd3@large``)."""

    def __post_init__(self):
        assert (self.components is None) != (self.build is None), "a TinySpec has components or a build, not both"


_WORDS = (
    "a photo of the digit number cat dog red blue green big small image picture text sign handwritten "
    "zero one two three four five six seven eight nine"
).split()


def _corpus() -> list[str]:
    return [f"{a} {b} {c}" for a, b, c in zip(_WORDS, _WORDS[3:] + _WORDS[:3], _WORDS[7:] + _WORDS[:7], strict=True)]


def clip_tokenizer(directory: Path, max_length: int = TEXT_LENGTH):
    """A CLIPTokenizer over a small local corpus (built deterministically), saved to ``directory``."""
    from transformers import CLIPTokenizer

    from trainer.models.tokenizers import clip_bpe_tokenizer

    clip_bpe_tokenizer(directory, max_length)
    return CLIPTokenizer.from_pretrained(directory)


def t5_tokenizer(directory: Path, max_length: int = TEXT_LENGTH):
    """A unigram T5 tokenizer whose pieces are the corpus words and single characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [("▁" + w, -2.0) for w in _WORDS] + [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    tok = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)
    tok.save_pretrained(directory)
    return tok


def qwen_tokenizer(directory: Path, extra_special: tuple[str, ...] = ()):
    """A byte-level BPE with Qwen's chat special tokens (and ``extra_special``, e.g. the vision tokens of the
    editing pipelines), as a Qwen2Tokenizer. The vocabulary stays small so that the pipeline's prompt
    template still spans more than its 34 dropped prefix tokens."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Qwen2Tokenizer(
        vocab=state["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *extra_special]})
    tok.save_pretrained(directory)
    return tok


def clip_text_encoder(tok, cls_name: str = "CLIPTextModel"):
    import transformers

    config = transformers.CLIPTextConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **CLIP_TEXT,
    )
    return getattr(transformers, cls_name)(config).eval()


def t5_encoder(tok):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            decoder_start_token_id=0,
            **T5_ENCODER,
        )
    ).eval()


def vae_1x(latent_channels: int):
    """The one-block ``AutoencoderKL`` of ``VAE_1X`` with ``latent_channels`` channels."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(latent_channels=latent_channels, **VAE_1X).eval()


def build_tiny_image_encoder(path: str | Path, seed: int = 0) -> Path:
    """A CLIPVisionModelWithProjection and its CLIP image processor config, as IP-Adapters load them."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModelWithProjection

    path = Path(path)
    torch.manual_seed(seed)
    CLIPVisionModelWithProjection(CLIPVisionConfig(**CLIP_VISION)).eval().save_pretrained(path)
    side = CLIP_VISION["image_size"]
    CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(path)
    return path


def tiny_ip_adapter(root: str | Path, **overrides: Any):
    """IPAdapterSettings whose image encoder is a tiny CLIP vision tower built (once) under ``root``."""
    from trainer.models.ip_adapter import IPAdapterSettings

    path = Path(root) / "image_encoder"
    if not (path / "config.json").is_file():
        build_tiny_image_encoder(path)
    return IPAdapterSettings(**{"image_encoder": str(path), **overrides})


def randomize_ip_adapter(adapter, seed: int = 0, std: float = 0.5) -> None:
    """Replace every IP-Adapter weight of ``adapter`` by N(0, std^2) draws: a trained IP-Adapter's stand-in
    (fresh weights leave the output unchanged, so they cannot show that the IP path is used)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.ip_adapter.parameters():
            p.copy_(std * torch.randn(p.shape, generator=g))


TINY_NAMES = tuple(name for name, spec in MODELS.items() if spec.tiny is not None)
"""Registered adapters that declare a tiny model (every one should)."""


def tiny(name: str) -> TinySpec:
    """The TinySpec of adapter ``name``."""
    spec = MODELS[name].tiny
    if spec is None:
        raise ValueError(f"model.name={name} declares no tiny model: add a tiny_spec() to its adapter file")
    return spec


def build_tiny(name: str, path: str | Path, seed: int = 0) -> Path:
    """Write the tiny random model of adapter ``name`` to ``path`` in diffusers layout."""
    spec, path = tiny(name), Path(path)
    if spec.build is not None:
        spec.build(path, seed)
        return path
    torch.manual_seed(seed)
    MODELS[name].load().pipeline_class(**spec.components(path)).save_pretrained(path)
    return path


def tiny_config(name: str, root: str | Path, **overrides: Any):
    """Build (once) the tiny model of adapter ``name`` under ``root`` and return its adapter config, with
    ``overrides`` applied (e.g. ``lora=LoraSettings(rank=4)``, ``resolution=32``)."""
    path = Path(root) / name
    if not (path / "model_index.json").is_file():
        build_tiny(name, path)
    return replace(MODELS[name].config_class(path=str(path), **tiny(name).config), **overrides)


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
        images = adapter.pipeline(**kwargs).images
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


def image_inputs(adapter, batch_size: int, seed: int = 0, optional: bool = False):
    """Random ImageInputs of the kinds ``adapter`` needs (``TinySpec.inputs``: images, binary masks,
    references; ``optional``: also those it only takes; with an IP-Adapter a style image, the same for every item
    as the pipelines take one), else None."""
    from trainer.models.base import ImageInputs

    g = torch.Generator().manual_seed(seed)
    side = getattr(adapter, "resolution", 16)
    draws: dict[str, Callable[[], torch.Tensor]] = {
        "image": lambda: torch.rand(batch_size, 3, side, side, generator=g),
        "mask": lambda: (torch.rand(batch_size, 1, side, side, generator=g) > 0.5).float(),
        "reference": lambda: torch.rand(batch_size, *references, 3, side, side, generator=g),
    }
    spec = tiny(adapter.config.name)
    references = (spec.references,) if spec.references > 1 else ()
    kinds = spec.inputs + (spec.optional_inputs if optional else ())
    inputs = ImageInputs(**{kind: draws[kind]() for kind in kinds})
    if getattr(adapter, "ip_adapter", None) is not None:
        inputs.style = torch.rand(1, 3, side, side, generator=g).expand(batch_size, -1, -1, -1)
    return inputs if any(v is not None for v in vars(inputs).values()) else None
