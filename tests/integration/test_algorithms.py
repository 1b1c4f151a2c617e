"""Every registered algorithm trains through the one Trainer, and its own state (critic, refreshed
reference, EMA) survives a checkpoint: a resumed run repeats the uninterrupted run's numbers exactly."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from warm_start import tiny_trainer

from reward_server.inprocess import InProcessRewardClient
from trainer.algorithms import ALGORITHMS, build_algorithm
from trainer.algorithms.base import Rewards, balance_ranks
from trainer.algorithms.sft import SFT
from trainer.config import load_config
from trainer.data import DigitsTask
from trainer.distributed import SingleProcess
from trainer.logging import RunLogger
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
from trainer.trainer import Trainer

EXPECTED_STATS = {
    "grpo": "clip_frac",
    "ppo": "clip_frac",
    "ppo_critic": "value_loss",
    "dpo": "dpo_margin",
    "sft_best": "sft_loss",
    "nft": "nft_loss",
    "grpo_guard": "clip_frac",
    "mixgrpo": "clip_frac",
    "awm": "matching_loss",
    "dgpo": "dgpo_loss",
    "refl": "reward_loss",
    "draft": "reward_loss",
    "drtune": "reward_loss",
}


def _trainer(run_dir: Path, model_dir: str, algorithm: str, *extra: str) -> Trainer:
    return tiny_trainer(
        run_dir,
        model_dir,
        f"algorithm.name={algorithm}",
        "algorithm.group_size=4",
        "algorithm.sampler.num_steps=4",
        "algorithm.sampler.window_range=[0,2]",
        "data.prompts_per_epoch=4",
        "train.warmup_steps=2",
        "warmup.batch_size=8",
        "train.epochs=3",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=0",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "eval.every=0",
        "train.ema_decay=0.5",
        "logging.progress=false",
        *extra,
    )


def _rl_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


def test_every_algorithm_is_covered():
    assert set(ALGORITHMS) == set(EXPECTED_STATS)


# The clipped ones take two optimizer steps per rollout batch: with one, the ratio is 1 and its statistics are
# not shown (tests/unit/test_scoreboard.py).
OFF_POLICY = {
    name: ("algorithm.steps_per_epoch=2",) for name in ("grpo", "ppo", "ppo_critic", "grpo_guard", "mixgrpo", "awm")
}


@pytest.mark.parametrize("algorithm", sorted(EXPECTED_STATS))
def test_algorithm_trains_and_resumes_exactly(tmp_path, tiny_model_dir, algorithm):
    trainer = _trainer(tmp_path / "full", tiny_model_dir, algorithm, "train.epochs=2", *OFF_POLICY.get(algorithm, ()))
    before = [p.detach().clone() for p in trainer.adapter.trainable.parameters()]
    trainer.fit()
    trainer.logger.close()
    full = _rl_records(tmp_path / "full")
    assert len(full) == 2
    for record in full:
        assert math.isfinite(record[EXPECTED_STATS[algorithm]]) and math.isfinite(record["grad_norm"])
        assert EXPECTED_STATS[algorithm] in trainer.algorithm.shown_metrics
        assert all(math.isfinite(record[k]) for k in trainer.algorithm.shown_metrics)  # the progress line's
        assert record["time_train_s"] > 0 and 0 < record["images_per_s"] < record["rollout_images_per_s"]
    changed = [not torch.equal(a, b) for a, b in zip(before, trainer.adapter.trainable.parameters(), strict=True)]
    assert any(changed)

    # a second run resumes from the checkpoint after epoch 1 (the algorithm's state moved by a whole epoch: a
    # refreshed reference, a trained critic, the EMA, MixGRPO's window) and must reproduce epoch 2 exactly
    checkpoint = tmp_path / "full" / "checkpoints" / "step-000002-000001"
    assert checkpoint.is_dir()
    resumed = _trainer(
        tmp_path / "resumed", tiny_model_dir, algorithm, "train.epochs=2", *OFF_POLICY.get(algorithm, ())
    )
    resumed.resume(checkpoint)
    resumed.fit()
    resumed.logger.close()
    (last,) = _rl_records(tmp_path / "resumed")
    drop = {
        "time",
        "time_rollout_s",
        "time_reward_wait_s",
        "time_train_s",
        "time_epoch_s",
        "time_epoch_cpu_s",
        "images_per_s",
        "rollout_images_per_s",
    }
    assert {k: v for k, v in last.items() if k not in drop} == {k: v for k, v in full[1].items() if k not in drop}
    for a, b in zip(trainer.adapter.trainable.parameters(), resumed.adapter.trainable.parameters(), strict=True):
        assert torch.equal(a, b)

    # train.init_from takes only the weights of a checkpoint (here the final one): equal weights, fresh progress
    started = _trainer(tmp_path / "init", tiny_model_dir, algorithm, *OFF_POLICY.get(algorithm, ()))
    started.init_from(tmp_path / "full" / "checkpoints" / "step-000002-000002")
    assert started.progress.epochs_done == 0
    assert started.progress.warmup_steps_done == 2  # taken as warmed up: train.warmup_after_init is off
    for a, b in zip(trainer.adapter.trainable.parameters(), started.adapter.trainable.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("algorithm", ["grpo_guard", "mixgrpo", "awm", "dgpo"])
def test_the_first_step_of_an_epoch_is_on_policy(tmp_path, tiny_model_dir, algorithm):
    """Before the first update the policy is the sampling policy (and DGPO's reference and EMA policy): every
    unit's ratio is exactly 1 (GRPO-Guard's normalised one included), DGPO's preference weight exactly 1/2. GRPO-Guard's
    rollout keeps each step's mean (x_next itself at ODE steps); MixGRPO's SDE steps are its window of the
    epoch, which moves one step per epoch and shrinks as it reaches step T - 2."""
    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        algorithm,
        "data.prompts_per_epoch=2",
        "train.warmup_steps=0",
        "algorithm.sampler.sde_window=2",
    )
    trainer._new_reference()  # as RL starts
    indices, group_ids = trainer.sampler.epoch(0)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]
    for epoch in (1, 0):
        trainer.algorithm.start_epoch(trainer.ctx, epoch)
        ro, result, _ = trainer.sample_and_score(
            prompts, indices, group_ids, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        )
        if algorithm == "mixgrpo":  # 4 steps, a window of 2 that starts at the epoch's step and ends before step 2
            assert ro.stochastic.tolist() == [epoch <= i < 2 for i in range(4)]
    assert (ro.means is not None) == (algorithm == "grpo_guard")
    if ro.means is not None:
        ode = ~ro.stochastic
        assert torch.equal(ro.means[:, ode], ro.latents[:, 1:][:, ode]) and ode.any()
        assert not torch.equal(ro.means[:, ro.stochastic], ro.latents[:, 1:][:, ro.stochastic])
    rewards = (torch.arange(len(indices)) % 3) / 2.0  # a spread in every group of 4
    batch = trainer.algorithm.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    (units,) = trainer.algorithm.plan(batch, torch.Generator().manual_seed(2))
    for unit in units:
        _, stats = trainer.algorithm.loss(trainer.ctx, unit)
        if algorithm == "dgpo":  # the EMA policy starts at the policy: no denoising loss clipped
            assert stats["dgpo_weight"].item() == 0.5 and stats["clip_frac"].item() == 0.0
        elif algorithm == "awm":  # v_old is the policy's own forward (no copy of it) until the first step
            assert stats["ratio"].item() == 1.0 and stats["approx_kl"].item() == 0.0 and stats["ema_kl"].item() == 0.0
        else:  # the rollout's own log-probs equal the re-evaluation's
            assert stats["ratio"].item() == 1.0 and stats["logp_gap"].item() == 0.0


def test_mixgrpo_flash_compresses_the_steps_after_its_window_and_stays_on_policy(tmp_path, tiny_model_dir):
    """MixGRPO-Flash (second-order, compressed ODE steps after the window): the window and the steps before it
    are MixGRPO's, sample for sample, and the first update's ratio is exactly 1 at every trained step."""
    flash = ("algorithm.sampler.ode_order=2", "algorithm.sampler.ode_compress=0.5")
    rollouts = {}
    for name, extra in (("plain", ()), ("flash", flash)):
        trainer = _trainer(
            tmp_path / name,
            tiny_model_dir,
            "mixgrpo",
            "data.prompts_per_epoch=2",
            "train.warmup_steps=0",
            "algorithm.sampler.num_steps=8",
            *extra,
        )
        indices, group_ids = trainer.sampler.epoch(0)
        prompts = [trainer.task.prompts[i] for i in indices.tolist()]
        trainer.algorithm.start_epoch(trainer.ctx, 1)  # the window: steps 1 and 2 of 8
        ro, _, _ = trainer.sample_and_score(
            prompts, indices, group_ids, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        )
        rollouts[name] = ro
    plain, ro = rollouts["plain"], rollouts["flash"]
    assert ro.stochastic.tolist() == [False, True, True, False, False]  # 5 steps after the window -> 2
    assert torch.equal(ro.sigmas, plain.sigmas[[0, 1, 2, 3, 5, 8]])
    assert torch.equal(ro.latents[:, :4], plain.latents[:, :4]) and torch.equal(
        ro.log_probs[:, :3], plain.log_probs[:, :3]
    )
    assert not torch.equal(ro.latents[:, -1], plain.latents[:, -1])
    rewards = (torch.arange(len(indices)) % 3) / 2.0
    batch = trainer.algorithm.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    (units,) = trainer.algorithm.plan(batch, torch.Generator().manual_seed(2))
    assert {int(s) for unit in units for s in unit.steps} == {1, 2}
    for unit in units:
        _, stats = trainer.algorithm.loss(trainer.ctx, unit)
        assert stats["ratio"].item() == 1.0 and stats["logp_gap"].item() == 0.0


def test_evaluation_before_rl_reads_the_warmed_up_weights_with_an_ema(tmp_path, tiny_model_dir):
    """The EMA restarts at the warmed-up weights before the first evaluation swaps it in: that evaluation
    must equal one without an EMA (it once evaluated the untrained initial weights)."""
    evals = {}
    for decay in ("0.5", "0"):
        trainer = _trainer(
            tmp_path / decay,
            tiny_model_dir,
            "grpo",
            "train.warmup_steps=20",
            "train.epochs=0",
            f"train.ema_decay={decay}",
        )
        trainer.fit()
        trainer.logger.close()
        lines = (tmp_path / decay / "metrics.jsonl").read_text().splitlines()
        evals[decay] = [r for r in map(json.loads, lines) if r["phase"] == "eval"][0]
    drop = {"time"}
    assert {k: v for k, v in evals["0.5"].items() if k not in drop} == {
        k: v for k, v in evals["0"].items() if k not in drop
    }


@pytest.mark.parametrize(
    ("resumed", "message"),
    [
        (["algorithm.name=grpo"], "optimizers, this run has 0: resume with the algorithm the checkpoint was made with"),
        (
            ["algorithm.critic_hidden=16"],
            r"holds \(256, \d+\) for critic.mlp.0.weight on rank 0, where this run's shard is "
            r"\(16, \d+\): resume with the algorithm settings",
        ),
    ],
)
def test_a_checkpoint_of_other_algorithm_settings_is_refused(tmp_path, tiny_model_dir, resumed, message):
    """A run with a critic resumed without one, or with a critic of another size: the error names the fix."""
    trainer = _trainer(tmp_path / "critic", tiny_model_dir, "ppo_critic", "train.warmup_steps=0", "train.epochs=1")
    trainer.fit()
    trainer.logger.close()
    other = _trainer(
        tmp_path / "other", tiny_model_dir, "ppo_critic", "train.warmup_steps=0", "train.epochs=1", *resumed
    )
    with pytest.raises(ValueError, match=message):
        other.resume(trainer.checkpoints.latest())


@pytest.mark.parametrize("algorithm", sorted(EXPECTED_STATS))
def test_a_steps_loss_is_the_same_whatever_micro_batches_cut_it(tmp_path, tiny_model_dir, algorithm):
    """The units of an optimizer step sum to one mean over all of its samples: cut into micro-batches of
    unequal sizes (6 samples by 4, or 3 pairs / chosen samples by 2), the step's loss and gradient are those
    of one micro-batch. Before units were scaled by their share, a last micro-batch of 1 counted as much as one of
    2, and best-of-group SFT normalised its advantage weights per micro-batch (uniform at size 1)."""
    weighted = ["algorithm.weighting=advantage"] if algorithm == "sft_best" else []  # weights that differ
    trainer = _trainer(
        tmp_path, tiny_model_dir, algorithm, "algorithm.group_size=2", "data.prompts_per_epoch=3", *weighted
    )
    g = torch.Generator().manual_seed(0)
    indices, group_ids = trainer.sampler.epoch(0)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]
    if trainer.algorithm.needs_reference:
        trainer._new_reference()  # as RL starts (DGPO and NFT keep it; DPO and AWM refresh it from the policy)
    trainer.algorithm.start_epoch(trainer.ctx, 0)
    ro, _, _ = trainer.sample_and_score(prompts, indices, group_ids, g, torch.Generator().manual_seed(1))
    local = torch.tensor([0.0, 1.0, 0.2, 0.3, 0.5, 0.1])  # groups' advantage weights differ (sft_best)
    rewards = Rewards(local, local, group_ids, 0)

    def step(micro_batch_size: int) -> tuple[float, list[torch.Tensor], int]:
        algo = trainer.algorithm
        algo.config.micro_batch_size = micro_batch_size
        (units,) = algo.plan(algo.make_batch(ro, rewards), torch.Generator().manual_seed(2))
        trainer.policy.zero_grad()
        total = sum(algo.loss(trainer.ctx, unit)[0] for unit in units)
        total.backward()
        return float(total.detach()), [p.grad.clone() for p in trainer.adapter.trainable.parameters()], len(units)

    whole, whole_grads, whole_units = step(64)
    cut, cut_grads, cut_units = step(2 if trainer.algorithm.local_groups else 4)
    assert cut_units > whole_units
    assert cut == pytest.approx(whole, rel=1e-5, abs=1e-6)
    for a, b in zip(cut_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["dpo", "sft_best", "nft"])
def test_every_sample_weighs_the_same_on_every_rank(tmp_path, tiny_model_dir, algorithm):
    """Two ranks' plans of one gathered batch, where rank 1 holds fewer samples that count (one group with a
    reward spread, so fewer pairs / chosen samples and more padding; for NFT, failed rewards). The backends
    average the ranks' gradients, so a unit's weight in the step is share / 2; after ``balance_ranks`` it is
    w_u / (sum of w over both ranks), as in one process (w: 1 per pair or sample that counts, or best-of-group
    SFT's advantage weight). Normalised per rank alone, rank 1's samples weighed up to 3x rank 0's."""
    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        algorithm,
        "algorithm.group_size=2",
        "data.prompts_per_epoch=3",
        "algorithm.micro_batch_size=1",
        "algorithm.steps_per_epoch=1",
        *(["algorithm.weighting=advantage"] if algorithm == "sft_best" else []),
    )
    g = torch.Generator().manual_seed(0)
    indices, group_ids = trainer.sampler.epoch(0)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]
    trainer.algorithm.start_epoch(trainer.ctx, 0)
    ro, _, _ = trainer.sample_and_score(prompts, indices, group_ids, g, torch.Generator().manual_seed(1))
    nan = float("nan")
    every = torch.tensor(
        [0.0, 1.0, 0.7, 0.2, 0.4, 0.9]
        + ([0.5, 0.5, 0.3, 0.3, 0.1, 0.8] if algorithm != "nft" else [0.5, nan, 0.3, nan, nan, 0.8])
    )
    group_ids_all = torch.arange(12) // 2
    steps = [
        trainer.algorithm.plan(
            trainer.algorithm.make_batch(ro, Rewards(every[6 * r : 6 * r + 6], every, group_ids_all, 6 * r)),
            torch.Generator().manual_seed(2 + r),
        )
        for r in (0, 1)
    ]
    assert [len(s) for s in steps] == [1, 1]
    weights = [[unit.share * unit.step_weight for unit in s[0]] for s in steps]  # each unit's weight w_u
    assert sum(w > 0 for w in weights[1]) < sum(w > 0 for w in weights[0])
    step_weights = [torch.tensor([[units[0].step_weight] for units in s], dtype=torch.float64) for s in steps]
    for s in steps:
        balance_ranks(s, lambda local: torch.cat(step_weights))
    total = sum(map(sum, weights))
    for s, w in zip(steps, weights, strict=True):
        assert [unit.share / 2 for unit in s[0]] == pytest.approx([x / total for x in w], rel=1e-6)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "ppo_critic"])
def test_steps_that_do_not_split_the_batch_are_refused_as_the_trainer_is_built(tmp_path, tiny_model_dir, algorithm):
    """16 samples per rank in 3 steps failed at the first update: after the whole warm-up and a rollout."""
    with pytest.raises(
        ValueError,
        match=r"16 samples per rank do not split into 3 optimizer steps: make the per-rank "
        r"batch \(data.prompts_per_epoch x algorithm.group_size / ranks\)",
    ):
        _trainer(tmp_path, tiny_model_dir, algorithm, "algorithm.steps_per_epoch=3")
    _trainer(tmp_path / "ok", tiny_model_dir, algorithm, "algorithm.steps_per_epoch=4")


def test_an_unsharded_ema_is_checkpointed_once_resumes_on_any_rank_and_exports(tmp_path, tiny_model_dir):
    """Kept per rank, a DDP run's EMA could not be resumed on more ranks (the new ranks found none), and the
    EMA weights the run evaluated with could not be exported at all."""
    from safetensors.torch import load_file

    from trainer.export import export_checkpoint

    trainer = _trainer(tmp_path / "run", tiny_model_dir, "grpo", "train.epochs=1")
    trainer.fit()
    trainer.logger.close()
    checkpoint = trainer.checkpoints.latest()
    assert (checkpoint / "ema.safetensors").is_file()
    shutil.rmtree(checkpoint / "rank-00000")  # as a rank the writing run did not have finds it
    resumed = _trainer(tmp_path / "resumed", tiny_model_dir, "grpo", "train.epochs=1")
    resumed.resume(checkpoint)
    for a, b in zip(resumed.ema.shadow, trainer.ema.shadow, strict=True):
        assert torch.equal(a, b)
    assert any(
        not torch.equal(s, p.float())
        for s, p in zip(trainer.ema.shadow, trainer.adapter.trainable.parameters(), strict=True)
    )

    export_checkpoint(checkpoint, tmp_path / "exported", ema=True)
    exported = load_file(tmp_path / "exported" / "diffusion_pytorch_model.safetensors")
    names = [n for n, p in trainer.adapter.denoiser.named_parameters() if p.requires_grad]
    for name, shadow in zip(names, trainer.ema.shadow, strict=True):
        torch.testing.assert_close(exported[name].float(), shadow, rtol=0, atol=0)

    # checkpoints written before kept it per rank: rank 0's is whole there and exports the same
    old = shutil.copytree(checkpoint, tmp_path / "old-layout")
    (old / "rank-00000").mkdir()
    (old / "ema.safetensors").rename(old / "rank-00000" / "ema.safetensors")
    export_checkpoint(old, tmp_path / "exported-old", ema=True)
    again = load_file(tmp_path / "exported-old" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(again[name], exported[name]) for name in names)


def test_a_warmup_steps_loss_is_the_same_whatever_micro_batches_cut_it(tiny_model_dir):
    """5 supervised samples in micro-batches of 2 (2, 2, 1): the same loss and gradient as in one."""
    from trainer.algorithms.base import LossContext
    from trainer.algorithms.sft import SFTConfig

    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    data = DigitsTask(16).supervised_batch(5, torch.Generator().manual_seed(0))
    results = []
    for micro_batch_size in (64, 2):
        sft = SFT(SFTConfig(batch_size=5, micro_batch_size=micro_batch_size))
        batch = sft.data_batch(adapter, data.images, data.prompts, torch.Generator().manual_seed(1))
        (units,) = sft.plan(batch, torch.Generator().manual_seed(2))
        adapter.denoiser.zero_grad()
        total = sum(sft.loss(LossContext(adapter, adapter.denoiser, None), unit)[0] for unit in units)
        total.backward()
        results.append((len(units), float(total.detach()), [p.grad.clone() for p in adapter.trainable.parameters()]))
    (whole_units, whole, whole_grads), (cut_units, cut, cut_grads) = results
    assert (whole_units, cut_units) == (1, 3)
    assert cut == pytest.approx(whole, rel=1e-5)
    for a, b in zip(cut_grads, whole_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["dpo", "sft_best"])
def test_an_epoch_without_any_reward_spread_makes_no_step(tmp_path, tiny_model_dir, algorithm):
    """Every group flat (e.g. a binary reward no sample earns yet): no pair or best sample anywhere, so no
    update; it used to run the denoiser on an empty batch, which stopped the job with a reshape error."""
    trainer = _trainer(tmp_path, tiny_model_dir, algorithm, "algorithm.group_size=2", "data.prompts_per_epoch=2")
    indices, group_ids = trainer.sampler.epoch(0)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]
    trainer.algorithm.start_epoch(trainer.ctx, 0)
    ro, _, _ = trainer.sample_and_score(
        prompts, indices, group_ids, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    )
    flat = torch.ones(len(indices))
    before = [p.detach().clone() for p in trainer.adapter.trainable.parameters()]
    stats = trainer._update(
        trainer.algorithm,
        trainer.algorithm.make_batch(ro, Rewards(flat, flat, group_ids, 0)),
        torch.Generator().manual_seed(2),
    )
    assert stats == {}
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.adapter.trainable.parameters(), strict=True))


class PromptOnly:
    """A scorer blind to the images: the digit its prompt asks for, over 10 (a scorer bug, or a reward read off
    metadata alone)."""

    name, description, score_range, version = "digit", "the prompt's digit / 10", (0.0, 1.0), "prompt-only"

    def load(self) -> None:
        """Nothing to load."""

    def score(self, images, prompts, metadata) -> list[float]:
        return [int(prompt[-1]) / 10 for prompt in prompts]


def _one_epoch_scored_by(trainer: Trainer, scorers: dict) -> dict:
    """``trainer``'s one-epoch job with its RL rewards from ``scorers`` (weight 1 each; the evaluation keeps the
    client it shares with the trainer); the epoch's record."""
    client = trainer.reward_client = InProcessRewardClient(scorers, dict.fromkeys(scorers, 1.0))
    try:
        trainer.fit()
    finally:
        client.close()
    trainer.logger.close()
    (record,) = _rl_records(trainer.logger.run_dir)
    return record


def test_rewards_that_do_not_tell_a_groups_images_apart_are_reported(tmp_path, tiny_model_dir, capsys):
    """Rewards that differ between prompts but not within any group: the epoch's reward has a spread, yet every
    group-relative advantage is 0. The record's zero_std_share is 1 and the epoch line says so; with the digit
    classifier's rewards (which do tell images apart) it does not."""
    trainer = _trainer(
        tmp_path / "blind", tiny_model_dir, "grpo", "train.warmup_steps=0", "train.epochs=1", "data.prompts_per_epoch=3"
    )
    record = _one_epoch_scored_by(trainer, {"digit": PromptOnly()})
    assert record["zero_std_share"] == 1.0 and record["reward_std"] > 0
    assert "no group's rewards differ: nothing to learn from them" in capsys.readouterr().out
    seeing = _trainer(tmp_path / "seeing", tiny_model_dir, "grpo", "train.warmup_steps=0", "train.epochs=1")
    seeing.fit()
    seeing.logger.close()
    (record,) = _rl_records(tmp_path / "seeing")
    assert record["zero_std_share"] < 1.0 and "nothing to learn" not in capsys.readouterr().out


def test_an_epoch_that_waits_long_for_rewards_says_so(tmp_path, tiny_model_dir, capsys):
    """Scorers slower than sampling (the sleep scorer holds each batch 1.5 s; the tiny model samples the epoch's
    8 images in a fraction of that): the devices idle after sampling, and the epoch line says how long and why;
    with the digit classifier, which scores as fast as the model samples, it does not."""
    from reward_server.sleep_scorer import SleepScorer

    job = ("grpo", "train.warmup_steps=0", "train.epochs=1", "data.prompts_per_epoch=2", "train.rollout_chunks=1")
    record = _one_epoch_scored_by(
        _trainer(tmp_path / "slow", tiny_model_dir, *job), {"sleep": SleepScorer(ms_per_batch=1500)}
    )
    assert record["time_reward_wait_s"] > 0.25 * record["time_epoch_s"]
    assert "of the epoch for rewards after sampling: the reward servers score slower" in capsys.readouterr().out
    fast = _trainer(tmp_path / "fast", tiny_model_dir, *job)
    fast.fit()
    fast.logger.close()
    (record,) = _rl_records(tmp_path / "fast")
    assert "for rewards after sampling" not in capsys.readouterr().out, record["time_reward_wait_s"]


def test_warmup_images_of_another_size_than_the_model_generates_are_refused(tiny_model_dir):
    """data.image_size=24 with a 16-pixel model: the warm-up trained at 24x24 what RL then sampled at 16x16."""
    from trainer.algorithms.sft import SFTConfig

    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    data = DigitsTask(24).supervised_batch(2, torch.Generator().manual_seed(0))
    with pytest.raises(
        ValueError,
        match=r"supervised images of \(24, 24\) pixels encode to latents \(1, 24, 24\), but "
        r"the model generates \(1, 16, 16\).*set data.image_size",
    ):
        SFT(SFTConfig(batch_size=2)).data_batch(adapter, data.images, data.prompts, torch.Generator().manual_seed(1))


def test_a_config_made_in_python_is_checked_as_a_files_is(tmp_path, tiny_model_dir):
    """Ranges were checked only when a config was read from YAML or overrides; one built with dataclasses
    went through with a negative learning rate (or a zero batch size) until something failed deep inside."""
    import dataclasses

    from trainer.config import ConfigError

    config = load_config(overrides=[f"model.path={tiny_model_dir}", "logging.progress=false"])
    bad = dataclasses.replace(config, train=dataclasses.replace(config.train, learning_rate=-1.0))
    with pytest.raises(ConfigError, match=r"train.learning_rate=-1.0 must be >= 0"):
        Trainer(
            bad,
            SD3Adapter(TinyConfig(path=tiny_model_dir)),
            build_algorithm(config.algorithm),
            SFT(config.warmup),
            DigitsTask(16),
            InProcessRewardClient.from_names({"digit": 1.0}),
            SingleProcess(torch.device("cpu")),
            RunLogger(tmp_path, True, False),
        )
