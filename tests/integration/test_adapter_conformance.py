"""One conformance suite over every registered ModelAdapter, on tiny random models loaded from disk.

Each adapter's model is built by tests/tiny_models (random weights, local tokenizers), saved with
``save_pretrained`` and loaded back through the adapter's own ``config.path`` code. Per adapter:
  (a) a rollout at noise level 0 equals the adapter's diffusers pipeline (same components, seed, steps,
      guidance) to ``PARITY_ATOL`` (bit-exact in practice except Qwen-Image, whose batched CFG pads text);
  (b) log-probs re-evaluated with the step function equal the rollout's: the on-policy ratio is exactly 1;
  (c) one GRPO step (KL on) and one SFT step change the trainable parameters and nothing else, with LoRA
      (base frozen) and with full fine-tuning;
  (d) save_trainable -> load_trainable into a fresh adapter reproduces the predictions exactly;
  (e) wrong or missing image inputs raise ValueErrors that name the input, and another model's weights at
      ``model.path`` one that names the fix;
  (f) rollouts sampled in chunks concatenate and stay on-policy, and neither a rollout's steps nor a GRPO
      unit reads a value back from the device.
Image-conditioned pipelines sample the VAE posterior of their conditioning images where the adapters take
its mean (deterministic conditioning); ``testing.run_pipeline`` replaces that draw by the mean, the only
difference.

The IP-Adapter configurations ``flux+ip``, ``flux_fill+ip`` and ``qwen_image+ip`` (``model.ip_adapter`` set
and trainable, random weights loaded from a file, one style image per batch) run through the same suite;
for them mode "full" is the IP-Adapter alone on a frozen base. diffusers has no IP-Adapter for Qwen-Image
and its FluxFillPipeline takes none, so (a) covers ``flux+ip`` only.

The variants that a tiny spec declares (``TinySpec.variants``: other inputs, or another checkpoint the adapter
loads) run through the same suite as cases of their own, with no registry name: ``wan_i2v+last`` (a tiny Wan 2.1
FLF2V) and ``wan22_i2v+last`` take a first and a last frame, as ``WanImageToVideoPipeline(image=, last_image=)``.

Each adapter's tiny model and test facts (guidance, image inputs, how its pipeline is called) come from its
family's module in tests/tiny_models by registry name (``testing.tiny(name)``, a ``TinySpec``): a registered
adapter with a tiny model is picked up here with nothing to add.

Tests whose result depends on the weights dtype (parity tolerances, on-policy numerics, float32 outputs and
masters, normalisation before the cast) run per target (device, weights dtype): the CPU in float32, bfloat16
and float16 by default, and CUDA in bfloat16 on a GPU machine (``pytest -m gpu``). Structural checks (input
validation, step kinds, save/load round trips, device reads) run once per device (``@per_device``).
Generators live on the target device, as a trainer's rollout generator does. In bfloat16 the pipelines round
their latents to bfloat16 after every step where the rollouts keep float32 latents, so parity there is held to
``Target.parity_atol`` instead of 1e-5.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import math
import os
import re
import shutil
import types
from pathlib import Path
from typing import NamedTuple

import pytest
import tiny_models as testing
import torch
from peft.tuners.lora import LoraLayer
from tiny_models import TINY_NAMES, tiny, tiny_config, tiny_ip_adapter
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.algorithms.base import LossContext, Rewards
from trainer.algorithms.dpo import DPO, DPOConfig
from trainer.algorithms.grpo import GRPO, GRPOConfig
from trainer.algorithms.sft import SFT, SFTBatch, SFTConfig
from trainer.kernels import KernelCounter
from trainer.models import MODELS, build_adapter
from trainer.models.base import ImageInputs, ModelAdapter
from trainer.models.common import DTYPES, LoraSettings
from trainer.models.compiling import CompileMonitor, compile_denoiser, repeated_blocks
from trainer.models.ip_adapter import IP_WEIGHTS
from trainer.models.trainable import LinearInInputDtype
from trainer.rollout import Rollout, SamplerSettings, rollout
from trainer.samplers import standard_normal

NAMES = sorted(MODELS)
IP_CASES = {f"{name}+ip": name for name in NAMES if name in TINY_NAMES and tiny(name).ip_adapter}
"""IP-Adapter configurations: case -> adapter name."""
VARIANT_CASES = [case for name in NAMES if name in TINY_NAMES for case in testing.variant_cases(name)]
"""The variants the tiny specs declare (``TinySpec.variants``): ``wan_i2v+last``, a first and a last frame."""
CASES = NAMES + sorted(IP_CASES) + VARIANT_CASES
PARITY_CASES = [c for c in CASES if c not in IP_CASES or tiny(IP_CASES[c]).ip_pipeline]
PROMPTS = ["a photo of a cat", "the digit five"]
NUM_STEPS = 3


def guidance(adapter) -> float:
    """The adapter's test guidance: CFG scale (batched CFG) or guidance embedding (FLUX family)."""
    return tiny(adapter.config.name).guidance


class Target(NamedTuple):
    """Where and in which weights dtype the suite runs."""

    device: str
    dtype: str
    parity_atol: float
    """Largest |rollout - pipeline| of any entry of the final latents at noise level 0, per unit of their
    largest magnitude where that is above 1 (SD1.5's reach 13: 1.09e-5 was seen in float32 on an AVX2 CPU)."""
    parity_rtol: float
    """Largest ||rollout - pipeline|| / ||pipeline|| over the final latents (bfloat16: about 2^-8 per
    rounding; measured 0.3-1.1% on the tiny models, SD1.5's DDIM the largest; float16: 0.04-0.14%, max abs
    0.002-0.018)."""

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed)


CPU_FP32 = pytest.param(Target("cpu", "float32", 1e-5, 1e-6), id="cpu-fp32")
CUDA_BF16 = pytest.param(Target("cuda", "bfloat16", 0.25, 0.02), id="cuda-bf16", marks=pytest.mark.gpu)
TARGETS = [
    CPU_FP32,
    pytest.param(Target("cpu", "bfloat16", 0.25, 0.02), id="cpu-bf16"),
    pytest.param(Target("cpu", "float16", 0.04, 0.003), id="cpu-fp16"),
    CUDA_BF16,
]
per_device = pytest.mark.parametrize("target", [CPU_FP32, CUDA_BF16])
"""For checks whose result does not depend on the weights dtype: one target per device instead of the matrix."""
without_fp16 = pytest.mark.parametrize("target", [t for t in TARGETS if t.id != "cpu-fp16"])
"""For training checks where float16 weights would repeat bfloat16's case (a half-precision frozen base beside
float32 trainable weights); the parity, float32-training and dtype checks keep float16."""


@pytest.fixture(params=TARGETS)
def target(request) -> Target:
    return request.param


def test_every_registered_adapter_has_a_tiny_model():
    assert sorted(TINY_NAMES) == NAMES


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


def ip_weights(case: str, root) -> str:
    """A file of random IP-Adapter weights for ``case``'s model, written once under ``root``."""
    directory = root / f"{case}-weights"
    if not (directory / IP_WEIGHTS).is_file():
        adapter = build_adapter(
            tiny_config(IP_CASES[case], root, dtype="float32", ip_adapter=tiny_ip_adapter(root)), "cpu"
        )
        testing.randomize_ip_adapter(adapter, seed=7)
        adapter.ip_adapter.save(str(directory))
    return str(directory)


def make_adapter(case: str, root, target: Target, **overrides):
    """The adapter of ``case`` (a registered name or an IP-Adapter case) on its tiny model, on ``target``."""
    if case in IP_CASES:
        overrides = {"ip_adapter": tiny_ip_adapter(root, weights=ip_weights(case, root)), **overrides}
    config = tiny_config(IP_CASES.get(case, case), root, **{"dtype": target.dtype, **overrides})
    adapter = build_adapter(config, target.device)
    adapter.pipeline.set_progress_bar_config(disable=True)
    return adapter


@pytest.fixture(scope="module")
def shared_adapters() -> dict[str, object]:
    return {}


@pytest.fixture
def adapter(case, model_root, shared_adapters, target):
    """The LoRA-free adapter of ``case`` on ``target``, shared by the read-only tests."""
    key = (case, target)
    if key not in shared_adapters:
        shared_adapters[key] = make_adapter(case, model_root, target)
    return shared_adapters[key]


def image_inputs(adapter, case: str, seed: int = 0, batch_size: int = len(PROMPTS)) -> ImageInputs | None:
    """Random image inputs of ``case`` (an IP-Adapter case's are its adapter's, a style image added)."""
    return testing.image_inputs(adapter, batch_size, seed, case=IP_CASES.get(case, case))


def settings(adapter, noise_level: float) -> SamplerSettings:
    kind = "ddim" if adapter.sampler_kind == "ddim" else "sde"
    return SamplerSettings(num_steps=NUM_STEPS, guidance_scale=guidance(adapter), kind=kind, noise_level=noise_level)


# --- (a) parity with diffusers ------------------------------------------------------------------------
@pytest.mark.parametrize("case", PARITY_CASES)
def test_rollout_at_noise_zero_equals_pipeline(adapter, case, target):
    inputs = image_inputs(adapter, case)
    ro = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS,
        torch.arange(len(PROMPTS)),
        settings(adapter, 0.0),
        target.generator(0),
        inputs,
    )
    expected = testing.run_pipeline(adapter, PROMPTS, inputs, NUM_STEPS, guidance(adapter), target.generator(0))
    assert ro.latents.device.type == target.device
    got, expected = ro.latents[:, -1], expected.float().reshape(ro.latents[:, -1].shape)
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(got, expected, rtol=0, atol=target.parity_atol * scale)
    assert float((got - expected).norm() / expected.norm()) <= target.parity_rtol
    assert ro.images.shape[0] == len(PROMPTS) and 0 <= float(ro.images.min()) <= float(ro.images.max()) <= 1


def with_scheduler_config(path: str, dest: Path, **changes) -> str:
    """A copy of the model directory ``path`` whose scheduler_config.json has ``changes`` applied."""
    shutil.copytree(path, dest)
    scheduler = dest / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), **changes}))
    return str(dest)


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
def test_ddim_rollout_at_noise_zero_equals_pipeline_with_any_timestep_spacing(spacing, model_root, tmp_path):
    """The DDIM step goes from t to t - N // T, as the scheduler's step does, not to the next timestep: the
    two differ unless the spacing is "leading" (SD1.5's, which the suite's model uses). The masked-image
    latents differ from the pipeline's by an ulp, which the x0 estimate at t = 999 (trailing and linspace
    spacing start there) multiplies by 1 / sqrt(abar_999), about 15: hence 1e-4."""
    config = tiny_config("sd15_inpaint", model_root, dtype="float32")
    path = with_scheduler_config(config.path, tmp_path / "sd15", timestep_spacing=spacing)
    target = Target("cpu", "float32", 1e-4, 1e-5)
    adapter = build_adapter(dataclasses.replace(config, path=path), "cpu")
    adapter.pipeline.set_progress_bar_config(disable=True)
    inputs = image_inputs(adapter, "sd15_inpaint")
    ro = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS,
        torch.arange(len(PROMPTS)),
        settings(adapter, 0.0),
        target.generator(0),
        inputs,
    )
    expected = testing.run_pipeline(adapter, PROMPTS, inputs, NUM_STEPS, guidance(adapter), target.generator(0))
    torch.testing.assert_close(ro.latents[:, -1], expected.float(), rtol=0, atol=target.parity_atol)


def test_sd3_rollout_at_noise_zero_equals_pipeline_with_dynamic_shifting(model_root, tmp_path):
    """A scheduler with ``use_dynamic_shifting`` needs mu, which the pipeline computes from the image's token
    count (SD3.5-style configs)."""
    config = tiny_config("sd3", model_root, dtype="float32")
    path = with_scheduler_config(config.path, tmp_path / "sd3", use_dynamic_shifting=True)
    target = Target("cpu", "float32", 1e-5, 1e-6)
    adapter = build_adapter(dataclasses.replace(config, path=path), "cpu")
    adapter.pipeline.set_progress_bar_config(disable=True)
    ro = rollout(
        adapter, adapter.denoiser, PROMPTS, torch.arange(len(PROMPTS)), settings(adapter, 0.0), target.generator(0)
    )
    expected = testing.run_pipeline(adapter, PROMPTS, None, NUM_STEPS, guidance(adapter), target.generator(0))
    torch.testing.assert_close(ro.latents[:, -1], expected.float(), rtol=0, atol=target.parity_atol)
    assert not torch.equal(ro.sigmas, make_adapter("sd3", model_root, target).sigmas(NUM_STEPS))


# --- (b) on-policy ratio ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_on_policy_ratio_is_exactly_one(adapter, case, target):
    ro = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS,
        torch.arange(len(PROMPTS)),
        settings(adapter, 1.0),
        target.generator(1),
        image_inputs(adapter, case),
    )
    step = adapter.step_function(ro.kind, ro.sigmas)
    batch = len(PROMPTS)
    with torch.no_grad():
        for i in ro.trainable_steps().tolist():
            sigma = ro.sigmas[i].expand(batch)
            out = adapter.predict(adapter.denoiser, ro.latents[:, i], sigma, ro.cond, ro.guidance_scale)
            _, log_prob, _, _ = step(
                out, ro.latents[:, i], torch.full((batch,), i), ro.noise_level, prev_sample=ro.latents[:, i + 1]
            )
            assert torch.equal(torch.exp(log_prob - ro.log_probs[:, i]), torch.ones(batch, device=log_prob.device))


@pytest.mark.parametrize("case", NAMES)
@per_device
def test_compiled_blocks_are_the_repeated_blocks(adapter, target):
    """model.compile=blocks finds each adapter's repeated blocks with no declaration: every block FSDP shards
    (``shard_units``) is one of them, inside one or holds some (a UNet's down block); none is inside another. A deep
    copy (a frozen reference)
    calls its own blocks. Cheap: nothing is compiled until called (the slow tier runs them)."""
    blocks = repeated_blocks(adapter.denoiser)
    inside = {id(m) for b in blocks for m in b.modules()}
    units = [m for m in adapter.denoiser.modules() if isinstance(m, adapter.shard_units)]
    assert blocks and units and all(any(id(m) in inside for m in u.modules()) for u in units)
    assert len(inside) == sum(len(list(b.modules())) for b in blocks), "a block inside another"
    net = copy.deepcopy(adapter.denoiser)
    compiled = compile_denoiser(net, "blocks")
    assert [type(b) for b in compiled] == [type(b) for b in blocks]
    twin = copy.deepcopy(net)
    pairs = list(zip(repeated_blocks(net), repeated_blocks(twin), strict=True))
    assert all(a.forward.__func__ is b.forward.__func__ and b.forward.__self__ is b for a, b in pairs)


COMPILE_CASES = CASES if os.environ.get("RF_COMPILE_MATRIX") else ["sd3"]
"""Inductor compiles for minutes on 2 cores: the slow tier compiles SD3's blocks; RF_COMPILE_MATRIX=1 every case
(IP-Adapter ones included; bench/RESULTS.md has the measured |ratio - 1| of each)."""


COMPILED_BF16_RATIO_ATOL = 1e-2
"""bfloat16 on CUDA: the no-grad and the training graphs may fuse and round differently (bench/RESULTS_GPU.md);
a spec's ``compiled_ratio_atol_bf16`` may widen it. Training is exact regardless: while the weights are the
rollout's, log p_old is the training forward's own (``policy_gradient.step_loss``)."""


def deviation_bound(case: str, target) -> float:
    spec = tiny(IP_CASES.get(case, case))
    return (
        spec.compiled_ratio_atol
        if target.dtype == "float32"
        else max(COMPILED_BF16_RATIO_ATOL, spec.compiled_ratio_atol_bf16)
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", COMPILE_CASES)
@pytest.mark.parametrize("backend", ["inductor"])
@per_device
def test_on_policy_ratio_with_compiled_blocks(case, backend, model_root, target):
    """model.compile=blocks: a rollout (no grad, eval mode) and the training re-evaluation (grad, train mode)
    run the same compiled blocks with LoRA on, and the reference forward the LoRA-disabled variant; the
    on-policy ratio stays 1 to float32 round-off (max and mean |ratio - 1| printed: bench/RESULTS.md; 0 where
    measured, except sd15_inpaint's static-shape UNet blocks, whose two graphs round differently: 1.7e-6)."""
    torch.manual_seed(0)
    adapter = make_adapter(case, model_root, target, lora=LoraSettings(rank=4, alpha=4))
    with torch.no_grad():
        for name_, p in adapter.denoiser.named_parameters():
            if "lora_B" in name_:
                p.copy_(0.2 * standard_normal(p.shape, target.generator(8), p.device))
    monitor = CompileMonitor(16)
    blocks = compile_denoiser(adapter.denoiser, "blocks", getattr(adapter, "compiled_blocks", ()), 16, backend)
    assert blocks and all(isinstance(b.forward, types.MethodType) and b.forward.__self__ is b for b in blocks)
    adapter.denoiser.eval()
    ro = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS,
        torch.zeros(2, dtype=torch.long),
        settings(adapter, 1.0),
        target.generator(1),
        image_inputs(adapter, case),
    )
    step = adapter.step_function(ro.kind, ro.sigmas)
    adapter.denoiser.train()
    deviations = []
    for i in ro.trainable_steps().tolist():
        out = adapter.predict(adapter.denoiser, ro.latents[:, i], ro.sigmas[i].expand(2), ro.cond, ro.guidance_scale)
        _, log_prob, _, _ = step(
            out, ro.latents[:, i], torch.full((2,), i), ro.noise_level, prev_sample=ro.latents[:, i + 1]
        )
        deviations.append((torch.exp(log_prob - ro.log_probs[:, i]) - 1).abs().detach())
    algorithm = GRPO(GRPOConfig(group_size=2, sampler=settings(adapter, 1.0), kl_beta=0.04))
    rewards = torch.tensor([0.0, 1.0])
    batch = algorithm.make_batch(ro, Rewards(rewards, rewards, torch.zeros(2, dtype=torch.long), 0))
    ctx = LossContext(adapter, adapter.denoiser, adapter.trainable.reference())
    for units in algorithm.plan(batch, torch.Generator().manual_seed(0)):
        for unit in units:
            loss, stats = algorithm.loss(ctx, unit)
            loss.backward()
            assert torch.isfinite(loss) and float(stats["kl"]) > 0  # the reference: LoRA off, compiled too
            assert float(stats["ratio"]) == 1.0 and float(stats["logp_gap"]) <= deviation_bound(case, target)
    deviation = torch.cat(deviations)
    report = monitor.report()
    print(
        f"\n{case} {backend} {target.device}-{target.dtype}: |ratio - 1| max {float(deviation.max()):.3g} "
        f"mean {float(deviation.mean()):.3g}; "
        f"{report}"
    )
    assert float(deviation.max()) <= deviation_bound(case, target)
    assert report["compile_fallbacks"] == 0  # graphs may be 0: blocks of a class an earlier case compiled
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.trainable.parameters())


# --- (c) training steps touch only the trainable parameters ------------------------------------------
def _snapshot(adapter) -> dict[str, torch.Tensor]:
    modules = {"denoiser": adapter.denoiser, "vae": adapter.vae, "text": adapter.pipeline.text_encoder}
    return {
        f"{m}.{k}": v.detach().clone()
        for m, module in modules.items()
        if module is not None
        for k, v in module.state_dict().items()
    }


def _check_only_trainable_changed(adapter, before: dict[str, torch.Tensor]) -> None:
    trainable = {f"denoiser.{k}" for k, p in adapter.denoiser.named_parameters() if p.requires_grad}
    after = _snapshot(adapter)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the step changed no parameter"
    assert changed <= trainable, f"frozen parameters changed: {sorted(changed - trainable)[:5]}"


def _train_step(adapter, losses) -> None:
    """SGD at lr 1 on gradients clipped to norm 1: big enough to show in bf16 weights, bounded so that fp16
    activations stay finite afterwards (the SFT loss's gradient can reach a norm of ~15 here)."""
    params = list(adapter.trainable.parameters())
    optimizer = torch.optim.SGD(params, lr=1.0)
    optimizer.zero_grad()
    for loss in losses:
        loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()


@pytest.mark.parametrize(("name", "mode"), list(itertools.product(CASES, ("lora", "full"))))
@without_fp16
def test_grpo_sft_and_dpo_steps_change_only_trainable_parameters(name, mode, model_root, target):
    lora = LoraSettings(rank=4, alpha=4) if mode == "lora" else None
    adapter = make_adapter(name, model_root, target, lora=lora)
    inputs = image_inputs(adapter, name)
    prompts = [PROMPTS[0]] * 2
    ro = rollout(
        adapter,
        adapter.denoiser,
        prompts,
        torch.zeros(2, dtype=torch.long),
        settings(adapter, 1.0),
        target.generator(2),
        inputs,
    )
    algorithm = GRPO(GRPOConfig(group_size=2, kl_beta=0.1, sampler=settings(adapter, 1.0)))
    rewards = torch.tensor([0.0, 1.0])
    batch = algorithm.make_batch(ro, Rewards(rewards, rewards, torch.zeros(2, dtype=torch.long), 0))
    ctx = LossContext(adapter, adapter.denoiser, adapter.trainable.reference())
    (units,) = algorithm.plan(batch, torch.Generator().manual_seed(0))

    before = _snapshot(adapter)
    results = [algorithm.loss(ctx, unit) for unit in units]
    for _, stats in results:
        assert float(stats["ratio"]) == 1.0 and float(stats["logp_gap"]) <= 1e-6  # the rollout's log p agrees
        assert float(stats["kl"]) == 0.0  # policy == reference before the first update
    _train_step(adapter, [loss for loss, _ in results])
    _check_only_trainable_changed(adapter, before)

    before = _snapshot(adapter)
    x0 = adapter.encode_images(torch.rand(2, *ro.images.shape[1:], generator=torch.Generator().manual_seed(3)))
    sft_batch = SFTBatch(
        x0,
        standard_normal(x0.shape, target.generator(4), x0.device),
        torch.tensor([0.3, 0.8], device=x0.device),
        adapter.encode_prompts(prompts, inputs),
    )
    sft = SFT(SFTConfig())
    (units,) = sft.plan(sft_batch, torch.Generator().manual_seed(5))
    loss = sum(sft.loss(LossContext(adapter, adapter.denoiser, None), unit)[0] for unit in units)
    _train_step(adapter, [loss])
    _check_only_trainable_changed(adapter, before)

    # online DPO on the rollout's pair (sample 1 preferred), against the policy before this step
    before = _snapshot(adapter)
    dpo = DPO(DPOConfig(group_size=2, noise_draws=1, sampler=settings(adapter, 1.0)))
    dpo_ctx = LossContext(adapter, adapter.denoiser, None)
    dpo.start_epoch(dpo_ctx, 0)  # the reference becomes a frozen snapshot of the current policy
    dpo_batch = dpo.make_batch(ro, Rewards(rewards, rewards, torch.zeros(2, dtype=torch.long), 0))
    assert dpo_batch.pairs.tolist() == [[1, 0]]
    (dpo_units,) = dpo.plan(dpo_batch, torch.Generator().manual_seed(5))
    dpo_results = [dpo.loss(dpo_ctx, unit) for unit in dpo_units]
    for loss, _ in dpo_results:  # policy == reference: -log sigmoid(0)
        torch.testing.assert_close(loss.cpu(), torch.tensor(math.log(2.0)), rtol=0, atol=1e-6)
    _train_step(adapter, [loss for loss, _ in dpo_results])
    _check_only_trainable_changed(adapter, before)


def kept_in_float32(denoiser) -> set[str]:
    """Names of the parameters that diffusers loads in float32 whatever the dtype (a model class's
    ``_keep_in_fp32_modules``: Wan's norms and time embedding)."""
    kept = set()
    for prefix, module in denoiser.named_modules():
        for keep in getattr(module, "_keep_in_fp32_modules", None) or ():
            kept |= {f"{prefix}.{n}".lstrip(".") for n, _ in module.named_parameters() if keep in n.split(".")}
    return kept


@pytest.mark.parametrize("name", CASES)
def test_lora_and_ip_weights_train_in_float32(name, model_root, target):
    """LoRA (and a trainable IP-Adapter) keep float32 weights over a base in the target dtype, so that one
    AdamW step at lr 1e-4 moves every weight whose gradient exceeds 1e-6: in bf16 weights such steps round away
    (86% of LoRA's A unchanged after 3 steps) and in fp16 Adam's eps underflows (every weight NaN)."""
    torch.manual_seed(0)  # LoRA's initial weights
    adapter = make_adapter(name, model_root, target, lora=LoraSettings(rank=4, alpha=4))
    trainable = [p for p in adapter.denoiser.parameters() if p.requires_grad]
    assert {p.dtype for p in trainable} == {torch.float32}
    kept = kept_in_float32(adapter.denoiser)
    frozen = [p for n, p in adapter.denoiser.named_parameters() if not p.requires_grad and n not in kept]
    assert {p.dtype for p in frozen} == {DTYPES[target.dtype]}
    with torch.no_grad():  # B = 0 would leave A without a gradient
        for name_, p in adapter.denoiser.named_parameters():
            if "lora_B" in name_:
                p.copy_(0.02 * standard_normal(p.shape, target.generator(8), p.device))
    prompts = [PROMPTS[0]] * 2
    ro = rollout(
        adapter,
        adapter.denoiser,
        prompts,
        torch.zeros(2, dtype=torch.long),
        settings(adapter, 1.0),
        target.generator(2),
        image_inputs(adapter, name),
    )
    algorithm = GRPO(GRPOConfig(group_size=2, sampler=settings(adapter, 1.0)))
    rewards = torch.tensor([0.0, 1.0])
    batch = algorithm.make_batch(ro, Rewards(rewards, rewards, torch.zeros(2, dtype=torch.long), 0))
    ctx = LossContext(adapter, adapter.denoiser, None)
    before = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    for units in algorithm.plan(batch, torch.Generator().manual_seed(0)):
        for unit in units:
            algorithm.loss(ctx, unit)[0].backward()
    # Adam's first step moves a weight by lr g / (|g| + 1e-8): about lr where |g| > 1e-6
    graded = [p.grad.abs() > 1e-6 if p.grad is not None else torch.zeros_like(p, dtype=torch.bool) for p in trainable]
    assert sum(bool(g.any()) for g in graded) >= len(trainable) // 2, "most trainable weights got no gradient"
    optimizer.step()
    for p, b, g in zip(trainable, before, graded, strict=True):
        assert torch.isfinite(p).all()
        moved = p.ne(b)[g]
        assert moved.all(), f"{float(moved.float().mean()):.4%} of the weights with a gradient moved"


@pytest.mark.parametrize("name", CASES)
def test_gradient_checkpointing_computes_the_forward_the_rollout_computes(name, model_root):
    """A training forward with gradient checkpointing (gradients on) predicts exactly what the rollout's forward
    (no gradients: no checkpointing) predicts, and its backward reaches the trained weights (of both of Wan 2.2's
    experts: its rows are at two noise levels). diffusers' Chroma
    leaves the attention mask out of its checkpointed single-stream blocks (0.056 apart on the tiny model)."""
    torch.manual_seed(0)
    adapter = make_adapter(
        name, model_root, CPU_FP32.values[0], lora=LoraSettings(rank=4, alpha=4), gradient_checkpointing=True
    )
    with torch.no_grad():
        for name_, p in adapter.denoiser.named_parameters():
            if "lora_B" in name_:  # B = 0 would leave LoRA out of both forwards
                p.normal_(0, 0.02)
    cond = adapter.encode_prompts(PROMPTS, image_inputs(adapter, name))
    x = adapter.prepare_latents(len(PROMPTS), torch.Generator().manual_seed(3))
    sigma = adapter.sigmas(NUM_STEPS)[:2]  # rows at two noise levels: a denoiser that routes by them runs all
    adapter.denoiser.train()  # as the trainer's updates run it
    with torch.no_grad():
        rolled = adapter.predict(adapter.denoiser, x, sigma, cond, guidance(adapter))
    trained = adapter.predict(adapter.denoiser, x, sigma, cond, guidance(adapter))
    assert trained.requires_grad and torch.equal(trained, rolled)
    trained.square().mean().backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in adapter.denoiser.parameters() if p.requires_grad
    )


class FloatMatmuls(TorchDispatchMode):
    """Counts the matrix products with a float32 operand."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution"):
            self.count += any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args)
        return func(*args, **(kwargs or {}))


def _float32_lora_compute(denoiser, on: bool) -> None:
    """Switch LoRA layers back to peft's own float32 compute (input cast to float32) or to the model dtype."""
    for layer in denoiser.modules():
        if isinstance(layer, LoraLayer):
            layer.cast_input_dtype_enabled = on
            for linear in (*layer.lora_A.values(), *layer.lora_B.values()):
                linear.__class__ = torch.nn.Linear if on else LinearInInputDtype


@pytest.mark.parametrize("target", [TARGETS[1], CUDA_BF16])
@pytest.mark.parametrize("name", ["sd3", "flux+ip"])
def test_lora_and_ip_layers_compute_in_the_model_dtype(name, model_root, target):
    """LoRA and IP-Adapter layers keep float32 weights and gradients but add no float32 matmul to a bf16
    forward and backward (peft's float32 LoRA compute adds some), and predict what float32 LoRA compute
    predicts to bf16 tolerance. LoRA is peft's, the same in every adapter: two cases (one with an IP-Adapter)."""
    torch.manual_seed(0)
    adapter = make_adapter(name, model_root, target, lora=LoraSettings(rank=4, alpha=4))
    with torch.no_grad():
        for name_, p in adapter.denoiser.named_parameters():
            if "lora_B" in name_:
                p.copy_(0.2 * standard_normal(p.shape, target.generator(8), p.device))
    cond = adapter.encode_prompts(PROMPTS, image_inputs(adapter, name))
    x = adapter.prepare_latents(len(PROMPTS), target.generator(1)).requires_grad_()  # a backward with LoRA off
    sigma = torch.full((len(PROMPTS),), 0.6, device=x.device)
    counts, outs = {}, {}
    for mode in ("off", "float32", "model dtype"):
        adapter.denoiser.disable_adapters() if mode == "off" else adapter.denoiser.enable_adapters()
        _float32_lora_compute(adapter.denoiser, mode == "float32")
        with FloatMatmuls() as matmuls:
            outs[mode] = adapter.predict(adapter.denoiser, x, sigma, cond, guidance(adapter))
            outs[mode].square().mean().backward()
        counts[mode] = matmuls.count
    assert counts["float32"] > counts["off"], "the float32 LoRA path should show float32 matmuls"
    assert counts["model dtype"] == counts["off"], f"LoRA added {counts['model dtype'] - counts['off']} float32 matmuls"
    assert {p.grad.dtype for p in adapter.trainable.parameters() if p.grad is not None} == {torch.float32}
    new, old, base = (outs[m].detach().float() for m in ("model dtype", "float32", "off"))
    assert (old - base).norm() > 0.02 * base.norm(), "LoRA should change the prediction"  # sd3 on CUDA: 4.6%
    assert (new - old).norm() <= 0.01 * base.norm()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_attention_auto_probes_the_cuda_kernels_and_sets_a_passing_one(name, model_root):
    """model.attention=auto on CUDA: each candidate kernel's forward+backward of the blocks, checked against math
    (cuDNN's backward gave NaN gradients for FLUX with torch 2.11: it must pass the check or be rejected), and
    the fastest passing one set for the process (math for the calls it cannot take)."""
    from trainer.models.attention import CUDA_CANDIDATES, attention_for_run, use_attention

    adapter = build_adapter(tiny_config(name, model_root, dtype="bfloat16"), "cuda")
    try:
        choice = attention_for_run(
            adapter, "auto", adapter.encode_prompts(PROMPTS[:1], image_inputs(adapter, name)), settings(adapter, 1.0)
        )
        print(f"\n{name}: {choice.summary()}")
        assert [v.kernel for v in choice.verdicts] == list(CUDA_CANDIDATES)
        verdicts = {v.kernel: v for v in choice.verdicts}
        assert verdicts[choice.kernel].passed and verdicts["math"].passed
        assert choice.kernel == min((v for v in choice.verdicts if v.passed), key=lambda v: v.seconds).kernel
        enabled = {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": True,
        }
        assert {k for k, on in enabled.items() if on} == {choice.kernel, "math"}
        assert torch.backends.cuda.math_sdp_enabled()
    finally:
        use_attention("auto")


# --- (d) save / load round trip -----------------------------------------------------------------------
@per_device
@pytest.mark.parametrize(("name", "mode"), list(itertools.product(CASES, ("lora", "full"))))
def test_save_load_trainable_round_trip(name, mode, model_root, tmp_path, target):
    lora = LoraSettings(rank=4, alpha=4) if mode == "lora" else None
    trained = make_adapter(name, model_root, target, lora=lora)
    with torch.no_grad():
        g = target.generator(5)
        for p in trained.trainable.parameters():
            p.add_(0.05 * standard_normal(p.shape, g, p.device).to(p.dtype))
    trained.trainable.save(str(tmp_path / "ckpt"))
    fresh = make_adapter(name, model_root, target, lora=lora)

    cond = trained.encode_prompts(PROMPTS, image_inputs(trained, name))
    x = trained.prepare_latents(len(PROMPTS), target.generator(6))
    sigma = trained.sigmas(NUM_STEPS)[1].expand(len(PROMPTS))
    scale = guidance(trained)
    with torch.no_grad():
        expected = trained.predict(trained.denoiser, x, sigma, cond, scale)
        assert not torch.equal(fresh.predict(fresh.denoiser, x, sigma, cond, scale), expected)
        fresh.trainable.load(str(tmp_path / "ckpt"))
        assert torch.equal(fresh.predict(fresh.denoiser, x, sigma, cond, scale), expected)


# --- (e) conditioning validation ----------------------------------------------------------------------
@per_device
@pytest.mark.parametrize("case", CASES)
def test_image_inputs_are_validated(adapter, case):
    side = getattr(adapter, "resolution", 16)
    good = image_inputs(adapter, case)
    if getattr(adapter, "ip_adapter", None) is not None:
        with pytest.raises(ValueError, match=r"ImageInputs\.style .*model\.ip_adapter"):
            adapter.encode_prompts(PROMPTS, dataclasses.replace(good, style=None))
        with pytest.raises(ValueError, match=r"ImageInputs\.style"):
            adapter.encode_prompts(PROMPTS, dataclasses.replace(good, style=good.style[:1]))
        with pytest.raises(ValueError, match=r"ImageInputs\.reference"):
            adapter.encode_prompts(PROMPTS, dataclasses.replace(good, reference=good.style))
        return
    if good is None and "image" in tiny(case).optional_inputs:  # an optional first frame, checked
        frame = testing.image_inputs(adapter, len(PROMPTS), optional=True, case=case).image
        with pytest.raises(ValueError, match=r"ImageInputs\.image is .* pixels"):
            adapter.encode_prompts(PROMPTS, ImageInputs(image=frame[..., :-8, :]))
        with pytest.raises(ValueError, match=r"ImageInputs\.mask"):
            adapter.encode_prompts(PROMPTS, ImageInputs(image=frame, mask=frame[:, :1]))
        return
    if good is None:
        with pytest.raises(ValueError, match="image"):
            adapter.encode_prompts(PROMPTS, ImageInputs(image=torch.rand(2, 3, side, side)))
        return
    with pytest.raises(ValueError, match="ImageInputs"):
        adapter.encode_prompts(PROMPTS)
    with pytest.raises(ValueError, match="ImageInputs.style"):
        adapter.encode_prompts(PROMPTS, dataclasses.replace(good, style=torch.rand(2, 3, side, side)))
    if good.reference is not None:
        with pytest.raises(ValueError, match="ImageInputs.reference"):
            adapter.encode_prompts(PROMPTS, ImageInputs(reference=torch.rand(2, 1, side, side)))
        with pytest.raises(ValueError, match="ImageInputs.reference"):
            adapter.encode_prompts(PROMPTS, ImageInputs(reference=good.reference[:1]))
        return
    if good.last_image is not None:  # a video's last frame: at the first frame's size, one per prompt, after it
        for last in (good.last_image[..., :-2, :-2], good.last_image[:1]):
            with pytest.raises(ValueError, match=r"ImageInputs\.last_image"):
                adapter.encode_prompts(PROMPTS, dataclasses.replace(good, last_image=last))
        with pytest.raises(ValueError, match=r"ImageInputs\.last_image needs ImageInputs\.image"):
            adapter.encode_prompts(PROMPTS, ImageInputs(last_image=good.last_image))
    if good.mask is None:  # an image alone (a video's first frame), with its last frame where it has one
        with pytest.raises(ValueError, match="ImageInputs.image"):
            adapter.encode_prompts(PROMPTS, dataclasses.replace(good, image=good.image[..., :-2, :-2]))
        with pytest.raises(ValueError, match="ImageInputs.image"):
            adapter.encode_prompts(PROMPTS, dataclasses.replace(good, image=good.image[:1]))
        return
    with pytest.raises(ValueError, match="ImageInputs.mask"):
        adapter.encode_prompts(PROMPTS, ImageInputs(image=good.image))
    with pytest.raises(ValueError, match="ImageInputs.image"):
        adapter.encode_prompts(PROMPTS, ImageInputs(image=good.image[..., :-2, :-2], mask=good.mask))
    with pytest.raises(ValueError, match="ImageInputs.mask"):
        adapter.encode_prompts(PROMPTS, ImageInputs(image=good.image, mask=good.mask[:1]))


def same_shapes(name: str, other: str) -> bool:
    """Whether either adapter declares that it loads the other's weights (``TinySpec.same_shapes``): FLUX.1-dev
    and Kontext, which only training tells apart, and the tiny model, an SD3."""
    return other in tiny(name).same_shapes or name in tiny(other).same_shapes


def without_denoiser_weights(path: str, dest: Path) -> str:
    """A copy of the model directory ``path`` whose denoiser has its config but no weights: an adapter that
    refuses it must do so before it loads them (a minute for FLUX.1's 12 B parameters)."""

    def ignore(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n.endswith(".safetensors")] if Path(folder).name in ("transformer", "unet") else []

    shutil.copytree(path, dest, ignore=ignore)
    return str(dest)


@pytest.mark.parametrize("name", NAMES)
def test_another_models_directory_is_refused(name, model_root, tmp_path):
    """``model.path`` at the weights of any other registered model: a ValueError naming the directory and the fix,
    not diffusers' complaint about one weight's shape (or a crash at the first forward), raised before the
    denoiser's weights are read."""
    config = tiny_config(name, model_root)
    for other in NAMES:
        if other == name or same_shapes(name, other):
            continue
        path = without_denoiser_weights(tiny_config(other, model_root).path, tmp_path / other)
        with pytest.raises(ValueError, match=rf"model\.path={re.escape(repr(path))} .* point model\.path at"):
            build_adapter(dataclasses.replace(config, path=path), "cpu")


# The embedded models (tiny, tiny_wan) build themselves where they are absent.
@pytest.mark.parametrize("name", [name for name in NAMES if tiny(name).build is None])
def test_a_hub_id_as_model_path_says_how_to_download_it(name, model_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no such folder here
    config = dataclasses.replace(tiny_config(name, model_root), path="some-org/some-model")
    with pytest.raises(
        ValueError,
        match=r"model\.path='some-org/some-model' is not a diffusers .*; 'some-org/some-model' "
        r"reads as a Hugging Face Hub id, and the trainer reads local folders only: "
        r"`hf download some-org/some-model --local-dir DIR`, then model\.path=DIR$",
    ):
        build_adapter(config, "cpu")


def test_an_sd3_resolution_past_its_position_table_is_refused_as_it_loads(model_root):
    """It failed at the first forward (after the warm-up, in the evaluation before RL) with diffusers' "Height
    (256) cannot be greater than pos_embed_max_size"; the tiny SD3's table holds 96 patches a side."""
    config = tiny_config("sd3", model_root, dtype="float32")
    build_adapter(dataclasses.replace(config, resolution=96), "cpu")
    with pytest.raises(
        ValueError,
        match=r"model\.resolution=104 needs 104 patches a side, .* reach 96: at most "
        r"model\.resolution=96",
    ):
        build_adapter(dataclasses.replace(config, resolution=104), "cpu")


def test_flux_and_kontext_directories_are_told_apart_by_their_pipeline(model_root, caplog):
    """FLUX.1-dev and Kontext weights have the same shapes (either adapter loads the other's): the pipeline
    class in model_index.json is what differs, and a mismatch is a warning that names the other adapter."""
    for name, other in (("flux", "flux_kontext"), ("flux_kontext", "flux")):
        config = dataclasses.replace(tiny_config(name, model_root), path=tiny_config(other, model_root).path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trainer.models"):
            build_adapter(config, "cpu")
        assert f"and model.name={name} runs it as a" in caplog.text
        assert f"set model.name={other} if these are its weights" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.models"):
        build_adapter(tiny_config("flux", model_root), "cpu")
        build_adapter(
            dataclasses.replace(tiny_config("sd3", model_root), path=tiny_config("tiny", model_root).path), "cpu"
        )  # the tiny model is an SD3 saved by SD3's pipeline
    assert "model_index.json" not in caplog.text


def test_a_text_to_image_unet_is_refused_by_the_inpainting_adapter(model_root, tmp_path):
    """An SD1.5 text-to-image UNet (4 input channels, the same class as the inpainting one) at sd15_inpaint's
    ``model.path``."""
    config = tiny_config("sd15_inpaint", model_root)
    path = without_denoiser_weights(config.path, tmp_path / "sd15")
    unet = Path(path) / "unet" / "config.json"
    unet.write_text(json.dumps({**json.loads(unet.read_text()), "in_channels": 4}))
    with pytest.raises(ValueError, match=r"4-channel UNet.*point model\.path at an SD1\.5 inpainting checkpoint"):
        build_adapter(dataclasses.replace(config, path=path), "cpu")


@per_device
@pytest.mark.parametrize("case", CASES)
def test_every_adapter_has_every_member_of_the_protocol(adapter):
    """The loop reads adapters through ``ModelAdapter`` alone (no getattr probes): every member it lists is there."""
    members = [m for m in dir(ModelAdapter) if not m.startswith("_")] + list(ModelAdapter.__annotations__)
    assert [m for m in sorted(set(members)) if not hasattr(adapter, m)] == []
    assert isinstance(adapter, ModelAdapter)


@per_device
@pytest.mark.parametrize("case", CASES)
def test_step_kind_is_checked(adapter):
    other = "sde" if adapter.sampler_kind == "ddim" else "ddim"
    with pytest.raises(ValueError, match="sampler.kind"):
        adapter.step_function(other, adapter.sigmas(NUM_STEPS))


@pytest.mark.parametrize("case", CASES)
def test_predictions_are_float32_whatever_the_weights(adapter, case, target):
    assert adapter.denoiser.dtype == getattr(torch, target.dtype)
    cond = adapter.encode_prompts(PROMPTS, image_inputs(adapter, case))
    x = adapter.prepare_latents(len(PROMPTS), target.generator(0))
    with torch.no_grad():
        out = adapter.predict(adapter.denoiser, x, adapter.sigmas(NUM_STEPS)[:1].expand(2), cond, guidance(adapter))
    assert out.dtype == torch.float32 and out.shape == x.shape and torch.isfinite(out).all()


# --- (f) rollouts in chunks; no reads of device values on the hot path --------------------------------
@pytest.mark.parametrize("case", CASES)
def test_rollout_chunks_concatenate_and_stay_on_policy(adapter, case, target):
    """The trainer samples a batch in chunks (``train.rollout_chunks``) and trains on their concatenation.
    Qwen-Image pads each chunk's text to that chunk's longest prompt, so the chunks' conditioning must pad
    to a common length, and the log-probs re-evaluated on the whole must stay the chunks' own (``logp_gap``)
    up to the rounding that the padding mask's attention path changes."""
    sampler = settings(adapter, 1.0)
    parts = [
        rollout(
            adapter,
            adapter.denoiser,
            [prompt],
            torch.zeros(1, dtype=torch.long),
            sampler,
            target.generator(10 + i),
            image_inputs(adapter, case, seed=i, batch_size=1),
        )
        for i, prompt in enumerate(PROMPTS)
    ]
    ro = Rollout.cat(parts)
    lengths = {k: {p.cond.embeds[k].shape[1] for p in parts} for k in ro.cond.ragged}
    if ro.cond.ragged:
        assert all(len(v) == 2 for v in lengths.values()), "the test prompts should have different lengths"
        assert ro.cond.padded and not any(p.cond.padded for p in parts)
    algorithm = GRPO(GRPOConfig(group_size=2, sampler=sampler))
    rewards = torch.tensor([0.0, 1.0])
    batch = algorithm.make_batch(ro, Rewards(rewards, rewards, torch.zeros(2, dtype=torch.long), 0))
    ctx = LossContext(adapter, adapter.denoiser, None)
    with torch.no_grad():
        gaps = [
            stats["logp_gap"]
            for unit in algorithm.plan(batch, torch.Generator().manual_seed(0))[0]
            for _, stats in [algorithm.loss(ctx, unit)]
        ]
    # float32: a few ulps of the log-probs (max |log p| 1.4-5.5 here; the largest gap seen 1.07e-6, SD1.5's)
    tolerance = 2e-6 * max(1.0, float(ro.log_probs.abs().max())) if target.dtype == "float32" else 1e-4
    assert float(torch.stack(gaps).max()) <= tolerance


@per_device
@pytest.mark.parametrize("case", CASES)
def test_rollout_steps_and_train_units_read_no_device_values(adapter, case, target):
    """A read of a device value (``bool``, ``float`` or ``.item()`` of a tensor) makes the host wait for the
    device to catch up, every time it runs: none in a rollout once its prompts are encoded, none in a GRPO
    unit's forward and backward (KL on). On the CPU the count takes in host tensors as well, a stricter check."""
    sampler = settings(adapter, 1.0)
    inputs = image_inputs(adapter, case)
    ro = rollout(adapter, adapter.denoiser, PROMPTS, torch.arange(2), sampler, target.generator(3), inputs)
    with KernelCounter() as sampling, forwards_of(adapter.denoiser) as sampling_forwards:
        rollout(adapter, adapter.denoiser, PROMPTS, torch.arange(2), sampler, target.generator(3), inputs)
    algorithm = GRPO(GRPOConfig(group_size=2, kl_beta=0.1, sampler=sampler))
    rewards = torch.tensor([0.0, 1.0])
    batch = algorithm.make_batch(ro, Rewards(rewards, rewards, torch.zeros(2, dtype=torch.long), 0))
    unit = algorithm.plan(batch, torch.Generator().manual_seed(0))[0][0]
    ctx = LossContext(adapter, adapter.denoiser, adapter.trainable.reference())
    try:
        with KernelCounter() as training, forwards_of(adapter.denoiser) as training_forwards:
            algorithm.loss(ctx, unit)[0].backward()
    finally:
        adapter.denoiser.zero_grad(set_to_none=True)
    assert sampling.kernels > 0 and training.kernels > 0
    reads = tiny(adapter.config.name).device_reads_per_forward  # those its pipeline makes too (Wan 2.2's routing)
    assert sampling.ops["_local_scalar_dense"] == reads * len(sampling_forwards)
    assert training.ops["_local_scalar_dense"] == reads * len(training_forwards)


@contextlib.contextmanager
def forwards_of(denoiser):
    """The calls of modules of ``denoiser``'s class (the policy's and a frozen copy's) while in the block."""
    calls: list[str] = []

    def count(module, args):
        if type(module) is type(denoiser):
            calls.append(type(module).__name__)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        yield calls
    finally:
        handle.remove()


# --- (g) image encoding -------------------------------------------------------------------------------
def recorded_vae_inputs(adapter, monkeypatch) -> list[torch.Tensor]:
    """The inputs of every ``adapter.vae.encode`` call from now on."""
    seen: list[torch.Tensor] = []
    encode = adapter.vae.encode
    monkeypatch.setattr(
        adapter.vae, "encode", lambda x, *args, **kwargs: (seen.append(x), encode(x, *args, **kwargs))[1]
    )
    return seen


@pytest.mark.parametrize("case", NAMES)
def test_encode_images_is_deterministic_and_normalises_in_float32(adapter, target, monkeypatch):
    """Supervised targets are the VAE posterior's mean (a draw from the global RNG would make them random and
    a resumed run drift), of pixels mapped to [-1, 1] in float32 and cast once, as the pipelines do (in
    bfloat16, mapping after the cast rounds twice). An RGBA VAE (Qwen-Image 2.1's) reads them opaque."""
    shape = adapter.decode(adapter.prepare_latents(1, target.generator(0))).shape[1:]
    images = torch.rand(2, *shape, generator=torch.Generator().manual_seed(0))
    seen = recorded_vae_inputs(adapter, monkeypatch) if adapter.vae is not None else []
    torch.manual_seed(0)
    first = adapter.encode_images(images)
    assert torch.equal(adapter.encode_images(images), first)
    expected = (images.to(target.device) * 2 - 1).to(adapter.dtype)
    if adapter.modality == "video":  # frames [B, F, C, H, W]; a video VAE takes [B, C, F, H, W]
        expected = expected.transpose(1, 2)
    if adapter.vae is None:
        assert not seen
        return
    # one VAE forward per call, or per clip where the VAE takes one at a time (HunyuanVideo 1.5's)
    assert len(seen) in (2, 2 * len(images))
    for call in (seen[: len(seen) // 2], seen[len(seen) // 2 :]):
        x = torch.cat(call)
        if adapter.modality == "image":  # [B, C (+ alpha), (1,) H, W]
            x, alpha = x.reshape(len(images), -1, *shape[1:]).split([shape[0], x.shape[1] - shape[0]], dim=1)
            assert torch.equal(alpha, torch.ones_like(alpha))
        assert torch.equal(x.reshape(expected.shape), expected)


@pytest.mark.parametrize("case", ["flux_kontext"])
def test_kontext_reference_is_normalised_in_float32(adapter, case, target, monkeypatch):
    inputs = image_inputs(adapter, case)
    seen = recorded_vae_inputs(adapter, monkeypatch)
    adapter.encode_prompts(PROMPTS, inputs)
    expected = (inputs.reference.to(target.device) * 2 - 1).to(adapter.dtype)
    assert torch.equal(torch.cat(seen), expected)
