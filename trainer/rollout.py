"""Rollouts: sample images while recording every latent and per-step log-probability."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import torch
from torch import nn

from trainer.config.fields import Bounds, NonNegativeFloat, NonNegativeInt, PositiveInt
from trainer.models.base import Conditioning, ImageInputs, ModelAdapter, StepFunction
from trainer.samplers import DEFAULT_KIND, STEP_FUNCTIONS, generator_device, resolve_kind
from trainer.samplers.branching import (
    Plan,
    group_width,
    leaves_per_prompt,
    to_leaves,
    uniform_tree_steps,
    whole_groups,
)
from trainer.samplers.multistep import compress_after_window, dpm_solver_2m_step, second_order_steps


@dataclass
class SamplerSettings:
    """How rollouts are sampled; shared by every RL algorithm."""

    num_steps: PositiveInt = 10
    """Denoising steps per rollout (T)."""
    guidance_scale: NonNegativeFloat = 1.0
    """CFG scale during rollouts and training forwards; 1 disables CFG (one forward per step)."""
    kind: str = "auto"
    """Step math: "auto" (the model's default: "sde" for flow models, "ddim" for epsilon models), or for
    flow models "sde" (Flow-GRPO), "cps" (coefficient-preserving), "eta" (constant eta) or "cps_mse" (cps
    scored by Flow-GRPO's -mean((x - mean)^2) instead of the Gaussian log-density)."""
    noise_level: NonNegativeFloat = 0.7
    """a in std_t = a sqrt(sigma / (1 - sigma)) (sde); sin(a pi/2) fraction (cps); eta (eta)."""
    sde_window: NonNegativeInt = 0
    """Stochastic steps per rollout; 0: every step is stochastic. Otherwise a window of this many SDE
    steps at a random start (ODE elsewhere), and only those are trained on (the Flow-GRPO-Fast variant)."""
    window_range: tuple[NonNegativeInt, NonNegativeInt] = (0, 0)
    """[lo, hi) of window starts, hi <= T - sde_window: a window ends before the last step, which is never
    trained, so every draw trains ``sde_window`` steps (on every rank alike: sharded backends need the same
    number of forwards on each). (0, 0) means anywhere in [0, T - 1 - sde_window]."""
    ode_order: Annotated[int, Bounds(1, 2)] = 1
    """Order of the ODE steps after the SDE window, or of every step at noise_level 0: 2 takes DPM-Solver++(2M)
    steps there (MixGRPO-Flash; DiffusionNFT's "dpm2" rollouts), which stay accurate with fewer steps; 1 is Euler.
    Steps before the window stay Euler (trainer/samplers/multistep.py)."""
    ode_compress: Annotated[float, Bounds(0, 1, low_open=True)] = 1.0
    """Fraction of the ODE steps after the SDE window that are taken (MixGRPO-Flash's compression; 1: all):
    fewer forwards per rollout where nothing is trained."""
    branch: bool = False
    """Flow-GRPO's S1 branching: a prompt's group shares one initial noise and one ODE prefix, computed once, up
    to the SDE window's start b (the branch step, drawn from ``window_range`` per epoch, the same on every rank);
    step b's forward is shared too, and there the group's G branches draw their own noise (trainer/samplers/
    branching.py). Needs ``sde_window`` > 0: the window's steps are SDE and trained, ODE after."""
    tree: tuple[PositiveInt, ...] = ()
    """BranchGRPO's tree rollouts: a branching factor per level, whose product is the group size; every step SDE,
    each trajectory's forward computed once, children drawing their own noise at the level's step. GRPO then
    takes BranchGRPO's per-depth advantages (``tree_advantages``)."""
    tree_steps: tuple[NonNegativeInt, ...] = ()
    """The steps the tree splits at, increasing, one per factor of ``tree``; () spaces them as BranchGRPO:
    level l at l (T // L)."""

    def __post_init__(self):
        kinds = sorted({"auto", *DEFAULT_KIND.values(), *STEP_FUNCTIONS})
        if self.kind not in kinds:
            raise ValueError(f"kind={self.kind!r} is not one of {', '.join(kinds)}")
        if self.sde_window >= self.num_steps:  # no start would leave an untrained last step
            raise ValueError(
                f"sde_window={self.sde_window} must be less than num_steps={self.num_steps} (the last "
                "step is never trained): lower sde_window or raise num_steps"
            )
        lo, hi = self.window_starts()
        if self.sde_window > 0 and not 0 <= lo < hi <= self.num_steps - self.sde_window:
            raise ValueError(
                f"window_range={tuple(self.window_range)} does not fit num_steps={self.num_steps} with "
                f"sde_window={self.sde_window}: starts must lie in [0, {self.num_steps - self.sde_window}) "
                "so that a window ends before the last step, which is never trained"
            )
        if self.ode_compress != 1 and self.sde_window == 0:
            raise ValueError(
                f"ode_compress={self.ode_compress} acts on the ODE steps after an SDE window: set "
                "sampler.sde_window > 0, or leave it at 1"
            )
        if self.ode_order != 1 and self.sde_window == 0 and self.noise_level > 0:
            raise ValueError(
                f"ode_order={self.ode_order} acts on deterministic steps, those after an SDE window (set "
                "sampler.sde_window > 0) or every step at sampler.noise_level=0; or leave it at 1"
            )
        self._check_branching()

    def _check_branching(self) -> None:
        """One line naming the fix for a branch or tree setting that cannot be sampled."""
        if (self.branch or self.tree) and self.noise_level == 0:
            raise ValueError("sampler.branch / sampler.tree need noise_level > 0: at 0 every branch is the same")
        if self.branch and (self.sde_window == 0 or self.tree):
            raise ValueError(
                "sampler.branch branches at the SDE window's start: set sampler.sde_window > 0 (S1: 1 with "
                "window_range [0, 2]), and leave sampler.tree empty"
            )
        if self.tree and self.sde_window:
            raise ValueError("sampler.tree samples every step with SDE, as BranchGRPO: set sampler.sde_window=0")
        steps = self.tree_steps or uniform_tree_steps(self.num_steps, len(self.tree))
        if self.tree and not (
            len(steps) == len(self.tree) and list(steps) == sorted(set(steps)) and steps[-1] < self.num_steps
        ):
            raise ValueError(
                f"sampler.tree_steps={tuple(self.tree_steps)} must be {len(self.tree)} increasing steps below "
                f"num_steps={self.num_steps}, one per factor of sampler.tree={tuple(self.tree)}"
            )

    @property
    def branches(self) -> bool:
        """Whether a group shares its trajectory's prefix (``branch`` or ``tree``)."""
        return self.branch or bool(self.tree)

    def branch_plan(self, stochastic: torch.Tensor, group: int) -> Plan:
        """The rollout's ((step, factor), ...) for groups of ``group`` rows and this batch's stochastic steps."""
        if self.branch:
            return ((int(torch.nonzero(stochastic).min()), group),)
        if self.tree:
            steps = self.tree_steps or uniform_tree_steps(self.num_steps, len(self.tree))
            if leaves_per_prompt(tuple(zip(steps, self.tree, strict=True))) != group:
                raise ValueError(
                    f"sampler.tree={tuple(self.tree)} makes {math.prod(self.tree)} leaves per prompt, but a group "
                    f"has {group} images: make the factors' product equal algorithm.group_size"
                )
            return tuple(zip(steps, self.tree, strict=True))
        return ()

    def window_starts(self) -> tuple[int, int]:
        """[lo, hi) of the SDE window's start (``window_range``, or its default for (0, 0))."""
        lo, hi = self.window_range
        return (lo, hi) if (lo, hi) != (0, 0) else (0, self.num_steps - self.sde_window)


@dataclass
class Rollout:
    """One batch of trajectories, everything an algorithm may train on. Index 0 of ``latents`` is the
    initial noise at sigmas[0]; index T is the final sample."""

    prompts: list[str]
    group_ids: torch.Tensor  # [B] long: which prompt group (GRPO) each sample belongs to
    cond: Conditioning  # [B, ...]
    latents: torch.Tensor  # [B, T+1, *latent_shape] float32
    log_probs: torch.Tensor  # [B, T] float32 (0 at deterministic steps)
    sigmas: torch.Tensor  # [T+1] float32: the adapter's schedule (noise levels or timesteps)
    stochastic: torch.Tensor  # [T] bool: steps that were sampled with noise
    images: torch.Tensor  # [B, C, H, W] float32 in [0, 1]
    noise_level: float
    kind: str
    guidance_scale: float
    means: torch.Tensor | None = None  # [B, T, *latent_shape] float32: each step's mean, when asked for
    forwards: int = 0  # denoiser forwards (rows) the sampling took: B T, fewer where a group shares a prefix

    @staticmethod
    def cat(parts: list[Rollout]) -> Rollout:
        """Concatenate chunks sampled with the same schedule and stochastic steps along the batch."""
        first = parts[0]
        assert all(torch.equal(p.stochastic, first.stochastic) and torch.equal(p.sigmas, first.sigmas) for p in parts)
        return Rollout(
            prompts=[q for p in parts for q in p.prompts],
            group_ids=torch.cat([p.group_ids for p in parts]),
            cond=Conditioning.cat([p.cond for p in parts]),
            latents=torch.cat([p.latents for p in parts]),
            log_probs=torch.cat([p.log_probs for p in parts]),
            sigmas=first.sigmas,
            stochastic=first.stochastic,
            images=torch.cat([p.images for p in parts]),
            noise_level=first.noise_level,
            kind=first.kind,
            guidance_scale=first.guidance_scale,
            means=torch.cat([p.means for p in parts]) if first.means is not None else None,
            forwards=sum(p.forwards for p in parts),
        )

    def trainable_steps(self) -> torch.Tensor:
        """Stochastic steps except the last denoising step (its variance is near zero)."""
        steps = torch.nonzero(self.stochastic, as_tuple=False).flatten()
        return steps[steps < len(self.stochastic) - 1]


def check_ode_steps(settings: SamplerSettings, sampler_kind: str) -> None:
    """Refuse ``ode_order`` / ``ode_compress`` for models whose steps are not flow steps (DDIM)."""
    if sampler_kind != "flow" and (settings.ode_order != 1 or settings.ode_compress != 1):
        raise ValueError(
            f"sampler.ode_order={settings.ode_order} / ode_compress={settings.ode_compress} need a flow "
            f"model; this one samples with {sampler_kind} steps: leave them at 1"
        )


def check_sampler(adapter: ModelAdapter, settings: SamplerSettings) -> None:
    """Raise now the ValueError that the first rollout with ``settings`` would raise: a step kind, noise level
    or ODE option the model cannot use."""
    check_ode_steps(settings, adapter.sampler_kind)
    adapter.step_function(
        resolve_kind(settings.kind, adapter.sampler_kind), adapter.sigmas(settings.num_steps)
    ).check_noise_level(settings.noise_level)


def window_mask(settings: SamplerSettings, generator: torch.Generator | None) -> torch.Tensor:
    """Which of the T steps are stochastic: all, or a window of ``sde_window`` steps at a random start."""
    if settings.sde_window == 0:
        return torch.ones(settings.num_steps, dtype=torch.bool)
    lo, hi = settings.window_starts()
    start = int(torch.randint(lo, hi, (1,), generator=generator, device=generator_device(generator)))
    mask = torch.zeros(settings.num_steps, dtype=torch.bool)
    mask[start : start + settings.sde_window] = True
    return mask


def chunk_bounds(n: int, chunks: int, unit: int) -> list[int]:
    """Cut ``n`` items into at most ``chunks`` contiguous chunks whose boundaries are multiples of ``unit``
    (whole reward requests; only the last chunk may end in a partial one): boundary i is the multiple of
    ``unit`` nearest to i n / chunks, and boundaries that coincide merge their chunks. Returns
    ``[0, ..., n]``. E.g. n=20, chunks=2, unit=8 -> [0, 8, 20]: 3 requests, as unchunked."""
    assert n > 0 and chunks > 0 and unit > 0
    bounds = [min(n, math.floor(i * n / (chunks * unit) + 0.5) * unit) for i in range(chunks)] + [n]
    return sorted(set(bounds))


MIN_CHUNK = 8
"""Fewest images a rollout chunk samples at once by default (16 rows with CFG), so that chunking does not
leave a GPU idle."""
MAX_CHUNKS = 10
"""Most chunks by default: the sampling of the first chunk and the scoring of the last overlap nothing, and
at 10 chunks they are a tenth of the shorter phase, so an epoch takes at most about 1.1 max(S, R)."""


def rollout_bounds(n: int, chunks: int, unit: int, group: int = 1) -> list[int]:
    """``train.rollout_chunks``'s cut of ``n`` rollout images: ``chunks`` > 0 as ``chunk_bounds`` cuts at whole
    reward requests of ``unit``; 0 (the default) into at most ``MAX_CHUNKS`` chunks of a multiple of
    ``MIN_CHUNK`` images each, the last one possibly smaller. E.g. 160 -> 10 chunks of 16; 32 -> 4 of 8.
    Bounds then move to multiples of ``group`` (a branching rollout's group shares its prefix: one chunk)."""
    if chunks:
        return whole_groups(chunk_bounds(n, chunks, unit), group)
    size = MIN_CHUNK * max(1, math.ceil(n / (MAX_CHUNKS * MIN_CHUNK)))
    return whole_groups([*range(0, n, size), n], group)


@torch.no_grad()
def rollout(
    adapter: ModelAdapter,
    net: nn.Module,
    prompts: list[str],
    group_ids: torch.Tensor,
    settings: SamplerSettings,
    generator: torch.Generator | None,
    inputs: ImageInputs | None = None,
    stochastic: torch.Tensor | None = None,
    record_means: bool = False,
    initial: torch.Tensor | None = None,
) -> Rollout:
    """Sample ``len(prompts)`` images with ``net`` and record the trajectory (no gradients).

    ``stochastic`` [T] bool fixes which steps use noise (chunks of one batch share it); by default it is
    drawn with ``window_mask``. ``record_means``: keep each step's Gaussian mean too (``Rollout.means``).
    ``initial``: the starting noise (default: ``adapter.prepare_latents`` from ``generator``).
    """
    cond = adapter.encode_prompts(prompts, inputs)
    kind = resolve_kind(settings.kind, adapter.sampler_kind)
    check_ode_steps(settings, adapter.sampler_kind)
    if stochastic is None:
        stochastic = window_mask(settings, generator)
    sigmas, stochastic = compress_after_window(adapter.sigmas(settings.num_steps), stochastic, settings.ode_compress)
    step = adapter.step_function(kind, sigmas)
    plan = settings.branch_plan(stochastic, group_width(group_ids)) if settings.branches else ()
    rows = len(prompts) // leaves_per_prompt(plan)  # trajectories at the start: one per prompt when branching
    x = adapter.prepare_latents(rows, generator) if initial is None else initial
    if adapter.reads_trajectory:  # its predict reads the initial noise and the schedule
        cond = cond.starting_at(to_leaves(x, len(prompts)), sigmas)
    latents, log_probs, means, forwards = _denoise(
        adapter, net, x, cond, step, sigmas, stochastic, settings, generator, record_means, dict(plan)
    )
    leaves = lambda steps: torch.stack([to_leaves(t, len(prompts)) for t in steps], dim=1)  # noqa: E731
    return Rollout(
        prompts=list(prompts),
        group_ids=group_ids,
        cond=cond,
        latents=leaves(latents),
        log_probs=leaves(log_probs),
        sigmas=sigmas,
        stochastic=stochastic,
        images=adapter.decode(latents[-1]),
        noise_level=settings.noise_level,
        kind=kind,
        guidance_scale=settings.guidance_scale,
        means=leaves(means) if record_means else None,
        forwards=forwards,
    )


def _denoise(
    adapter: ModelAdapter,
    net: nn.Module,
    x: torch.Tensor,
    cond: Conditioning,
    step: StepFunction,
    sigmas: torch.Tensor,
    stochastic: torch.Tensor,
    settings: SamplerSettings,
    generator: torch.Generator | None,
    record_means: bool,
    splits: dict[int, int],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
    """The sampling loop from noise ``x`` with reverse ``step``: the latents (``x`` first, then one per step), each
    step's log-probability, (with ``record_means``) Gaussian mean, and the forwards taken. After the SDE window,
    ``settings.ode_order`` 2 takes DPM-Solver multistep steps. At a step of ``splits`` (step: factor) each row's
    forward is repeated to its children, which draw their own noise; rows before a split stand for all their
    leaves of ``cond`` (tree order), and the recorded tensors have the width of their step."""
    noisy = stochastic if settings.noise_level > 0 else torch.zeros_like(stochastic)  # the steps that draw noise
    multistep = second_order_steps(noisy, settings.ode_order).tolist()
    host = sigmas.cpu().tolist() if any(multistep) else []  # one read per rollout, only for the multistep
    latents, log_probs, means, x0, forwards = [x], [], [], None, 0
    leaves, trajectories = cond, cond.select(slice(None, None, math.prod(splits.values()))) if splits else cond
    levels = [settings.noise_level if s else 0.0 for s in stochastic.tolist()]
    for i, level in enumerate(levels):
        batch = x.shape[0]
        v = adapter.predict(net, x, sigmas[i].expand(batch), trajectories, settings.guidance_scale)
        forwards += batch
        if i in splits:  # one forward per trajectory, repeated to the children that branch off it here
            x, v, x0 = (None if t is None else t.repeat_interleave(splits[i], dim=0) for t in (x, v, x0))
            batch = x.shape[0]
            trajectories = leaves.select(slice(None, None, len(leaves) // batch))
        if multistep[i]:  # deterministic, after the window: scored 0 like every ODE step, never trained
            x_next = dpm_solver_2m_step(v, x, x0, host[i - 1], host[i], host[i + 1])
            logp, mean = torch.zeros(batch, device=x.device), x_next.float()
        else:
            x_next, logp, mean, _ = step(v, x, i, level, generator=generator)
        if host:  # the data prediction, the multistep's history
            x0 = x.float() - host[i] * v.float()
        x = x_next
        latents.append(x)
        log_probs.append(logp)
        if record_means:
            means.append(mean)
    return latents, log_probs, means, forwards
