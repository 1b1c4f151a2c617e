"""The fixed evaluation: a task's evaluation items sampled deterministically with fixed noise, scored by the reward
and alarm scorers, logged with a grid. What the best weights, early stop and the hacking alarm judge by."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from shared.rewards import RewardClient, RewardResult, failed_share
from trainer.config.schema import EvalConfig
from trainer.data import Task
from trainer.distributed import ParallelBackend
from trainer.health import ADVICE, RewardFailure, TrainingDiverged, first_error
from trainer.logging import RunLogger, to_uint8
from trainer.models.base import ModelAdapter
from trainer.rewards.errors import RewardClientError
from trainer.rollout import SamplerSettings, rollout, window_mask
from trainer.scoreboard import REWARD
from trainer.video import adapter_fps, with_fps

GRID_PROMPTS = 16
"""Rows of an evaluation's grid at most (its first prompts): a test split of hundreds would make an image
too large to open."""


def breakdown(field: str, metadata: list[dict], scores: dict[str, np.ndarray]) -> dict[str, float]:
    """Each scorer's mean over the items whose ``field`` has each value, ``by_<field>/<scorer>/<value>``, and the
    unweighted mean of those, ``by_<field>/<scorer>/mean`` (a benchmark's overall score over its categories, as
    GenEval's over its tags); failed scores (NaN) are left out. Items without ``field`` are in no group."""
    values = np.array([str(m[field]) if field and isinstance(m.get(field), str | int) else "" for m in metadata])
    masks = {group: values == group for group in sorted(set(values) - {""})}
    metrics: dict[str, float] = {}
    for name, scored in scores.items():
        scored = np.asarray(scored, dtype=np.float64)
        means = []
        for group, mask in masks.items():
            chosen = scored[mask & np.isfinite(scored)]
            means.append(float(chosen.mean()) if len(chosen) else math.nan)
            metrics[f"by_{field}/{name}/{group}"] = means[-1]
        if masks:
            metrics[f"by_{field}/{name}/mean"] = float(np.mean(means))
    return metrics


class RolloutBreakdown:
    """``breakdown`` of an RL epoch's rollouts over every rank's items, ``rollout_by_<field>/<scorer>/<value>``: which
    of a GenEval-style pool's categories the policy is learning, between evaluations. An item's value is read from
    its metadata the first time it is drawn."""

    def __init__(self, task: Task, field: str, backend: ParallelBackend):
        self.task, self.field, self.backend = task, field, backend
        self._values: dict[int, str] = {}

    def __call__(self, indices: list[int], scores: dict[str, np.ndarray]) -> dict[str, float]:
        """Alike on every rank (collective): ``indices`` are this rank's pool items, ``scores`` their scores."""
        if not self.field:
            return {}
        new = [i for i in dict.fromkeys(indices) if i not in self._values]
        for i, meta in zip(new, self.task.item_metadata(new), strict=True):
            self._values[i] = str(meta[self.field]) if isinstance(meta.get(self.field), str | int) else ""
        mine = ([self._values[i] for i in indices], {k: np.asarray(v, dtype=np.float64) for k, v in scores.items()})
        every = self.backend.all_gather_object(mine)[:: self.backend.world.sequence_parallel]  # one per replica
        metadata = [{self.field: value} for values, _ in every for value in values]
        joined = {name: np.concatenate([rank_scores[name] for _, rank_scores in every]) for name in scores}
        return {f"rollout_{k}": v for k, v in breakdown(self.field, metadata, joined).items()}


DIVERGED_BEFORE_RL = (
    "the warm-up diverged, or train.init_from's weights are not finite: lower "
    "train.warmup_learning_rate (or start from finite weights) and start again"
)


def unscored_evaluation(which: str, scored: RewardResult, alarm_scorers: Iterable[str]) -> str | None:
    """Why an answered evaluation cannot be judged: no image has a reward, or an alarm scorer (the hacking alarm's
    input) scored none; None when it can."""
    if failed_share(scored.combined) == 1:
        what = "no image got a reward"
    elif empty := [name for name in alarm_scorers if failed_share(scored.components[name]) == 1]:
        what = f"eval.alarm_scorers {', '.join(empty)} scored no image"
    else:
        return None
    return f"{which}: {what} ({first_error(scored) or 'no error given'})"


class Evaluation:
    """Samples ``task.eval_prompts`` (``eval.samples_per_prompt`` each) with ``eval.num_steps`` ODE steps and
    scores them with ``rewards`` (the reward's scorers and the alarm scorers)."""

    def __init__(
        self,
        config: EvalConfig,
        task: Task,
        adapter: ModelAdapter,
        backend: ParallelBackend,
        logger: RunLogger,
        rewards: RewardClient,
    ):
        self.config, self.task, self.adapter, self.backend, self.logger = config, task, adapter, backend, logger
        self.reward_client = rewards

    def slots(self) -> int:
        """Prompts each replica samples (the last ones pad with the first prompt)."""
        return -(-len(self.task.eval_prompts) // self.backend.world.replicas)

    def breakdown_names(self, scorers: list[str]) -> list[str]:
        """The metrics ``breakdown`` logs for these scorers on this evaluation's items (for train.select_by)."""
        metadata = self.task.item_metadata(self.task.eval_indices)
        return list(breakdown(self.config.breakdown, metadata, {name: np.zeros(len(metadata)) for name in scorers}))

    def metric_to_select(self, select_by: str, reward_weights: dict[str, float], task_metrics: list[str]) -> str:
        """The metric ``train.select_by`` names (by default the task's first), checked against the metrics this
        evaluation logs; an alarm scorer that the reward trains on is refused (it would not be independent)."""
        alarm_scorers = self.config.alarm_scorers
        reused = sorted(set(alarm_scorers) & {k for k, w in reward_weights.items() if w})
        if reused:
            raise ValueError(
                f"eval.alarm_scorers names {', '.join(reused)}, which reward.weights trains on: an alarm "
                "scorer must be independent of the reward; remove it from one of them"
            )
        logged = [
            *task_metrics,
            REWARD,
            *(f"alarm/{name}" for name in alarm_scorers),
            *self.breakdown_names([*reward_weights, *alarm_scorers]),
        ]
        if select_by and select_by not in logged:
            raise ValueError(
                f"train.select_by={select_by!r} is not a metric this run's evaluation logs; choose "
                f"one of: {', '.join(logged)}"
            )
        return select_by or logged[0]

    def due(self, epochs_done: int, epochs: int) -> bool:
        """Whether ``eval.every`` evaluates after RL epoch ``epochs_done`` (after the last: the final evaluation)."""
        every = self.config.every
        return bool(every) and epochs_done % every == 0 and epochs_done < epochs

    def batch_sizes(self) -> set[int]:
        """The rollout batch sizes an evaluation runs (for the compiled blocks' variants)."""
        slots, per = self.slots(), self.config.batch_size
        return {n * self.config.samples_per_prompt for n in (min(per, slots), slots % per) if n}

    @torch.no_grad()
    def __call__(
        self,
        step: int,
        grid_name: str | None,
        weights: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> dict[str, float]:
        """Evaluate with the weights ``weights()`` swaps in (e.g. the EMA): sampled on every rank (``_sample``),
        scored and logged on rank 0, the run stopped alike on every rank where that fails; returns the metrics
        there ({} elsewhere)."""
        ordered = self._sample(weights)  # rank 0: every prompt's images in order; None elsewhere
        labels = self._labels() if ordered is not None else None
        scored = self._score(step, ordered, labels)
        metrics = {} if ordered is None else self._log(step, grid_name, ordered, labels, scored)
        self.backend.barrier()
        return metrics

    def _sample(self, weights: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor | None:
        """Prompt i is sampled by rank i mod world size from noise seeded by (eval seed, i) and drawn on the CPU, so
        that noise depends on neither the world size nor the device, nor (up to float round-off) on
        ``eval.batch_size``; every rank runs the same number of forwards (sharded backends need all ranks in each),
        rank 0 gathers the images after each forward onto the host (device memory does not grow with the number of
        prompts) and returns them in prompt order."""
        ev, task = self.config, self.task
        prompts, world = task.eval_prompts, self.backend.world
        settings = SamplerSettings(num_steps=ev.num_steps, guidance_scale=ev.guidance_scale, noise_level=0.0)
        denoiser = self.adapter.denoiser
        was_training = denoiser.training
        denoiser.eval()
        samples = ev.samples_per_prompt
        # This replica's prompts (replicas past the end sample the first prompt and drop it), ev.batch_size at a time.
        mine = [
            i if i < len(prompts) else 0 for i in range(world.replica, self.slots() * world.replicas, world.replicas)
        ]
        by_prompt: dict[int, torch.Tensor] = {}  # rank 0: prompt index -> its images, on the CPU
        # The weights are swapped in before the sampling context gathers them, and back after it reshards.
        with weights(), self.backend.sampling():
            for lo in range(0, len(mine), ev.batch_size):
                ks = mine[lo : lo + ev.batch_size]
                generators = [torch.Generator().manual_seed((ev.seed * 1_000_003 + k) % 2**63) for k in ks]
                stochastic = window_mask(settings, generators[0])  # sde_window 0: every step, nothing drawn
                initial = torch.cat([self.adapter.prepare_latents(samples, g) for g in generators])
                items = [task.eval_indices[k] for k in ks for _ in range(samples)]
                ro = rollout(
                    self.adapter,
                    denoiser,
                    [prompts[k] for k in ks for _ in range(samples)],
                    torch.arange(len(items)),
                    settings,
                    generators[0],
                    task.inputs(items),
                    stochastic,
                    initial=initial,
                )
                # Gathered batch by batch and kept on the host: the device holds one batch of every rank, not
                # the whole evaluation. Replica-major: row n is replica n // len(ks)'s prompt at position
                # lo + n % len(ks) of its share, i.e. prompt (lo + n % len(ks)) * replicas + replica.
                gathered = self.backend.gather_replicas(ro.images.unflatten(0, (len(ks), samples)).contiguous())
                if world.rank == 0:
                    for n, image in enumerate(gathered.cpu()):
                        by_prompt[(lo + n % len(ks)) * world.replicas + n // len(ks)] = image
        denoiser.train(was_training)
        if world.rank != 0:
            return None
        return torch.stack([by_prompt[i] for i in range(len(prompts))]).flatten(0, 1)  # padding dropped

    def _labels(self) -> tuple[list[str], list[dict]]:
        """The prompt and metadata of each image of an evaluation, in order."""
        samples, task = self.config.samples_per_prompt, self.task
        repeated = [p for p in task.eval_prompts for _ in range(samples)]
        return repeated, task.item_metadata([i for i in task.eval_indices for _ in range(samples)])

    def _score(
        self, step: int, ordered: torch.Tensor | None, labels: tuple[list[str], list[dict]] | None
    ) -> RewardResult | None:
        """Rank 0's rewards of the ``ordered`` images; on every rank alike, TrainingDiverged where an image is not
        finite and RewardFailure where the evaluation cannot be judged (no rewards, or none by an alarm scorer)."""
        scored = diverged = unscored = None
        if ordered is not None:
            which = f"the evaluation {'before RL' if step == 0 else f'after RL epoch {step}'}"
            if bad := int((~torch.isfinite(ordered)).flatten(1).any(1).sum()):  # their 8-bit images are black
                diverged = f"{which} sampled {bad} non-finite images (the weights it evaluated overflowed): " + (
                    DIVERGED_BEFORE_RL if step == 0 else f"the run diverged and stops; {ADVICE}"
                )
            else:
                try:
                    prompts, metadata = labels
                    metadata = with_fps(metadata, ordered, adapter_fps(self.adapter))
                    scored = self.reward_client.score(to_uint8(ordered), prompts, metadata)
                except RewardClientError as exc:  # every rank stops alike, below
                    unscored = f"{which} got no rewards: {exc}"
                else:  # answered, but no image of it scored (e.g. a scorer's deadline): no metric to judge by
                    unscored = unscored_evaluation(which, scored, self.config.alarm_scorers)
        diverged, unscored = self.backend.broadcast((diverged, unscored))
        if diverged:
            raise TrainingDiverged(diverged)
        if unscored:
            raise RewardFailure(unscored)
        return scored

    def _log(
        self,
        step: int,
        grid_name: str | None,
        ordered: torch.Tensor,
        labels: tuple[list[str], list[dict]],
        scored: RewardResult,
    ) -> dict[str, float]:
        """Rank 0's metrics of a scored evaluation, logged with the grid of its first prompts' images."""
        ev, task, (repeated, metadata) = self.config, self.task, labels
        metrics = task.metrics(ordered, repeated, scored.components)
        metrics[REWARD] = float(np.nanmean(scored.combined))
        metrics["failed_share"] = failed_share(scored.combined)
        metrics.update(breakdown(ev.breakdown, metadata, scored.components))
        for name in ev.alarm_scorers:
            metrics[f"alarm/{name}"] = float(np.nanmean(scored.components[name]))
        self.logger.log(step, "eval", metrics)
        rows = min(len(task.eval_prompts), GRID_PROMPTS)
        self.logger.image_grid(
            grid_name or f"samples_epoch{step:04d}",
            ordered[: rows * ev.samples_per_prompt],
            rows,
            step,
            task.eval_prompts[:rows],
            task.inputs(task.eval_indices[:rows]),
        )
        return metrics
