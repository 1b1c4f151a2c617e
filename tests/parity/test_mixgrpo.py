"""MixGRPO against its authors' code (Tencent-Hunyuan/MixGRPO): the sliding SDE window's schedule
(``GRPOTrainingStates``), the group advantages of ``train_one_step`` and MixGRPO-Flash's DPM-Solver++(2M) steps
after the window, with its compressed schedule (``run_sample_step``'s "post" strategy)."""

from __future__ import annotations

import pytest
import torch
from transcribed import Source, transcribes

from trainer.algorithms.base import Rewards
from trainer.algorithms.mixgrpo import MixGRPO, MixGRPOConfig
from trainer.rollout import SamplerSettings, window_mask
from trainer.samplers.multistep import compress_after_window, dpm_solver_2m_step, second_order_steps

REPO, COMMIT = "Tencent-Hunyuan/MixGRPO", "e5cdd6a427778d8c8b2e7a48ce16972141adbe7c"
STATES = Source(REPO, COMMIT, "fastvideo/utils/grpo_states.py", "GRPOTrainingStates.update_iteration")
ADVANTAGES = Source(REPO, COMMIT, "fastvideo/train_grpo_flux.py", "train_one_step")
DPM_2M = Source(REPO, COMMIT, "fastvideo/utils/sampling_utils.py", "multistep_dpm_solver_second_order_update")
POST = Source(REPO, COMMIT, "fastvideo/utils/sampling_utils.py", "run_sample_step")


class _ProgressiveStates:
    """Tencent-Hunyuan/MixGRPO@e5cdd6a4 fastvideo/utils/grpo_states.py GRPOTrainingStates, its "progressive"
    strategy: ``timesteps()`` is get_current_timesteps, ``update()`` update_iteration; main() makes it with
    max_timesteps = sampling_steps - 2 and calls both once per training iteration."""

    def __init__(self, iters_per_group, group_size, max_timesteps, prog_overlap, prog_overlap_step, roll_back):
        self.iters_per_group, self.group_size, self.max_timesteps = iters_per_group, group_size, max_timesteps
        self.prog_overlap, self.prog_overlap_step, self.roll_back = prog_overlap, prog_overlap_step, roll_back
        self.cur_timestep = self.cur_iter_in_group = self.init_timestep = 0

    def update(self):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters_per_group:
            self.cur_iter_in_group = 0
            self.cur_timestep += self.prog_overlap_step if self.prog_overlap else self.group_size
        if self.cur_timestep > self.max_timesteps:
            if self.roll_back:
                self.cur_timestep, self.cur_iter_in_group = self.init_timestep, 0
            else:
                self.cur_timestep = self.max_timesteps

    def timesteps(self):
        return list(range(self.cur_timestep, min(self.cur_timestep + self.group_size, self.max_timesteps)))


@pytest.mark.parametrize(
    ("steps", "size", "overlap", "every", "roll_back"),
    [
        (25, 4, 1, 25, True),  # their FLUX recipe (scripts/finetune/finetune_flux_grpo_MixGRPO.sh)
        (10, 3, 1, 2, True),
        (10, 3, 2, 1, True),
        (9, 3, None, 3, True),
        (12, 2, 3, 1, True),
        (10, 3, 1, 2, False),
        (11, 4, 3, 1, False),
    ],
)
@transcribes("algorithm:mixgrpo", source=STATES)
def test_sde_window_schedule_is_the_authors_progressive_one(steps, size, overlap, every, roll_back):
    """Epoch by epoch our SDE window is the steps their iteration trains (and samples with SDE): it moves by the
    overlap step (or by its size without prog_overlap, ``overlap`` None) every ``every`` iterations, shrinks
    before step T - 2 and rolls back. Where their start reaches T - 2 its window is empty: with roll_back we skip
    those iterations, without it we keep the last non-empty window (docs/departures.md)."""
    states = _ProgressiveStates(every, size, steps - 2, overlap is not None, overlap or 1, roll_back)
    config = MixGRPOConfig(
        sampler=SamplerSettings(num_steps=steps, sde_window=size),
        shift_every=every,
        stride=overlap or size,
        wrap=roll_back,
    )
    algorithm = MixGRPO(config)
    theirs, last = [], None
    for _ in range(3 * steps * every):
        window = states.timesteps()
        states.update()
        if window:
            last = window
        elif roll_back:
            continue
        theirs.append([i in last for i in range(steps)])
    assert all(any(w) for w in theirs)
    for epoch, expected in enumerate(theirs):
        algorithm.start_epoch(None, epoch)
        assert window_mask(algorithm.sampler, torch.Generator()).tolist() == expected, epoch


def _mixgrpo_advantages(rewards, num_generations):
    """Tencent-Hunyuan/MixGRPO@e5cdd6a4 fastvideo/train_grpo_flux.py train_one_step: use_group, reward_aggr,
    trimmed_ratio 0 (each prompt's num_generations samples are consecutive); the loss then clamps them to
    [-adv_clip_max, adv_clip_max]."""
    advantages = torch.zeros_like(rewards)
    for i in range(len(rewards) // num_generations):
        group = rewards[i * num_generations : (i + 1) * num_generations]
        advantages[i * num_generations : (i + 1) * num_generations] = (group - group.mean()) / (group.std() + 1e-8)
    return advantages


@transcribes("algorithm:mixgrpo", source=ADVANTAGES)
def test_advantages_are_the_authors_per_group_unbiased_std_ones():
    """With global_std=false and unbiased_std=true (their recipe's) our advantages are theirs, clamped to
    [-5, 5] as their loss clamps them, up to the std's epsilon: ours 1e-4, theirs 1e-8 (docs/departures.md).
    One group has no spread (advantage 0 in both); one is scaled so that its clamp binds."""
    g = torch.Generator().manual_seed(0)
    group_size, num_groups = 12, 5
    rewards = torch.rand(num_groups * group_size, generator=g, dtype=torch.float64).float()
    rewards[:group_size] = 0.5
    rewards[group_size : 2 * group_size] = torch.tensor([0.0] * 11 + [1.0])  # A = 11 / sqrt(12) ~ 3.2 ... 3.3
    group_ids = torch.arange(num_groups).repeat_interleave(group_size)
    config = MixGRPOConfig(group_size=group_size, global_std=False, unbiased_std=True, adv_clip=3.0)
    ours = MixGRPO(config).advantages(Rewards(rewards, rewards, group_ids, 0))
    theirs = _mixgrpo_advantages(rewards, group_size)
    std = rewards.reshape(num_groups, group_size).std(dim=1).repeat_interleave(group_size)
    torch.testing.assert_close(ours, (theirs * (std + 1e-8) / (std + 1e-4)).clamp(-3.0, 3.0))
    assert bool((ours[:group_size] == 0).all()) and float(ours.abs().max()) == 3.0


def _alpha_sigma(sigma):
    """sampling_utils.py ``_sigma_to_alpha_sigma_t``: alpha = 1 - sigma."""
    return 1 - sigma, sigma


def _dpm_first_order(x0, sigmas, i, sample):
    """Tencent-Hunyuan/MixGRPO@e5cdd6a4 sampling_utils.py dpm_solver_first_order_update, "dpmsolver++",
    deterministic (sde_solver False)."""
    alpha_t, sigma_t = _alpha_sigma(sigmas[i + 1])
    alpha_s, sigma_s = _alpha_sigma(sigmas[i])
    h = (torch.log(alpha_t) - torch.log(sigma_t)) - (torch.log(alpha_s) - torch.log(sigma_s))
    return (sigma_t / sigma_s) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * x0


def _dpm_second_order(x0_list, sigmas, i, sample):
    """Tencent-Hunyuan/MixGRPO@e5cdd6a4 sampling_utils.py multistep_dpm_solver_second_order_update,
    "dpmsolver++", "midpoint", deterministic; x0_list[-1] is this step's data prediction, [-2] the last step's."""
    alpha_t, sigma_t = _alpha_sigma(sigmas[i + 1])
    alpha_s0, sigma_s0 = _alpha_sigma(sigmas[i])
    alpha_s1, sigma_s1 = _alpha_sigma(sigmas[i - 1])
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    m0, m1 = x0_list[-1], x0_list[-2]
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    d0, d1 = m0, (1.0 / r0) * (m0 - m1)
    return (
        (sigma_t / sigma_s0) * sample
        - (alpha_t * (torch.exp(-h) - 1.0)) * d0
        - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
    )


def _dpm_step(v, sample, sigmas, i, x0_list):
    """sampling_utils.py dpm_step with order 2 and a DPMState ``x0_list`` already holding the steps before (the
    "post" strategy records the window's): first order at the final step (lower_order_final), else second order."""
    x0 = sample - sigmas[i] * v  # convert_model_output
    x0_list = [*x0_list, x0]
    final = i == len(sigmas) - 2
    return _dpm_first_order(x0, sigmas, i, sample) if final else _dpm_second_order(x0_list, sigmas, i, sample)


@transcribes("step:dpm_solver_2m", source=DPM_2M)
def test_dpm_solver_2m_step_is_the_authors_dpmsolverpp_midpoint_step():
    """On a shifted schedule, random latents, velocities and previous data predictions, every step from the
    second on equals theirs: second order with the previous step's x0, first order (Euler) where the previous
    sigma is 1 (lambda = -inf: their D1 is 0) and at the final step to sigma = 0 (the data prediction x0)."""
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(1, 0, 13, dtype=torch.float64)
    sigmas = (3 * t / (1 + 2 * t)).float()  # sd3_time_shift(3, linspace(1, 0, T + 1))
    assert [bool(s) for s in second_order_steps(torch.tensor([True] * 2 + [False] * 10), 2)] == [False] * 2 + [
        True
    ] * 9 + [False]  # the final step is first order, as their lower_order_final
    host = sigmas.tolist()
    for i in range(1, len(sigmas) - 1):
        x, v, prev_x0 = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
        ours = dpm_solver_2m_step(v, x, prev_x0, host[i - 1], host[i], host[i + 1])
        theirs = _dpm_step(v, x, sigmas, i, [prev_x0])
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _post_schedule(sigma_schedule, determistic, ratio, shift):
    """Tencent-Hunyuan/MixGRPO@e5cdd6a4 sampling_utils.py run_sample_step, dpm_apply_strategy "post": the
    schedule kept up to the window's last step, then a new shifted linspace from the next time to 0."""
    last = len(determistic) - 1 - next(i for i, value in enumerate(reversed(determistic)) if not value)
    num_post_steps = int(max((sigma_schedule.size(0) - 1 - last) * ratio, 1))
    post_time_step = torch.linspace(1, 0, sigma_schedule.size(0))[last + 1].item()
    post = torch.linspace(post_time_step, 0, num_post_steps)
    post = (shift * post) / (1 + (shift - 1) * post)
    return torch.cat([sigma_schedule[: last + 1], post])


@pytest.mark.parametrize(("start", "ratio"), [(0, 0.4), (3, 0.4), (10, 0.5), (2, 0.25)])
@transcribes("step:dpm_solver_2m", source=POST)
def test_compressed_schedule_keeps_the_window_and_takes_about_the_authors_number_of_steps(start, ratio):
    """25 steps, a window of 4 at ``start``: both schedules keep every noise level up to the window's end and end
    at 0; after the window theirs takes int(r (n + 1)) - 1 steps on a new linspace (n steps there before), ours
    round(r n) of the model's own noise levels (docs/departures.md)."""
    shift, steps = 3.0, 25
    t = torch.linspace(1, 0, steps + 1)
    sigmas = (shift * t) / (1 + (shift - 1) * t)
    stochastic = torch.tensor([start <= i < start + 4 for i in range(steps)])
    ours, kept = compress_after_window(sigmas, stochastic, ratio)
    theirs = _post_schedule(sigmas, [not s for s in stochastic.tolist()], ratio, shift)
    end, n = start + 4, steps - start - 4
    torch.testing.assert_close(ours[: end + 1], theirs[: end + 1])
    assert float(ours[-1]) == float(theirs[-1]) == 0.0 and kept[:end].tolist() == stochastic[:end].tolist()
    assert len(ours) - 1 - end == max(1, round(ratio * n)) and len(theirs) - 1 - end == int(ratio * (n + 1)) - 1
    assert set(ours[end:].tolist()) <= set(sigmas.tolist())
