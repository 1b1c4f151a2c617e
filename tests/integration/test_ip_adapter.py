"""IP-Adapter conditioning of flux, flux_fill and qwen_image on tiny random models (a tiny CLIP vision tower as the
image encoder, loaded from disk like a real one):
  (1) scale 0, or fresh weights (zero value projection), give exactly the output of the model without one;
  (2) with non-zero weights the style image steers the output, per item of a batch;
  (3) a GRPO step with the IP-Adapter as the policy changes only IP-Adapter weights (and LoRA with LoRA on),
      and the reference keeps the pre-step policy;
  (4) trainable.save / trainable.load and ``ip_adapter.weights`` round-trip the weights in the documented format;
      a frozen IP-Adapter stays as loaded under full fine-tuning, whose checkpoints round-trip too; an export
      writes the IP-Adapter beside the plain diffusers denoiser;
  (5) FLUX: a noise-level-0 rollout equals diffusers' FluxPipeline that loaded the saved file with
      ``load_ip_adapter`` and got the same ``ip_adapter_image_embeds``;
  (6) configuration mistakes raise errors that name the fix (a resume's reference snapshot too).
"""

from __future__ import annotations

from unittest import mock

import pytest
import tiny_models as testing
import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file

from trainer.algorithms.base import LossContext, Rewards
from trainer.algorithms.grpo import GRPO, GRPOConfig
from trainer.config import ConfigError, load_config
from trainer.export import export_denoiser
from trainer.models import build_adapter
from trainer.models.base import ImageInputs
from trainer.models.ip_adapter import IP_WEIGHTS, IPAdapter
from trainer.models.reference import frozen_copy
from trainer.models.trainable import LoraSettings
from trainer.rollout import SamplerSettings, rollout

NAMES = ("flux", "flux_fill", "qwen_image")
PROMPTS = ["a photo of a cat", "the digit five"]
GUIDANCE = {"flux": 3.5, "flux_fill": 3.5, "qwen_image": 3.0}
"""The FLUX family's guidance embedding; Qwen-Image's true CFG (covers the zero-embedding unconditional half)."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ip")


def make(name: str, root, ip: dict | None = None, **overrides):
    """The tiny ``name`` adapter, float32, with an IP-Adapter of settings ``ip`` (None: without one)."""
    if ip is not None:
        overrides["ip_adapter"] = testing.tiny_ip_adapter(root, **ip)
    adapter = build_adapter(testing.tiny_config(name, root, dtype="float32", **overrides), "cpu")
    adapter.pipeline.set_progress_bar_config(disable=True)
    return adapter


def styles(adapter, seeds: list[int], style: bool = True) -> ImageInputs | None:
    """One style image per seed, with the inputs the model itself needs (flux_fill: the same image and mask
    every time); without ``style``, those alone (None for a text-to-image model)."""
    side = adapter.resolution
    inputs = testing.image_inputs(adapter, len(seeds)) or ImageInputs()
    inputs.style = (
        torch.stack([torch.rand(3, side, side, generator=torch.Generator().manual_seed(s)) for s in seeds])
        if style
        else None
    )
    return inputs if any(v is not None for v in vars(inputs).values()) else None


@torch.no_grad()
def predict(adapter, inputs: ImageInputs | None, net=None) -> torch.Tensor:
    cond = adapter.encode_prompts(PROMPTS, inputs)
    x = adapter.prepare_latents(len(PROMPTS), torch.Generator().manual_seed(0))
    sigma = adapter.sigmas(4)[1].expand(len(PROMPTS))
    return adapter.predict(net or adapter.denoiser, x, sigma, cond, GUIDANCE[adapter.config.name])


def ip_names(adapter) -> set[str]:
    return set(adapter.ip_adapter.parameter_names)


@pytest.mark.parametrize("name", NAMES)
def test_zero_scale_or_fresh_weights_leave_the_model_unchanged(name, root):
    plain = make(name, root)
    expected = predict(plain, styles(plain, [1, 2], style=False))
    fresh = make(name, root, ip={})
    assert torch.equal(predict(fresh, styles(fresh, [1, 2])), expected)
    off = make(name, root, ip={"scale": 0.0})
    testing.randomize_ip_adapter(off)
    assert torch.equal(predict(off, styles(off, [1, 2])), expected)


@pytest.mark.parametrize("name", NAMES)
def test_style_images_steer_each_item(name, root):
    adapter = make(name, root, ip={})
    testing.randomize_ip_adapter(adapter)
    a_b, a_a, c_b = (predict(adapter, styles(adapter, s)) for s in ([1, 2], [1, 1], [3, 2]))
    torch.testing.assert_close(a_b[0], a_a[0], rtol=0, atol=1e-5)  # item 0 sees only its own style
    assert (a_b[1] - a_a[1]).abs().max() > 1e-3
    assert (a_b[0] - c_b[0]).abs().max() > 1e-3
    torch.testing.assert_close(a_b[1], c_b[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "lora"), [("flux", False), ("flux_fill", True), ("qwen_image", False), ("qwen_image", True)]
)
def test_grpo_step_trains_only_the_ip_adapter(name, lora, root):
    adapter = make(name, root, ip={}, lora=LoraSettings(rank=4, alpha=4) if lora else None)
    lora_names = {n for n, p in adapter.denoiser.named_parameters() if "lora_" in n}
    assert {n for n, p in adapter.denoiser.named_parameters() if p.requires_grad} == ip_names(adapter) | lora_names
    settings = SamplerSettings(num_steps=3, guidance_scale=GUIDANCE[name], kind="sde", noise_level=1.0)
    inputs = styles(adapter, [1, 1])
    ro = rollout(
        adapter,
        adapter.denoiser,
        [PROMPTS[0]] * 2,
        torch.zeros(2, dtype=torch.long),
        settings,
        torch.Generator().manual_seed(2),
        inputs,
    )
    algorithm = GRPO(GRPOConfig(group_size=2, kl_beta=0.1, sampler=settings))
    rewards = torch.tensor([0.0, 1.0])
    batch = algorithm.make_batch(ro, Rewards(rewards, rewards, torch.zeros(2, dtype=torch.long), 0))
    (units,) = algorithm.plan(batch, torch.Generator().manual_seed(0))
    reference = adapter.trainable.reference()
    before_step = predict(adapter, inputs)
    before = {k: v.clone() for k, v in adapter.denoiser.state_dict().items()}

    optimizer = torch.optim.SGD(adapter.trainable.parameters(), lr=1.0)
    for unit in units:
        loss, stats = algorithm.loss(LossContext(adapter, adapter.denoiser, reference), unit)
        assert float(stats["kl"]) == 0.0
        loss.backward()
    optimizer.step()

    changed = {k for k, v in adapter.denoiser.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and changed <= ip_names(adapter) | lora_names, sorted(changed - ip_names(adapter))[:5]
    assert bool(changed & lora_names) == lora
    assert not torch.equal(predict(adapter, inputs), before_step)
    assert torch.equal(predict(adapter, inputs, net=reference), before_step)


@pytest.mark.parametrize("name", NAMES)
def test_trainable_ip_weights_round_trip(name, root, tmp_path):
    tokens = 2 if name == "qwen_image" else 4  # FLUX: the count diffusers' loader reads at this width
    trained = make(name, root, ip={"num_tokens": tokens})
    testing.randomize_ip_adapter(trained, seed=3)
    trained.trainable.save(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [IP_WEIGHTS]
    state = load_file(tmp_path / "ckpt" / IP_WEIGHTS)
    width = trained.denoiser.config.joint_attention_dim
    assert state["image_proj.proj.weight"].shape == (tokens * width, trained.ip_adapter.encoder.embed_dim)
    blocks = len(trained.denoiser.transformer_blocks)
    assert {k for k in state if k.startswith("ip_adapter.")} == {
        f"ip_adapter.{k}.{kind}.{p}"
        for k in range(blocks)
        for kind in ("to_k_ip", "to_v_ip")
        for p in ("weight", "bias")
    }

    inputs = styles(trained, [1, 2])
    expected = predict(trained, inputs)
    fresh = make(name, root, ip={"num_tokens": tokens})
    assert not torch.equal(predict(fresh, inputs), expected)
    fresh.trainable.load(str(tmp_path / "ckpt"))
    assert torch.equal(predict(fresh, inputs), expected)
    assert torch.equal(
        predict(make(name, root, ip={"num_tokens": tokens, "weights": str(tmp_path / "ckpt")}), inputs), expected
    )
    if name == "qwen_image":
        with pytest.raises(ValueError, match="have 2 image tokens; set model.ip_adapter.num_tokens=2"):
            make(name, root, ip={"num_tokens": 4, "weights": str(tmp_path / "ckpt")})


def test_frozen_ip_adapter_under_full_fine_tuning(root, tmp_path):
    weights = tmp_path / "ip"
    source = make("qwen_image", root, ip={})
    testing.randomize_ip_adapter(source, seed=4)
    source.ip_adapter.save(str(weights))
    trained = make("qwen_image", root, ip={"trainable": False, "weights": str(weights)})
    trainable = {n for n, p in trained.denoiser.named_parameters() if p.requires_grad}
    assert not trainable & ip_names(trained) and len(trainable) > len(ip_names(trained))
    inputs = styles(trained, [1, 2])
    before = predict(trained, inputs)
    with torch.no_grad():
        for p in trained.trainable.parameters():
            p.add_(0.01)
    assert torch.equal(predict(trained, inputs, net=trained.trainable.reference()), predict(trained, inputs))
    trained.trainable.save(str(tmp_path / "ckpt"))
    fresh = make("qwen_image", root, ip={"trainable": False, "weights": str(weights)})
    assert torch.equal(predict(fresh, inputs), before)
    fresh.trainable.load(str(tmp_path / "ckpt"))
    assert torch.equal(predict(fresh, inputs), predict(trained, inputs))


def test_flux_rollout_equals_pipeline_with_loaded_ip_adapter(root, tmp_path):
    from diffusers import FluxPipeline

    adapter = make("flux", root, ip={"scale": 0.7})
    testing.randomize_ip_adapter(adapter, seed=5)
    adapter.ip_adapter.save(str(tmp_path))
    inputs = styles(adapter, [4, 4])
    settings = SamplerSettings(num_steps=3, guidance_scale=GUIDANCE["flux"], kind="sde", noise_level=0.0)
    ro = rollout(
        adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(0), inputs
    )

    pipeline = FluxPipeline.from_pretrained(adapter.config.path)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_ip_adapter(str(tmp_path), weight_name=IP_WEIGHTS, image_encoder_pretrained_model_name_or_path=None)
    pipeline.set_ip_adapter_scale(0.7)
    embeds = adapter.ip_adapter.encoder(inputs.style[:1])[None]
    expected = pipeline(
        prompt=PROMPTS,
        num_inference_steps=3,
        guidance_scale=GUIDANCE["flux"],
        height=16,
        width=16,
        max_sequence_length=adapter.config.max_sequence_length,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        ip_adapter_image_embeds=[embeds],
        negative_ip_adapter_image_embeds=[torch.zeros_like(embeds)],
    ).images
    torch.testing.assert_close(ro.latents[:, -1], expected, rtol=0, atol=1e-5)
    adapter.pipeline.set_ip_adapter_scale(0.0)
    off = rollout(
        adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(0), inputs
    )
    assert (off.latents[:, -1] - expected).abs().max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_export_writes_the_base_model_and_the_ip_adapter_file(name, root, tmp_path):
    """A trained IP-Adapter with LoRA, exported: diffusers loads the denoiser with no weight missing or left over
    (LoRA merged, no IP-Adapter in it), and that denoiser with the exported ``ip_adapter.safetensors`` computes
    what the trained policy computes."""
    adapter = make(name, root, ip={}, lora=LoraSettings(rank=4, alpha=4))
    testing.randomize_ip_adapter(adapter, seed=6)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # LoRA's B starts at zero: move every trainable weight
        for p in adapter.trainable.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    inputs = styles(adapter, [4, 5])
    expected = predict(adapter, inputs)
    export_denoiser(frozen_copy(adapter.denoiser), tmp_path)

    exported, info = type(adapter.denoiser).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    fresh = make(name, root, ip={"weights": str(tmp_path / IP_WEIGHTS)})
    missing, unexpected = fresh.denoiser.load_state_dict(exported.state_dict(), strict=False)
    assert not unexpected and set(missing) == ip_names(fresh)
    torch.testing.assert_close(predict(fresh, inputs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [4, 8, 16])
def test_flux_token_counts_are_refused_where_diffusers_cannot_load_the_export(tokens, root, tmp_path):
    """diffusers' FLUX IP-Adapter loader takes no token count: it reads 16 from a projection of 65536 rows (16 x
    FLUX.1's 4096-wide text features), else 4. An IP-Adapter of ``tokens`` tokens on the tiny FLUX (32 wide)
    saved as the export writes it: ``FluxPipeline.load_ip_adapter`` reads it exactly where the config is
    accepted; other counts are refused when the config is read (8), or before the transformer loads (16)."""
    from diffusers import FluxPipeline

    plain = make("flux", root)
    IPAdapter(plain.denoiser, testing.tiny_ip_adapter(root, num_tokens=tokens), torch.float32, plain.device).save(
        str(tmp_path)
    )
    pipeline = FluxPipeline.from_pretrained(plain.config.path)
    try:
        pipeline.load_ip_adapter(
            str(tmp_path), weight_name=IP_WEIGHTS, image_encoder_pretrained_model_name_or_path=None
        )
        loads = True
    except (RuntimeError, ValueError) as exc:
        assert "size" in str(exc) or "shape" in str(exc), exc
        loads = False
    assert loads == (tokens == 4)
    if loads:
        make("flux", root, ip={"num_tokens": tokens})
    elif tokens == 16:
        with pytest.raises(
            ValueError,
            match=r"num_tokens=16 on this transformer \(joint_attention_dim=32\): .* "
            r"would read its 512 projection rows as 4 image tokens.*num_tokens=4",
        ):
            with mock.patch.object(FluxTransformer2DModel, "from_pretrained", side_effect=AssertionError("loaded")):
                make("flux", root, ip={"num_tokens": tokens})
    else:
        with pytest.raises(ConfigError, match=r"model\.ip_adapter\.num_tokens=8: .*load_ip_adapter.* set 4 .* or 16"):
            load_config(
                overrides=["model.name=flux", f"model.ip_adapter={{image_encoder: /enc, num_tokens: {tokens}}}"]
            )


def test_configuration_mistakes_name_the_fix(root, tmp_path):
    adapter = make("qwen_image", root, ip={})
    with pytest.raises(ValueError, match=r"needs ImageInputs\.style .* because model\.ip_adapter is set"):
        adapter.encode_prompts(PROMPTS)
    with pytest.raises(ConfigError, match="ip_adapter.image_encoder"):
        load_config(overrides=["model.name=flux", "model.ip_adapter={num_tokens: 4}"])
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        make("flux", root, ip={"image_encoder": str(tmp_path)})
    with pytest.raises(ValueError, match="no such file"):
        make("flux", root, ip={"weights": str(tmp_path / "missing.safetensors")})
    qwen_weights = tmp_path / "qwen"
    adapter.ip_adapter.save(str(qwen_weights))
    with pytest.raises(ValueError, match="do not fit this model"):
        make("flux", root, ip={"weights": str(qwen_weights)})
    ctx = LossContext(adapter, adapter.denoiser, adapter.trainable.reference())
    state = ctx.checkpoint_state()["reference_swapped"]
    snapshot = state.tensors
    assert not state.per_rank
    assert snapshot.keys() == ip_names(adapter)
    with pytest.raises(ValueError, match="resume with the model.ip_adapter and model.lora settings"):
        ctx.load_checkpoint_state({"reference_swapped": dict(list(snapshot.items())[1:])}, "step-000000-000001")
