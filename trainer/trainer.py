"""The one training loop: (supervised warm-up) -> epochs of [rollout -> reward -> algorithm updates].

It holds a ModelAdapter, an Algorithm, a RewardClient and a ParallelBackend, and knows none of them by name.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from trainer.algorithms.base import Algorithm, LossContext, Rewards
from trainer.algorithms.sft import SFT
from trainer.checkpoint import Checkpoints, Progress, is_copy
from trainer.config import Config, to_dict
from trainer.data import Task
from trainer.data.sampler import GroupSampler
from trainer.distributed import ParallelBackend
from trainer.logging import RunLogger, to_uint8
from trainer.models.base import ModelAdapter
from trainer.rollout import Rollout, SamplerSettings, rollout, window_mask


class RewardFailure(RuntimeError):
    """Too many samples of an epoch have no reward; training on the rest would be biased."""


class Trainer:
    def __init__(self, config: Config, adapter: ModelAdapter, algorithm: Algorithm, warmup: SFT, task: Task,
                 reward_client: Any, backend: ParallelBackend, logger: RunLogger):
        self.config = config
        self.adapter = adapter
        self.algorithm = algorithm
        self.warmup = warmup
        self.task = task
        self.rewards = reward_client
        self.backend = backend
        self.logger = logger
        self.is_main = backend.world.rank == 0
        train = config.train
        self.policy = backend.prepare(
            adapter.denoiser, adapter.trainable_parameters(),
            lambda params: torch.optim.AdamW(params, lr=train.learning_rate, betas=train.adam_betas,
                                             weight_decay=train.weight_decay),
        )
        self.sampler = GroupSampler(len(task.prompts), config.data.prompts_per_epoch, algorithm.group_size,
                                    backend.world.world_size, backend.world.rank, train.seed)
        self.ctx = LossContext(adapter, self.policy, None)  # the reference is taken when RL starts
        self.progress = Progress()
        self.checkpoints = Checkpoints(logger.run_dir / "checkpoints", config.train.keep_checkpoints, self.is_main)
        # Rank-specific streams, re-seeded per phase step so that a resumed run draws the same numbers.
        self._rank_seed = train.seed * 7919 + backend.world.rank

    def _generator(self, phase: int, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(((self._rank_seed * 4 + phase) * 1_000_003 + step) % (2**63))

    # --- phases ---------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Run the whole schedule (continuing from ``progress`` after a resume); returns final metrics."""
        train = self.config.train
        progress = self.progress
        if progress.warmup_steps_done < train.warmup_steps:
            self.backend.set_lr(train.warmup_learning_rate)
            steps = range(progress.warmup_steps_done, train.warmup_steps)
            for step in tqdm(steps, desc="warm-up (SFT)", disable=not self._bars()):
                metrics = self.warmup_step(step)
                if step % 25 == 0 or step == train.warmup_steps - 1:
                    self.logger.log(step, "warmup", metrics)
                progress.warmup_steps_done = step + 1
                every = train.warmup_checkpoint_every
                if every and progress.warmup_steps_done % every == 0 and progress.warmup_steps_done < train.warmup_steps:
                    self.save_checkpoint()
        if not progress.rl_started:
            before = self.evaluate(0, "samples_before")
            self._print(f"[eval] before RL: {_fmt(before)}")
            # RL gradients are ~20x smaller than the warm-up's: Adam moments carried over from the warm-up
            # would shrink RL updates for ~1/(1 - beta2) steps, so the RL phase starts with fresh moments.
            self.backend.reset_optimizer()
            if self.algorithm.needs_reference:  # the policy as RL starts (LoRA: the base without adapter)
                self.ctx.reference = self.adapter.reference()
            progress.rl_started = True
        self.backend.set_lr(train.learning_rate)
        bar = tqdm(range(progress.epochs_done, train.epochs), desc="RL", disable=not self._bars())
        for epoch in bar:
            metrics = self.rl_epoch(epoch)
            self.logger.log(epoch + 1, "rl", metrics)
            line = (f"epoch {epoch + 1:3d}  reward {metrics['reward_mean']:.3f}±{metrics['reward_std']:.3f}  "
                    + "  ".join(f"{k} {metrics[k]:.3f}" for k in self._task_keys(metrics))
                    + f"  kl {metrics.get('approx_kl', 0.0):.2e}  clip {metrics.get('clip_frac', 0.0):.3f}"
                    + f"  img/s {metrics['images_per_s']:.1f}")
            bar.write(line) if self._bars() else self._print(line)
            progress.epochs_done = epoch + 1
            every = self.config.eval.every
            if every and (epoch + 1) % every == 0 and epoch + 1 < train.epochs:
                self._print(f"[eval] epoch {epoch + 1}: {_fmt(self.evaluate(epoch + 1, None))}")
            if train.checkpoint_every and (epoch + 1) % train.checkpoint_every == 0 and epoch + 1 < train.epochs:
                self.save_checkpoint()
        self.save_checkpoint()
        after = self.evaluate(train.epochs, "samples_after")
        self._print(f"[eval] after RL: {_fmt(after)}")
        spread = self.weights_rank_spread()
        self.logger.log(train.epochs, "final", {**after, "weights_rank_spread": spread})
        self.logger.reward_curve()
        return after

    def save_checkpoint(self) -> None:
        states = {}
        if self.ctx.reference is not None and is_copy(self.ctx.reference, self.adapter):
            states["reference"] = self.ctx.reference.state_dict()
        path = self.checkpoints.save(self.progress, self.adapter, self.backend, states, to_dict(self.config))
        if path is not None:
            self.logger.log(self.progress.epochs_done, "checkpoint", {"warmup_steps_done": self.progress.warmup_steps_done})

    def resume(self, path: Path) -> None:
        """Continue from checkpoint ``path``: weights, optimizer, reference and progress."""
        self.progress, states = self.checkpoints.load(path, self.adapter, self.backend)
        if self.progress.rl_started and self.algorithm.needs_reference:
            self.ctx.reference = self.adapter.reference()
            if "reference" in states:
                self.ctx.reference.load_state_dict(states["reference"])
        self.logger.truncate(self.progress.warmup_steps_done, self.progress.epochs_done)
        self._print(f"resumed from {path} (warm-up steps {self.progress.warmup_steps_done}, "
                    f"RL epochs {self.progress.epochs_done})")

    def warmup_step(self, step: int) -> dict[str, float]:
        g = self._generator(0, step)
        data = self.task.supervised_batch(self.config.warmup.batch_size, g)
        batch = self.warmup.data_batch(self.adapter, data.images, data.prompts, g, data.inputs)
        stats = self._update(self.warmup, batch, g)
        return self.backend.mean(stats)

    def rl_epoch(self, epoch: int) -> dict[str, float]:
        g = self._generator(1, epoch)
        indices, group_ids = self.sampler.epoch(epoch)
        prompts = [self.task.prompts[i] for i in indices.tolist()]

        t0 = time.perf_counter()
        ro, result, t_wait = self.sample_and_score(prompts, indices, group_ids, g)
        t1 = time.perf_counter()

        local = torch.as_tensor(result.combined, dtype=torch.float32)
        gathered = self.backend.gather(torch.stack([local, group_ids.float()], dim=1))
        rewards = Rewards(local, gathered[:, 0], gathered[:, 1].long(), self.backend.world.rank * len(local))
        failed = float(torch.isnan(rewards.all).float().mean())
        limit = self.config.reward.max_failed_share
        if failed > limit:
            raise RewardFailure(f"epoch {epoch + 1}: {failed:.0%} of samples have no reward (reward.max_failed_share "
                                f"= {limit:.0%}); check the reward servers' logs")

        self.policy.train()
        batch = self.algorithm.make_batch(ro, rewards)
        stats: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.algorithm.inner_epochs):
            for k, v in self._update(self.algorithm, batch, g).items():
                stats[k].append(v)
        t2 = time.perf_counter()

        metrics = {k: float(np.mean(v)) for k, v in stats.items()}
        metrics.update(self.algorithm.batch_metrics(batch))
        for name, values in result.components.items():
            metrics[f"reward/{name}"] = float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
        metrics.update(self.task.metrics(ro.images, prompts))
        metrics = self.backend.mean(metrics)
        valid = rewards.all[~torch.isnan(rewards.all)]
        metrics.update({
            "reward_mean": float(valid.mean()) if len(valid) else math.nan,
            "reward_std": float(valid.std(unbiased=False)) if len(valid) else math.nan,
            "failed_share": failed,
            "images_per_s": len(rewards.all) / (t1 - t0),  # sampling + the reward wait not hidden by it
            "time_rollout_s": t1 - t0 - t_wait, "time_reward_wait_s": t_wait, "time_train_s": t2 - t1,
            "lr": self.config.train.learning_rate,
        })
        return metrics

    def sample_and_score(self, prompts: list[str], indices: torch.Tensor, group_ids: torch.Tensor,
                          g: torch.Generator):
        """Sample the epoch's batch in ``train.rollout_chunks`` chunks; each chunk's rewards are requested
        as soon as it is sampled and are scored while the next chunk samples (all on the same policy).
        Returns the whole rollout, its rewards and the seconds spent waiting for rewards after sampling."""
        from trainer.rewards.client import RewardResult

        chunks = min(self.config.train.rollout_chunks, len(prompts))
        bounds = torch.linspace(0, len(prompts), chunks + 1).round().long().tolist()
        settings = self.algorithm.sampler
        stochastic = window_mask(settings.num_steps, settings, g)
        parts, futures = [], []
        self.policy.eval()
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            part = rollout(self.adapter, self.policy, prompts[lo:hi], group_ids[lo:hi], settings, g,
                           self.task.inputs(indices[lo:hi].tolist()), stochastic)
            futures.append(self.rewards.submit(to_uint8(part.images), prompts[lo:hi],
                                               [self.task.metadata(p) for p in prompts[lo:hi]]))
            parts.append(part)
        t_sampled = time.perf_counter()
        results = [f.result() for f in futures]
        t_wait = time.perf_counter() - t_sampled
        merged = RewardResult.cat(results, self.rewards.weights, self.rewards.combine_mode)
        return Rollout.cat(parts), merged, t_wait

    def _update(self, objective, batch, g: torch.Generator) -> dict[str, float]:
        """Run the objective's optimizer steps over ``batch``; returns averaged loss statistics."""
        sums: dict[str, float] = defaultdict(float)
        count = 0
        for units in objective.plan(batch, g):
            for i, unit in enumerate(units):
                with self.backend.sync(i == len(units) - 1):
                    loss, stats = objective.loss(self.ctx, unit)
                    self.backend.backward(loss / len(units))
                for k, v in stats.items():
                    sums[k] += float(v)
                count += 1
            sums["grad_norm"] += self.backend.step(self.config.train.max_grad_norm) * len(units)
        return {k: v / max(count, 1) for k, v in sums.items()}

    @torch.no_grad()
    def evaluate(self, step: int, grid_name: str | None) -> dict[str, float]:
        """Deterministic samples of the evaluation prompts with fixed noise (rank 0; others wait)."""
        metrics: dict[str, float] = {}
        if self.is_main:
            ev = self.config.eval
            prompts = [p for p in self.task.eval_prompts for _ in range(ev.samples_per_prompt)]
            settings = SamplerSettings(num_steps=ev.num_steps, guidance_scale=ev.guidance_scale, noise_level=0.0)
            was_training = self.adapter.denoiser.training
            self.adapter.denoiser.eval()
            ro = rollout(self.adapter, self.adapter.denoiser, prompts, torch.arange(len(prompts)), settings,
                         torch.Generator().manual_seed(ev.seed))
            self.adapter.denoiser.train(was_training)
            metrics = self.task.metrics(ro.images, prompts)
            scored = self.rewards.score(to_uint8(ro.images), prompts, [self.task.metadata(p) for p in prompts])
            metrics["reward_mean"] = float(np.nanmean(scored.combined))
            self.logger.log(step, "eval", metrics)
            if grid_name:
                self.logger.image_grid(grid_name, ro.images, len(self.task.eval_prompts), step)
        self.backend.barrier()
        return metrics

    @torch.no_grad()
    def weights_rank_spread(self) -> float:
        """Largest difference between ranks of a float64 checksum of the trainable weights (0 when every
        rank holds the same weights, as data parallelism requires)."""
        checksum = sum(p.detach().double().sum() * (i + 1) for i, p in enumerate(self.adapter.trainable_parameters()))
        every = self.backend.gather(torch.as_tensor(checksum, dtype=torch.float64).reshape(1))
        return float(every.max() - every.min())

    def _task_keys(self, metrics: dict[str, float]) -> list[str]:
        return [k for k in metrics if k.endswith("accuracy")]

    def _bars(self) -> bool:
        return self.is_main and self.config.logging.progress

    def _print(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())
