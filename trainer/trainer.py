"""The one training loop: (supervised warm-up) -> epochs of [rollout -> reward -> algorithm updates].

It holds a ModelAdapter, an Algorithm, a RewardClient and a ParallelBackend, and knows none of them by name.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from shared.rewards import RewardClient, RewardResult
from trainer.algorithms.base import Algorithm, LossContext
from trainer.algorithms.sft import SFT
from trainer.checkpoint import Checkpoints, Progress, load_weights, recover
from trainer.config import Config, saved_dict, to_dict
from trainer.config.building import build
from trainer.data import Task, training_items
from trainer.data.sampler import GroupSampler
from trainer.display import Display
from trainer.distributed import ParallelBackend, weights_rank_spread
from trainer.ema import EMA
from trainer.epoch import EpochClock, EpochRewards, log_rollout_samples, rollout_metrics
from trainer.evaluation import Evaluation, RolloutBreakdown
from trainer.health import RewardFailure, group_scored
from trainer.judging import Judge
from trainer.launch import finishing
from trainer.logging import RunLogger, epoch_line, eval_line, to_uint8
from trainer.models.attention import attention_for_run
from trainer.models.base import Conditioning, ModelAdapter
from trainer.models.compiling import CompileMonitor, compile_for_run
from trainer.models.stores import require_stored_prompts
from trainer.resume import changed_settings
from trainer.rollout import Rollout, check_sampler, rollout, rollout_bounds, window_mask
from trainer.scoreboard import Scoreboard
from trainer.state import Stateful
from trainer.stopping import StopRequests
from trainer.updates import optimizer_steps
from trainer.video import adapter_fps, with_fps


class Trainer:
    def __init__(
        self,
        config: Config,
        adapter: ModelAdapter,
        algorithm: Algorithm,
        warmup: SFT,
        task: Task,
        reward_client: RewardClient,
        backend: ParallelBackend,
        logger: RunLogger,
        eval_client: RewardClient | None = None,
        eval_task: Task | None = None,
    ):
        """``eval_client`` scores the evaluation (the reward's scorers and eval.alarm_scorers at weight 0);
        ``eval_task`` holds its items (default: ``task``'s held-out ones)."""
        build(Config, to_dict(config), "")  # a config made in Python is checked (types, ranges) as a file's is
        self.config, self.adapter, self.algorithm, self.warmup, self.task = config, adapter, algorithm, warmup, task
        self.reward_client = reward_client
        self.evaluation = Evaluation(
            config.eval, eval_task or task, adapter, backend, logger, eval_client or reward_client
        )
        self.backend, self.logger = backend, logger
        logger.fps = adapter_fps(adapter)  # a video model's; its samples and reward requests carry it
        self.rollout_breakdown = RolloutBreakdown(task, config.eval.breakdown, backend)
        self.is_main = backend.world.rank == 0
        self.display = Display(config.logging, self.is_main)  # printed lines, progress bars or progress lines
        train = config.train
        check_sampler(adapter, algorithm.sampler)  # a step the model cannot take fails now, not after the warm-up
        self._require_text_embeddings()
        self.pool = torch.tensor(training_items(task))  # the RL prompt pool: not the held-out evaluation's
        if task.holds_out and task.eval_prompts and len(self.pool) == len(task.prompts):
            self.display.write(
                f"note: {config.data.name} has {len(task.prompts)} items, too few to hold out the evaluation's "
                f"{len(task.eval_prompts)} prompts: RL samples them too (hold them out with eval.path, a file "
                "of its own, or a smaller eval.prompts)"
            )
        self.sampler = GroupSampler(
            len(self.pool),
            config.data.prompts_per_epoch,
            algorithm.group_size,
            backend.world.replicas,  # a sequence-parallel group's ranks share their samples
            backend.world.replica,
            train.seed,
            algorithm.local_groups,
            algorithm.sampler.branches,
        )
        algorithm.check_batch(self.sampler.per_rank)
        first = adapter.encode_prompts(task.prompts[:1], task.inputs([0]))
        self.compiled = self._compile(first)
        self._prepare_policy(first)
        self.progress = Progress()
        self.checkpoints = Checkpoints(logger.run_dir / "checkpoints", train.keep_checkpoints, self.is_main, train)
        select_by = self.evaluation.metric_to_select(train.select_by, config.reward.weights, task.metric_names)
        self.scoreboard = Scoreboard(select_by, train.early_stop, config.eval.alarm_window, config.eval.alarm_margin)
        self.best_dir, say = logger.run_dir / "best", self.display.write
        self.judge = Judge(self.scoreboard, self.best_dir, adapter, backend, self.ema, logger, config, say)
        # Rank-specific streams, re-seeded per phase step so that a resumed run draws the same numbers.
        self._rank_seed = train.seed * 7919 + backend.world.replica  # one per replica: its ranks draw alike
        # the signals, entered around fit() by build; a first Ctrl-C says what the run finishes before it stops
        self.stops = StopRequests(backend, self.is_main, lambda: finishing(self.progress, config, self.display))

    def _prepare_policy(self, first: Conditioning) -> None:
        """The denoiser as the backend trains it (wrapped, with its optimizer), the algorithm set up on it, the EMA
        of this rank's shards."""
        adapter, backend, train = self.adapter, self.backend, self.config.train
        self.policy = backend.prepare(
            adapter.denoiser,
            adapter.trainable.parameters(),
            lambda params: torch.optim.AdamW(
                params, lr=train.learning_rate, betas=train.adam_betas, weight_decay=train.weight_decay
            ),
            shard_units=adapter.shard_units,
        )
        self.ctx = LossContext(adapter, self.policy, None, snapshot=backend.frozen_copy)  # reference: when RL starts
        self.algorithm.setup(adapter, first, backend)
        trainable = list(adapter.trainable.parameters())
        shards = backend.local_shards(trainable)
        sharded = any(s.shape != p.shape for s, p in zip(shards, trainable, strict=True))
        self.ema = EMA(shards, train.ema_decay, train.ema_every, sharded) if train.ema_decay > 0 else None

    def _require_text_embeddings(self) -> None:
        """Refuse a ``model.text_embeddings`` store that lacks a prompt this run encodes, now rather than when
        the prompt is first drawn (epochs in)."""
        prompts = [*self.task.prompts, *self.evaluation.task.eval_prompts]
        if self.config.train.warmup_steps and self.warmup.config.cfg_dropout > 0:
            prompts.append("")
        require_stored_prompts(
            self.adapter,
            prompts,
            (self.algorithm.sampler.guidance_scale, self.config.eval.guidance_scale),
            self.config.model.text_embeddings,
            self.config.data,
        )

    def _compile(self, first: Conditioning) -> CompileMonitor | None:
        """``model.attention`` (probed on ``first``), then ``model.compile``, whose graphs bake that kernel in."""
        model = self.config.model
        self.attention = attention_for_run(
            self.adapter, model.attention, first, self.algorithm.sampler, self.backend.broadcast
        )
        if self.attention.verdicts:  # probed (CUDA) or named: said and logged; auto elsewhere is torch's order
            self.display.write(self.attention.summary())
            self.logger.log(0, "attention", self.attention.record())
        if model.compile == "none":  # both before any wrapper (FSDP2, ZeRO, DDP) sees the denoiser
            return None
        bounds = self._rollout_bounds(self.sampler.per_rank)
        sizes = {hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)} | self.evaluation.batch_sizes()
        sizes |= {getattr(c, "micro_batch_size", 1) for c in (self.algorithm.config, self.warmup.config)}
        return compile_for_run(self.adapter, model.compile, sizes, model.compile_backend)

    def _generator(self, phase: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
        return torch.Generator(device).manual_seed(((self._rank_seed * 4 + phase) * 1_000_003 + step) % (2**63))

    def fit(self) -> dict[str, float]:
        """Run the whole schedule (continuing from ``progress`` after a resume); returns final metrics."""
        self._evaluated: tuple[int, dict[str, float]] | None = None  # the last evaluation in the loop
        if not self.progress.rl_started:  # never after RL began
            self._warm_up()
            self._start_rl()
        self.backend.set_lr(self.config.train.learning_rate)
        self._reinforce()
        self.save_checkpoint()
        return self._finish()

    def _warm_up(self) -> None:
        """The supervised warm-up's remaining steps, each logged, checkpointed when due, and a place to stop."""
        train, progress = self.config.train, self.progress
        if progress.warmup_steps_done >= train.warmup_steps:
            return
        self.backend.set_lr(train.warmup_learning_rate)
        steps = range(progress.warmup_steps_done, train.warmup_steps)
        for step in self.display.steps(steps, "warm-up (SFT)", "step", "warm-up step"):
            metrics = self.warmup_step(step)
            self.display.done(step + 1, metrics)
            if step % 25 == 0 or step == train.warmup_steps - 1:
                self.logger.log(step, "warmup", metrics)
            progress.warmup_steps_done = step + 1
            if self.checkpoints.due(progress):
                self.save_checkpoint()
            self._stop_if_asked()

    def _start_rl(self) -> None:
        """The evaluation before RL, judged; then RL's start (``begin_rl``)."""
        if self.ema is not None:  # before the evaluation, which reads the EMA weights
            self.ema.reset()
        with self._kept_on_reward_failure():
            before = self.evaluate(0, "samples_before")
        self.display.write(f"[eval] before RL: {eval_line(before)}")
        self.begin_rl()
        self.judge(0, before, self.progress)

    def begin_rl(self) -> None:
        """RL's start (``fit`` evaluates first; single-epoch tests call it alone): fresh Adam moments (RL's gradients
        are ~20x smaller than the warm-up's) and the reference of the policy as it is (which: ALGORITHMS.md)."""
        self.backend.reset_optimizer()
        if self.algorithm.needs_reference:
            self._new_reference()
        self.progress.rl_started = True

    def _reinforce(self) -> None:
        """The RL epochs left: rollout, reward, updates; an evaluation, a checkpoint or a stop where each is due."""
        progress, epochs = self.progress, self.config.train.epochs
        first = progress.epochs_done
        if progress.eval_due:  # a stop signal came before this epoch's evaluation: it runs now
            with self._kept_on_reward_failure(eval_due=True):
                self._evaluate_epoch(first)
        for epoch in self.display.steps(range(first, epochs), "RL", "epoch", "RL epoch"):
            if self.scoreboard.stopped:  # a resumed run that had stopped
                break
            if epoch == first:  # a signal during the evaluations before the loop
                self._stop_if_asked()
            with self._kept_on_reward_failure():
                metrics = self.rl_epoch(epoch)
            self._report_epoch(epoch, first, metrics)
            progress.epochs_done = epoch + 1
            due = self.evaluation.due(epoch + 1, epochs)
            self._stop_if_asked(eval_due=due)
            if due:
                with self._kept_on_reward_failure(eval_due=True):
                    stop = self._evaluate_epoch(epoch + 1)
                if stop:
                    break
                self._stop_if_asked()  # a signal during the evaluation
            if self.checkpoints.due(progress):
                self.save_checkpoint()

    def _report_epoch(self, epoch: int, first: int, metrics: dict[str, float]) -> None:
        self.logger.log(epoch + 1, "rl", metrics)
        self.display.write(epoch_line(epoch + 1, metrics, self.algorithm.shown_metrics))
        self.display.done(epoch + 1, metrics)
        if self.compiled is not None and epoch == first:  # the first epoch compiled the variants: said once
            self.display.write(self.compiled.summary(self.config.model.compile, metrics))

    def _finish(self) -> dict[str, float]:
        """The evaluation after RL (a stop's own where it evaluated these weights), judged and logged as final."""
        done = self.progress.epochs_done
        if self._evaluated is not None and self._evaluated[0] == done != self.judge.rolled_back_at:  # a stop
            after = self._evaluated[1]
            self.logger.copy_grid(f"samples_epoch{done:04d}", "samples_after")
        else:
            with self._kept_on_reward_failure():
                after = self.evaluate(done, "samples_after")
        self.display.write(f"[eval] after RL: {eval_line(after)}")
        if self.scoreboard.epochs[-1:] != [done]:  # not judged yet (a stop judged it in the loop)
            self.judge(done, after, self.progress)
        spread = weights_rank_spread(self.backend, self.adapter.trainable.parameters())
        best = {"best_epoch": self.scoreboard.best_epoch, "best_value": self.scoreboard.best_value}
        self.logger.log(done, "final", {**after, "weights_rank_spread": spread, **best})
        self.logger.reward_curve(self.scoreboard.best_epoch, self.scoreboard.select_by)
        ema = self.ema is not None and self.config.eval.use_ema
        self.display.write(
            self.scoreboard.report(self.best_dir if self.judge.has_best() else None, "--ema " if ema else "")
        )
        return after

    def _evaluate_epoch(self, epoch: int) -> bool:
        """The periodic evaluation after RL epoch ``epoch``, judged by the scoreboard; True: stop the run."""
        self.progress.eval_due = False
        evaluation = self.evaluate(epoch, None)
        self.display.write(f"[eval] epoch {epoch}: {eval_line(evaluation)}")
        self._evaluated = epoch, evaluation  # the weights a stop leaves, unless its alarm rolled them back
        return self.judge(epoch, evaluation, self.progress)

    def _stop_if_asked(self, eval_due: bool = False) -> None:
        """Write a checkpoint here and stop when a rank received a stop signal (trainer/stopping.py), alike on
        every rank; ``eval_due``: this epoch's evaluation has not run, and runs first when the run continues."""
        self.stops.stop_if_asked(lambda: self._checkpoint_stop(eval_due))

    def _checkpoint_stop(self, eval_due: bool) -> None:
        self.progress.eval_due = eval_due
        self.save_checkpoint()

    @contextlib.contextmanager
    def _kept_on_reward_failure(self, eval_due: bool = False):
        """A RewardFailure here (on every rank alike) first checkpoints the finished work, the state before the
        epoch or evaluation that failed; ``eval_due``: that evaluation runs first when the run continues. A stop
        signal that ended a wait for the reward pool (``reward.outage_s``) then stops the run as it asks."""
        try:
            yield
        except RewardFailure:
            self._checkpoint_stop(eval_due)
            self.stops.stop_if_asked()
            raise

    def _stateful(self) -> list[Stateful]:
        """The components that keep their own state in checkpoints (besides weights, optimizer, progress)."""
        return [self.ctx, self.algorithm, self.scoreboard, *([self.ema] if self.ema is not None else [])]

    def save_checkpoint(self) -> None:
        states = {}
        for component in self._stateful():
            for name, state in component.checkpoint_state().items():
                assert name not in states, f"two components keep a state named {name}"
                states[name] = state
        path = self.checkpoints.save(self.progress, self.adapter, self.backend, states, saved_dict(self.config))
        if path is not None:
            self.logger.log(
                self.progress.epochs_done, "checkpoint", {"warmup_steps_done": self.progress.warmup_steps_done}
            )

    def resume(self, path: Path) -> None:
        """Continue from checkpoint ``path``: weights, optimizer, progress and every stateful component."""
        self.progress, states = self.checkpoints.load(path, self.adapter, self.backend)
        if self.is_main:  # best/ as it was, where a kill cut its replacement between two renames
            recover(self.best_dir)
        if self.progress.rl_started and self.algorithm.needs_reference:
            self._new_reference()
        for component in self._stateful():
            component.load_checkpoint_state(states, path)
        if self.is_main:  # another run's checkpoint: its best/, where it is the one the scoreboard now names best
            self.judge.carry_from(path)
        self.logger.truncate(self.progress.warmup_steps_done, self.progress.epochs_done)
        self.display.write(
            f"resumed from {path} (warm-up steps {self.progress.warmup_steps_done}, "
            f"RL epochs {self.progress.epochs_done})"
            + ("; first the evaluation a stop signal put off" if self.progress.eval_due else "")
        )
        if (warning := changed_settings(path, saved_dict(self.config))) is not None:
            self.display.write(warning)

    def _new_reference(self) -> None:
        """The reference for the policy as it is now, as the adapter describes it, made by the backend (it
        copies or swaps sharded weights its own way)."""
        self.ctx.reference = self.backend.reference(self.adapter.denoiser, self.adapter.trainable.reference_spec)

    def init_from(self, path: Path) -> None:
        """Start from the trainable weights of checkpoint ``path`` (nothing else of it), taken as warmed up
        unless ``train.warmup_after_init``."""
        load_weights(path, self.adapter.denoiser, self.backend)
        skip = not self.config.train.warmup_after_init and self.config.train.warmup_steps > 0
        if skip:
            self.progress.warmup_steps_done = self.config.train.warmup_steps
        self.display.write(
            f"initialised the trainable weights from {path}"
            + ("; no warm-up (train.warmup_after_init=true runs it)" if skip else "")
        )

    def warmup_step(self, step: int) -> dict[str, float]:
        g = self._generator(0, step)
        data = self.task.supervised_batch(self.config.warmup.batch_size, g, step)
        batch = self.warmup.data_batch(self.adapter, data.images, data.prompts, g, data.inputs)
        stats = self._update(self.warmup, batch, g)
        return self.backend.mean(stats)

    def rl_epoch(self, epoch: int) -> dict[str, float]:
        g = self._generator(1, epoch)
        self.algorithm.start_epoch(self.ctx, epoch)
        indices, group_ids = self.sampler.epoch(epoch)
        indices = self.pool[indices]
        prompts = [self.task.prompts[i] for i in indices.tolist()]

        clock = EpochClock()
        # the rollout's noise comes from a generator on the model's device (one kernel per draw on a GPU)
        noise = self._generator(2, epoch, self.adapter.device)
        failed_before = self.reward_client.failed_attempts
        ro, result, t_wait = self.sample_and_score(prompts, indices, group_ids, g, noise)
        clock.sampled(t_wait)
        log_rollout_samples(self.logger, self.config, self.task, epoch, ro.images, indices, result)
        limit = self.config.reward.max_failed_share
        scored = EpochRewards.gather(result, ro.images, group_ids, self.backend, epoch + 1, limit)

        self.policy.train()
        batch = self.algorithm.make_batch(ro, scored.rewards)
        stats: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.algorithm.inner_epochs):
            for k, v in self._update(self.algorithm, batch, g, self._after_rl_step).items():
                stats[k].append(v)
        clock.trained()

        metrics = {k: float(np.mean(v)) for k, v in stats.items()}
        # summed over ranks below
        metrics["reward_failed_attempts"] = self.reward_client.failed_attempts - failed_before
        metrics.update(self.algorithm.batch_metrics(batch))
        metrics.update(rollout_metrics(self.task, ro, prompts, result))
        metrics = self.backend.mean(metrics)
        metrics["reward_failed_attempts"] *= self.backend.world.world_size  # the ranks that asked (one a group)
        metrics.update(self.rollout_breakdown(indices.tolist(), result.components))
        metrics.update({**scored.metrics(), **clock.metrics(len(scored.rewards.all))})
        metrics["lr"] = self.config.train.learning_rate
        if self.compiled is not None:
            metrics.update(self.compiled.report())
        return metrics

    def sample_and_score(
        self,
        prompts: list[str],
        indices: torch.Tensor,
        group_ids: torch.Tensor,
        g: torch.Generator,
        noise: torch.Generator,
    ) -> tuple[Rollout, RewardResult, float]:
        """Sample the epoch's batch in ``train.rollout_chunks`` chunks (stochastic steps drawn with ``g``, noise
        with ``noise``), with the weights the algorithm names (``rollout_weights``); each chunk is scored while the
        next samples. Returns the rollout, its rewards and the seconds waited for rewards after sampling."""
        bounds = self._rollout_bounds(len(prompts))
        settings = self.algorithm.sampler
        stochastic = window_mask(settings, g)
        parts, futures = [], []
        asks = self.backend.world.rank % self.backend.world.sequence_parallel == 0  # a group asks once, its first rank
        self.policy.eval()
        with self.algorithm.rollout_weights(), self.backend.sampling():  # the sampling policy's weights, gathered
            for chunk, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), 1):
                self.display.doing(f"sampling rollout chunk {chunk} of {len(bounds) - 1}")
                part = rollout(
                    self.adapter,
                    self.policy,
                    prompts[lo:hi],
                    group_ids[lo:hi],
                    settings,
                    noise,
                    self.task.inputs(indices[lo:hi].tolist()),
                    stochastic,
                    self.algorithm.records_means,
                )
                meta = with_fps(self.task.item_metadata(indices[lo:hi].tolist()), part.images, self.logger.fps)
                futures.append(self.reward_client.submit(to_uint8(part.images), prompts[lo:hi], meta) if asks else None)
                parts.append(part)
        t_sampled = time.perf_counter()
        self.display.doing("waiting for the rollouts' rewards")
        scorers, what = list(self.reward_client.weights), f"RL epoch {self.progress.epochs_done + 1}"
        results = group_scored(self.backend, futures, [len(p.images) for p in parts], scorers, what)
        t_wait = time.perf_counter() - t_sampled
        return Rollout.cat(parts), self.reward_client.merge(results), t_wait

    def _rollout_bounds(self, n: int) -> list[int]:
        return rollout_bounds(n, self.config.train.rollout_chunks, self.reward_client.batch_size, self.sampler.unit)

    def _after_rl_step(self) -> None:
        self.progress.rl_steps += 1
        self.display.doing(f"training on the rollouts (after RL optimizer step {self.progress.rl_steps})")
        if self.ema is not None:
            self.ema.step(self.progress.rl_steps)

    def _update(self, objective, batch, g: torch.Generator, after_step=None) -> dict[str, float]:
        """The objective's optimizer steps over ``batch`` (trainer/updates.py); averaged loss statistics."""
        return optimizer_steps(
            objective, batch, g, self.ctx, self.backend, self.progress, self.config.train, after_step
        )

    def evaluate(self, step: int, grid_name: str | None) -> dict[str, float]:
        """The evaluation (trainer/evaluation.py) with the EMA weights when there is an EMA; metrics on rank 0."""
        use_ema = self.ema is not None and self.config.eval.use_ema
        with self.display.evaluating(len(self.evaluation.task.eval_prompts)):
            return self.evaluation(step, grid_name, self.ema.swapped if use_ema else contextlib.nullcontext)
