"""Parity of every sampler step with the authors' step function: the flow steps (sde, cps, cps_mse, eta), DDPO's
DDIM step and MixGRPO's DPM-Solver++(2M) ODE step, each transcribed below from the commit its ``Source`` names.

The same random x, v (or eps), noise levels and Gaussian noise go through ours and through the transcription;
prev_sample, log_prob, the step mean and the std the KL divides by must agree, or keep the exact relation
docs/departures.md states (cps: the Gaussian log-density where Flow-GRPO scores -mean((x - mean)^2)). Our
steps run on per-step constants with fused kernels (trainer/samplers/steps.py), so "agree" is float32 round-off.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from transcribed import Source, transcribes

from trainer.samplers import STEP_FUNCTIONS, flow_step
from trainer.samplers.ddim import ddim_step, ddim_step_with_logprob
from trainer.samplers.multistep import dpm_solver_2m_step

FLOW_GRPO = Source(
    "yifan123/flow_grpo",
    "54809b5fcf4d3930d2a17fa553928704bd0b719e",
    "flow_grpo/diffusers_patch/sd3_sde_with_logprob.py",
    "sde_step_with_logprob",
)
DANCE_GRPO = Source(
    "XueZeyue/DanceGRPO",
    "15cc71d53cc2e6e18a68ee607d5fb6ba9a99e344",
    "fastvideo/train_grpo_flux.py",
    "flux_step",
)
DDPO = Source(
    "kvablack/ddpo-pytorch",
    "1958463f020112c9a7bc85768d296daacc2e1b4b",
    "ddpo_pytorch/diffusers_patch/ddim_with_logprob.py",
    "ddim_step_with_logprob",
)
MIXGRPO = Source(
    "Tencent-Hunyuan/MixGRPO",
    "e5cdd6a427778d8c8b2e7a48ce16972141adbe7c",
    "fastvideo/utils/sampling_utils.py",
    "multistep_dpm_solver_second_order_update",
)

SHAPE = (4, 4, 8, 8)
STEPS = torch.tensor([0, 3, 6, 8])
"""One sample per step position: the first step (sigma = 1, where sigma_max stands in), two middle ones and the
last trained one (index T - 2 of T = 10)."""
TOL = {"rtol": 2e-5, "atol": 2e-5}
"""Float32 round-off of fused vs plain arithmetic; the log-density divides a difference of O(std) by std^2, so at
the steps with a std near 0.01 its round-off reaches about 1e-5."""


def _sd3_sigmas(num_steps: int = 10) -> torch.Tensor:
    """SD3's schedule (FlowMatchEulerDiscreteScheduler, shift 3), sigmas[0..T] with sigmas[T] = 0."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.float()


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, v, noise) of SHAPE, seeded; noise is what a generator seeded ``seed + 1`` draws first."""
    g = torch.Generator().manual_seed(seed)
    x, v = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    return x, v, torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed + 1))


def _flow_grpo_sde_step(v, x, sigmas, step_index, noise_level, prev_sample=None, noise=None, sde_type="sde"):
    """yifan123/flow_grpo@54809b5f flow_grpo/diffusers_patch/sd3_sde_with_logprob.py ``sde_step_with_logprob``,
    transcribed: the scheduler's sigma table and the per-sample step index stand in for ``self`` and
    ``index_for_timestep``, ``noise`` for ``randn_tensor`` (its draw on the generator's device). Returns
    (prev_sample, log_prob [B], prev_sample_mean, std_dev_t) as theirs does."""
    v, x = v.float(), x.float()
    view = (-1, *[1] * (x.ndim - 1))
    sigma, sigma_prev = sigmas[step_index].view(view), sigmas[step_index + 1].view(view)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        if prev_sample is None:
            prev_sample = mean + std_dev_t * torch.sqrt(-1 * dt) * noise
        scale = std_dev_t * torch.sqrt(-1 * dt)
        log_prob = (
            -((prev_sample.detach() - mean) ** 2) / (2 * scale**2)
            - torch.log(scale)
            - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
        )
    else:  # "cps"
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        x0, x1 = x - sigma * v, x + v * (1 - sigma)
        mean = x0 * (1 - sigma_prev) + x1 * torch.sqrt(sigma_prev**2 - std_dev_t**2)
        if prev_sample is None:
            prev_sample = mean + std_dev_t * noise
        log_prob = -((prev_sample.detach() - mean) ** 2)
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t


def _ours(kind: str, v, x, sigmas, noise_level, prev_sample=None, seed=None):
    """Our registered step function at STEPS (per-sample sigma, sigma_next; sigma_max = sigmas[1])."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return STEP_FUNCTIONS[kind](
        v, x, sigmas[STEPS], sigmas[STEPS + 1], noise_level, prev_sample, generator, sigma_max=sigmas[1]
    )


def _scheduled(kind: str, v, x, sigmas, noise_level, prev_sample=None, seed=None):
    """The same step as the trainer calls it: ``flow_step(kind, schedule)`` with per-sample step indices."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return flow_step(kind, sigmas)(v, x, STEPS, noise_level, prev_sample=prev_sample, generator=generator)


def _assert_step(ours, theirs, log_prob=True):
    """prev_sample, mean, std (ours [B, 1, ...], theirs broadcast alike) and, unless told not to, log_prob."""
    for name, a, b in zip(("prev_sample", "log_prob", "mean", "std"), ours, theirs, strict=True):
        if name != "log_prob" or log_prob:
            torch.testing.assert_close(a, b.expand_as(a), **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("call", [_ours, _scheduled], ids=["step_function", "scheduled"])
@transcribes("step:sde", source=FLOW_GRPO)
def test_sde_step_is_flow_grpos(call):
    """Drawn with the same noise and scored on a given x_next: every output equals Flow-GRPO's "sde" branch."""
    x, v, noise = _inputs()
    sigmas = _sd3_sigmas()
    theirs = _flow_grpo_sde_step(v, x, sigmas, STEPS, 0.7, noise=noise)
    _assert_step(call("sde", v, x, sigmas, 0.7, seed=1), theirs)
    scored_elsewhere = theirs[0] + 0.05 * torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    _assert_step(
        call("sde", v, x, sigmas, 0.7, prev_sample=scored_elsewhere),
        _flow_grpo_sde_step(v, x, sigmas, STEPS, 0.7, prev_sample=scored_elsewhere),
    )


@pytest.mark.parametrize("call", [_ours, _scheduled], ids=["step_function", "scheduled"])
@transcribes("step:cps", source=FLOW_GRPO)
def test_cps_step_is_flow_grpos_with_the_gaussian_log_density(call):
    """The CPS sample, mean and std are Flow-GRPO's; its log-probability, -mean((x - mean)^2), is ours times
    2 std^2 up to the Gaussian's normaliser: ours = theirs / (2 std^2) - log std - log sqrt(2 pi) (the departure
    docs/departures.md states; ``cps_mse`` is theirs)."""
    x, v, noise = _inputs()
    sigmas = _sd3_sigmas()
    theirs = _flow_grpo_sde_step(v, x, sigmas, STEPS, 0.8, noise=noise, sde_type="cps")
    ours = call("cps", v, x, sigmas, 0.8, seed=1)
    _assert_step(ours, theirs, log_prob=False)
    std = theirs[3].reshape(-1)
    gaussian = theirs[1] / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(ours[1], gaussian, **TOL)
    log_ratio_ours = call("cps", v * 1.2, x, sigmas, 0.8, prev_sample=ours[0])[1] - ours[1]
    log_ratio_theirs = _flow_grpo_sde_step(v * 1.2, x, sigmas, STEPS, 0.8, theirs[0], sde_type="cps")[1] - theirs[1]
    torch.testing.assert_close(log_ratio_theirs, 2 * std**2 * log_ratio_ours, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("call", [_ours, _scheduled], ids=["step_function", "scheduled"])
@transcribes("step:cps_mse", source=FLOW_GRPO)
def test_cps_mse_step_is_flow_grpos_cps_branch(call):
    """``cps_mse`` is Flow-GRPO's "cps" branch in every output, its -mean((x - mean)^2) log-probability included."""
    x, v, noise = _inputs()
    sigmas = _sd3_sigmas()
    _assert_step(
        call("cps_mse", v, x, sigmas, 0.8, seed=1),
        _flow_grpo_sde_step(v, x, sigmas, STEPS, 0.8, noise=noise, sde_type="cps"),
    )


def _dance_grpo_flux_step(v, x, eta, sigmas, index, prev_sample=None, noise=None):
    """XueZeyue/DanceGRPO@15cc71d5 fastvideo/train_grpo_flux.py ``flux_step`` with grpo=True, sde_solver=True,
    transcribed for one sample (theirs takes one step index for the batch); ``noise`` stands in for
    ``torch.randn_like``. Returns (prev_sample, log_prob [1], prev_sample_mean): theirs returns the predicted x0 in
    the mean's place; the mean is what its log-probability is centred on."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    mean = x + dsigma * v
    x0 = x - sigma * v
    std_dev_t = eta * math.sqrt(sigma - sigmas[index + 1])
    score = -(x - x0 * (1 - sigma)) / sigma**2
    mean = mean + (-0.5 * eta**2 * score) * dsigma
    if prev_sample is None:
        prev_sample = mean + noise * std_dev_t
    log_prob = (
        -((prev_sample.detach().float() - mean.float()) ** 2) / (2 * std_dev_t**2)
        - math.log(std_dev_t)
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean


@pytest.mark.parametrize("call", [_ours, _scheduled], ids=["step_function", "scheduled"])
@transcribes("step:eta", source=DANCE_GRPO)
def test_eta_step_is_dance_grpos_flux_step(call):
    """prev_sample, log_prob and mean equal DanceGRPO's SDE step; the std the KL divides by is eta (the step's
    std over sqrt(-dt), as ``sde`` returns std_dev_t)."""
    x, v, noise = _inputs()
    sigmas = _sd3_sigmas()
    eta = 0.3
    rows = [
        _dance_grpo_flux_step(v[i : i + 1], x[i : i + 1], eta, sigmas, int(STEPS[i]), noise=noise[i : i + 1])
        for i in range(len(STEPS))
    ]
    prev, log_prob, mean = (torch.cat(parts) for parts in zip(*rows, strict=True))
    _assert_step(call("eta", v, x, sigmas, eta, seed=1), (prev, log_prob, mean, torch.tensor(eta).view(1, 1, 1, 1)))
    scored = call("eta", v * 0.9, x, sigmas, eta, prev_sample=prev)[1]
    theirs = torch.cat(
        [
            _dance_grpo_flux_step(v[i : i + 1] * 0.9, x[i : i + 1], eta, sigmas, int(STEPS[i]), prev[i : i + 1])[1]
            for i in range(len(STEPS))
        ]
    )
    torch.testing.assert_close(scored, theirs, **TOL)


@pytest.mark.parametrize("kind", sorted(STEP_FUNCTIONS))
def test_noise_level_zero_is_the_euler_step(kind):
    """At noise level 0 every flow step is the deterministic Euler step x + v (sigma_next - sigma), to float32
    round-off (the fused multiply-add of our mean rounds once where x + v dt rounds twice)."""
    x, v, _ = _inputs()
    sigmas = _sd3_sigmas()
    euler = x + v * (sigmas[STEPS + 1] - sigmas[STEPS]).view(-1, 1, 1, 1)
    for call in (_ours, _scheduled):
        prev_sample, log_prob, _, std = call(kind, v, x, sigmas, 0.0, seed=1)
        torch.testing.assert_close(prev_sample, euler, rtol=0, atol=1e-6)
        assert not std.any() and not log_prob.any()  # no density: scored 0, never trained


def _sd15_ddim(set_alpha_to_one: bool = False, num_steps: int = 10) -> DDIMScheduler:
    """SD1.5's DDIM scheduler (scaled-linear betas, leading spacing, steps_offset 1)."""
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=set_alpha_to_one,
        steps_offset=1,
    )
    scheduler.set_timesteps(num_steps)
    return scheduler


def _ddpo_ddim_step(scheduler, eps, timestep, x, eta, prev_sample=None, noise=None):
    """kvablack/ddpo-pytorch@1958463f ddpo_pytorch/diffusers_patch/ddim_with_logprob.py ``ddim_step_with_logprob``
    (epsilon prediction, no clipping or thresholding, as SD1.5 configures it), transcribed; ``noise`` stands in
    for ``randn_tensor``. Note its clamp of prev_timestep to [0, N - 1] before the ``>= 0`` test: the end of the
    chain then reads alphas_cumprod[0], never ``final_alpha_cumprod``. Returns (prev_sample, log_prob, mean, std)."""
    n = scheduler.config.num_train_timesteps
    prev_timestep = torch.clamp(timestep - n // scheduler.num_inference_steps, 0, n - 1)
    view = (-1, *[1] * (x.ndim - 1))
    alpha_t = scheduler.alphas_cumprod.gather(0, timestep).view(view)
    alpha_prev = torch.where(
        prev_timestep >= 0, scheduler.alphas_cumprod.gather(0, prev_timestep), scheduler.final_alpha_cumprod
    ).view(view)
    beta_t = 1 - alpha_t
    x0 = (x - beta_t ** (0.5) * eps) / alpha_t ** (0.5)
    variance = ((1 - alpha_prev) / beta_t) * (1 - alpha_t / alpha_prev)
    std_dev_t = eta * variance ** (0.5)
    mean = alpha_prev ** (0.5) * x0 + (1 - alpha_prev - std_dev_t**2) ** (0.5) * eps
    if prev_sample is None:
        prev_sample = mean + std_dev_t * noise
    log_prob = (
        -((prev_sample.detach() - mean) ** 2) / (2 * (std_dev_t**2))
        - torch.log(std_dev_t)
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t


DDIM_STEPS = torch.tensor([0, 4, 8, 9])
"""Per-sample DDIM step indices of T = 10, the last (t_prev < 0: the end of the chain) included."""


@pytest.mark.parametrize("eta", [1.0, 0.5])
@transcribes("step:ddim", source=DDPO)
def test_ddim_step_is_ddpos_for_sd15(eta):
    """SD1.5's scheduler (set_alpha_to_one false: final_alpha_cumprod = alphas_cumprod[0], which DDPO's clamp also
    reads): every output equals DDPO's at every step, the last one included, through both of our entry points."""
    scheduler = _sd15_ddim()
    x, eps, noise = _inputs()
    t = scheduler.timesteps[DDIM_STEPS]
    theirs = _ddpo_ddim_step(scheduler, eps, t, x, eta, noise=noise)
    t_prev = t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    direct = ddim_step_with_logprob(
        eps,
        x,
        t,
        t_prev,
        eta,
        generator=torch.Generator().manual_seed(1),
        alphas_cumprod=scheduler.alphas_cumprod,
        final_alpha_cumprod=scheduler.final_alpha_cumprod,
    )
    bound = ddim_step(
        torch.cat([scheduler.timesteps, torch.tensor([-1])]).float(),
        scheduler.alphas_cumprod,
        scheduler.final_alpha_cumprod,
    )
    scheduled = bound(eps, x, DDIM_STEPS, eta, generator=torch.Generator().manual_seed(1))
    _assert_step(direct, theirs)
    _assert_step(scheduled, theirs)
    torch.testing.assert_close(
        bound(eps * 0.9, x, DDIM_STEPS, eta, prev_sample=theirs[0])[1],
        _ddpo_ddim_step(scheduler, eps * 0.9, t, x, eta, prev_sample=theirs[0])[1],
        **TOL,
    )


def test_ddim_last_step_with_a_final_alpha_of_one_departs_from_ddpo():
    """With set_alpha_to_one (final_alpha_cumprod = 1), the step into the end of the chain departs: diffusers'
    DDIMScheduler and ours step to abar = 1, DDPO (its clamp) to alphas_cumprod[0]; every earlier step is equal."""
    scheduler = _sd15_ddim(set_alpha_to_one=True)
    x, eps, noise = _inputs()
    t = scheduler.timesteps[DDIM_STEPS]
    theirs = _ddpo_ddim_step(scheduler, eps, t, x, 1.0, noise=noise)
    t_prev = t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    ours = ddim_step_with_logprob(
        eps,
        x,
        t,
        t_prev,
        1.0,
        generator=torch.Generator().manual_seed(1),
        alphas_cumprod=scheduler.alphas_cumprod,
        final_alpha_cumprod=scheduler.final_alpha_cumprod,
    )
    _assert_step([o[:3] for o in ours], [o[:3] for o in theirs])  # samples 0-2: the steps before the end
    assert float(ours[3][3]) == 0.0 and float(theirs[3][3]) > 0  # abar_prev = 1: no noise in our last step
    alpha_t = scheduler.alphas_cumprod[t[3]]
    x0 = (x[3] - (1 - alpha_t) ** 0.5 * eps[3]) / alpha_t**0.5
    torch.testing.assert_close(ours[2][3], x0, **TOL)  # its mean: the x0 prediction, as DDIMScheduler.step's
    torch.testing.assert_close(ours[2][3:], scheduler.step(eps[3:], t[3], x[3:], eta=0.0).prev_sample, **TOL)


def _mixgrpo_dpm_2m_update(m0, m1, sigmas, step_index, x):
    """Tencent-Hunyuan/MixGRPO@e5cdd6a4 fastvideo/utils/sampling_utils.py
    ``multistep_dpm_solver_second_order_update`` with dpm_algorithm_type "dpmsolver++", dpm_solver_type "midpoint",
    sde_solver False (the ODE steps after the SDE window), transcribed; m0, m1 are the data predictions x - sigma v
    at this step and the one before (``DPMState.model_outputs``)."""
    alpha = lambda s: 1 - s  # noqa: E731  (``_sigma_to_alpha_sigma_t``)
    sigma_t, sigma_s0, sigma_s1 = sigmas[step_index + 1], sigmas[step_index], sigmas[step_index - 1]
    lam = lambda s: torch.log(alpha(s)) - torch.log(s)  # noqa: E731
    h, h_0 = lam(sigma_t) - lam(sigma_s0), lam(sigma_s0) - lam(sigma_s1)
    r0 = h_0 / h
    d0, d1 = m0, (1.0 / r0) * (m0 - m1)
    return (
        (sigma_t / sigma_s0) * x
        - (alpha(sigma_t) * (torch.exp(-h) - 1.0)) * d0
        - 0.5 * (alpha(sigma_t) * (torch.exp(-h) - 1.0)) * d1
    )


def _mixgrpo_first_order_update(x0, sigmas, step_index, x):
    """The same file's ``dpm_solver_first_order_update`` (dpmsolver++, no noise), which MixGRPO takes at the final
    step (``lower_order_final``) and before any data prediction is stored."""
    sigma_t, sigma_s = sigmas[step_index + 1], sigmas[step_index]
    h = (torch.log(1 - sigma_t) - torch.log(sigma_t)) - (torch.log(1 - sigma_s) - torch.log(sigma_s))
    return (sigma_t / sigma_s) * x - ((1 - sigma_t) * (torch.exp(-h) - 1.0)) * x0


@transcribes("step:dpm_solver_2m", source=MIXGRPO)
def test_dpm_solver_2m_step_is_mixgrpos_ode_update():
    """At every second-order position of SD3's 10-step schedule (sigma_prev < 1, sigma_next > 0) our step equals
    MixGRPO's DPM-Solver++(2M) midpoint update; without a previous data prediction it is MixGRPO's first-order
    update, which is the Euler step; at the final step (sigma_next = 0) MixGRPO's ``lower_order_final`` takes the
    first-order update, which reaches the data prediction x - sigma v, as our Euler step does."""
    x, v, _ = _inputs()
    prev_x0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    sigmas = _sd3_sigmas().double()
    x64, v64, prev64 = x.double(), v.double(), prev_x0.double()
    for i in range(2, len(sigmas) - 2):
        ours = dpm_solver_2m_step(v, x, prev_x0, float(sigmas[i - 1]), float(sigmas[i]), float(sigmas[i + 1]))
        theirs = _mixgrpo_dpm_2m_update(x64 - sigmas[i] * v64, prev64, sigmas, i, x64)
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"step {i}: {m}")
        first = dpm_solver_2m_step(v, x, None, float(sigmas[i - 1]), float(sigmas[i]), float(sigmas[i + 1]))
        torch.testing.assert_close(
            first,
            _mixgrpo_first_order_update(x64 - sigmas[i] * v64, sigmas, i, x64).float(),
            rtol=1e-5,
            atol=1e-5,
        )
    last = len(sigmas) - 2
    final = dpm_solver_2m_step(v, x, prev_x0, float(sigmas[last - 1]), float(sigmas[last]), 0.0)
    theirs_final = _mixgrpo_first_order_update(x64 - sigmas[last] * v64, sigmas, last, x64)
    torch.testing.assert_close(final, theirs_final.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, (x - float(sigmas[last]) * v), rtol=1e-5, atol=1e-5)  # the data prediction
