"""refl, draft and drtune against their authors' code, on random tensors and on the tiny SD3 model with the digit
reward's differentiable form.

ReFL: THUDM/ImageReward's ``ReFL.py`` training loop (the clean-sample prediction, the hinge, the step draw).
DRaFT-K: Google's code is not public; AlignProp's truncated backpropagation in TRL (``pipeline_step_with_grad``,
fixed truncation) is the same method (outputs of steps before T - K detached, gradient through the last K steps,
their inputs included) and is public, so it is the transcription. DRTune: no code is public; the test transcribes
the paper's algorithm (arXiv 2405.00760: input of the denoiser detached, K evenly spaced trained steps).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transcribed import Source, transcribes

from scoring.modules import DigitProbability
from trainer.algorithms.base import LossContext, Rewards
from trainer.algorithms.core_algos import predicted_clean, reward_loss
from trainer.algorithms.draft import DRaFT, DRaFTConfig
from trainer.algorithms.drtune import DRTune, DRTuneConfig
from trainer.algorithms.refl import ReFL, ReFLConfig
from trainer.distributed import SingleProcess
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
from trainer.rollout import SamplerSettings, rollout

REFL = Source("THUDM/ImageReward", "1beb4e4de0932acbe7fc090c51208048b6269b58", "ImageReward/ReFL.py", "Trainer.train")
ALIGNPROP = Source(
    "huggingface/trl", "bc13ae6d91667d42f5ad74e211b5db703dc4377e", "trl/models/modeling_sd_base.py",
    "pipeline_step_with_grad",
)  # fmt: skip
DRTUNE_PAPER = "no public code: transcribed from the paper's algorithm (arXiv 2405.00760, DRTune)"
PROMPTS = [f"a handwritten digit {d}" for d in (3, 7, 1, 8)]
SETTINGS = SamplerSettings(num_steps=6, noise_level=0.0)


# --- transcriptions -----------------------------------------------------------------------------------------------


def _refl_loss(rewards, grad_scale):
    """ImageReward@1beb4e4 `ReFL.py` `Trainer.train`: loss = F.relu(-rewards + 2); loss.mean() * args.grad_scale."""
    return F.relu(-rewards + 2).mean() * grad_scale


def _pred_original_sample(noise_pred, latents, alpha_prod_t):
    """The DDIMScheduler.step's pred_original_sample ReFL scores (epsilon prediction)."""
    beta_prod_t = 1 - alpha_prod_t
    return (latents - beta_prod_t**0.5 * noise_pred) / alpha_prod_t**0.5


def _alignprop_final_latents(adapter, net, x, cond, sigmas, truncated_backprop_timestep):
    """TRL@bc13ae6 `pipeline_step_with_grad`, fixed truncation, deterministic (eta 0) steps in flow form: every
    step's model output is detached while i < truncated_backprop_timestep; x carries gradient after that."""
    for i in range(len(sigmas) - 1):
        noise_pred = adapter.predict(net, x, sigmas[i].expand(len(x)), cond, 1.0)
        if i < truncated_backprop_timestep:
            noise_pred = noise_pred.detach()
        x = x + (sigmas[i + 1] - sigmas[i]) * noise_pred.float()
    return x


def _drtune_final_latents(adapter, net, x, cond, sigmas, train_steps):
    """DRTune's sampling loop: every step's denoiser input detached (sg(x_t)); outputs at ``train_steps`` [B, K]
    keep their gradient, the others are computed without; the update x + dt v carries it to the final latent."""
    for i in range(len(sigmas) - 1):
        trained = (train_steps == i).any(1).float().reshape(-1, *([1] * (x.ndim - 1)))
        v = adapter.predict(net, x.detach(), sigmas[i].expand(len(x)), cond, 1.0).float()
        v = trained * v + (1 - trained) * v.detach()
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


# --- the tiny model ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digit_reward():
    return DigitProbability()


def _setup(tiny_model_dir, algo_class, config, digit_reward):
    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    group_ids = torch.arange(len(PROMPTS))
    ro = rollout(adapter, adapter.denoiser, PROMPTS, group_ids, SETTINGS, torch.Generator().manual_seed(0))
    algo = algo_class(config)
    algo.setup(adapter, None, SingleProcess(torch.device("cpu")))
    algo.scorer = digit_reward
    served = digit_reward(ro.images, PROMPTS)
    batch = algo.make_batch(ro, Rewards(served, served, group_ids, 0))
    ctx = LossContext(adapter, adapter.denoiser, None)
    [[unit]] = algo.plan(batch, torch.Generator().manual_seed(1))
    return adapter, ro, algo, ctx, unit


def _grads(adapter, loss):
    params = [p for p in adapter.trainable.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def _assert_same_grads(ours, theirs):
    assert any(float(g.abs().sum()) > 0 for g in ours)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), float((a - b).abs().max())


@transcribes("algorithm:refl", source=REFL)
def test_refl_loss_and_clean_prediction_are_the_authors(tiny_model_dir, digit_reward):
    """The hinge equals theirs divided by grad_scale (docs/departures.md); the clean-sample prediction from an
    epsilon model's output is DDIM's pred_original_sample; on the tiny model the loss is the hinge of the reward
    of the decoded one-step prediction from each sample's drawn step, which lies in step_range inclusive as
    random.randint(30, 39) does."""
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(64, generator=gen) * 2
    assert torch.allclose(_refl_loss(rewards, 1e-3), reward_loss(rewards, "hinge", 2.0).mean() * 1e-3)
    x, eps, abar = torch.randn(5, 4, 8, 8, generator=gen), torch.randn(5, 4, 8, 8, generator=gen), torch.rand(5)
    eps_target = lambda x0, noise, a: (a.sqrt()[:, None] * x0 + (1 - a).sqrt()[:, None] * noise, noise)  # noqa: E731
    expected = _pred_original_sample(eps, x, abar.reshape(-1, 1, 1, 1))
    assert torch.allclose(predicted_clean(eps_target, x, eps, abar), expected, atol=1e-5)
    random.seed(0)
    assert {random.randint(30, 39) for _ in range(500)} == set(range(30, 40))
    refl = ReFL(ReFLConfig(step_range=(2, 4), sampler=SETTINGS))
    assert set(refl.draw_steps(500, 6, torch.Generator().manual_seed(0)).tolist()) == {2, 3, 4}

    adapter, ro, algo, ctx, unit = _setup(
        tiny_model_dir, ReFL, ReFLConfig(step_range=(2, 4), sampler=SETTINGS), digit_reward
    )
    loss, _ = algo.loss(ctx, unit)
    rows, steps = unit.rows, unit.steps
    x_m, sigma = ro.latents[rows, steps], ro.sigmas[steps]
    v = adapter.predict(adapter.denoiser, x_m, sigma, ro.cond.select(rows), 1.0).float()
    images = adapter.decode(x_m - sigma.reshape(-1, 1, 1, 1) * v)
    theirs = _refl_loss(digit_reward(images, [PROMPTS[i] for i in rows.tolist()]), 1.0) * unit.share
    assert torch.allclose(loss, theirs, atol=1e-6)
    _assert_same_grads(_grads(adapter, loss), _grads(adapter, theirs))


@transcribes("algorithm:draft", source=ALIGNPROP)
@pytest.mark.parametrize("k", [1, 3])
def test_draft_k_is_alignprops_truncated_backpropagation(tiny_model_dir, digit_reward, k):
    """DRaFT-K's loss and parameter gradients equal those of TRL's fixed truncation at T - K run from the same
    noise; before any update the redone steps reproduce the rollout, so the in-process reward equals the served."""
    adapter, ro, algo, ctx, unit = _setup(
        tiny_model_dir, DRaFT, DRaFTConfig(backprop_steps=k, sampler=SETTINGS), digit_reward
    )
    loss, stats = algo.loss(ctx, unit)
    rows = unit.rows
    x_final = _alignprop_final_latents(
        adapter, adapter.denoiser, ro.latents[rows, 0], ro.cond.select(rows), ro.sigmas, SETTINGS.num_steps - k
    )
    theirs = -digit_reward(adapter.decode(x_final), [PROMPTS[i] for i in rows.tolist()]).mean() * unit.share
    assert torch.allclose(loss, theirs, atol=1e-6)
    _assert_same_grads(_grads(adapter, loss), _grads(adapter, theirs))
    assert float(stats["served_gap"]) < 1e-5


@transcribes("algorithm:drtune", own=DRTUNE_PAPER)
def test_drtune_equals_the_papers_stop_gradient_loop(tiny_model_dir, digit_reward):
    """Our K-forward form (rollout latents, the trained steps' outputs added as zero-valued residuals) has the
    value and parameter gradients of the paper's full loop with every input detached; the trained steps are
    T // K apart from an offset in [0, T // K)."""
    config = DRTuneConfig(train_steps=2, sampler=SETTINGS)
    adapter, ro, algo, ctx, unit = _setup(tiny_model_dir, DRTune, config, digit_reward)
    steps = algo.draw_steps(300, 6, torch.Generator().manual_seed(0))
    assert set(steps[:, 0].tolist()) == {0, 1, 2} and torch.equal(steps[:, 1] - steps[:, 0], torch.full((300,), 3))
    loss, stats = algo.loss(ctx, unit)
    rows = unit.rows
    x_final = _drtune_final_latents(
        adapter, adapter.denoiser, ro.latents[rows, 0], ro.cond.select(rows), ro.sigmas, unit.steps
    )
    theirs = -digit_reward(adapter.decode(x_final), [PROMPTS[i] for i in rows.tolist()]).mean() * unit.share
    assert torch.allclose(loss, theirs, atol=1e-6)
    _assert_same_grads(_grads(adapter, loss), _grads(adapter, theirs))
    assert float(stats["served_gap"]) < 1e-5
