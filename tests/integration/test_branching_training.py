"""Branching rollouts in the trainer: a group shares its prefix, the first optimizer step's ratio is exactly 1, and
an epoch's rollout is a function of its generators (so a resumed run redraws it bit for bit)."""

from __future__ import annotations

import json

import pytest
import torch
from warm_start import tiny_trainer

from trainer.algorithms.base import Rewards

SAMPLERS = {
    "branch": [
        "algorithm.sampler.sde_window=1",
        "algorithm.sampler.window_range=[1,2]",
        "algorithm.sampler.branch=true",
    ],
    "tree": [
        "algorithm.sampler.sde_window=0",
        "algorithm.sampler.window_range=[0,0]",
        "algorithm.sampler.tree=[2,2]",
        "algorithm.sampler.tree_steps=[1,2]",
    ],
}


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_branching_rollout_trains_on_policy_and_redraws_exactly(tmp_path, tiny_model_dir, sampler):
    trainer = tiny_trainer(
        tmp_path,
        tiny_model_dir,
        "algorithm.name=grpo",
        "algorithm.group_size=4",
        "algorithm.sampler.num_steps=4",
        *SAMPLERS[sampler],
        "data.prompts_per_epoch=2",
        "train.warmup_steps=0",
        "train.epochs=1",
        "eval.every=0",
        "logging.progress=false",
        log=False,
    )
    indices, group_ids = trainer.sampler.epoch(0)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]
    draw = lambda: trainer.sample_and_score(  # noqa: E731
        prompts, indices, group_ids, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    )
    (ro, result, _), (again, _, _) = draw(), draw()
    assert torch.equal(ro.latents, again.latents) and torch.equal(ro.log_probs, again.log_probs)
    # both split first at step 1: the latents before it (indices 0, 1) are the group's one row
    assert torch.equal(ro.latents[0, :2].expand(3, -1, -1, -1, -1), ro.latents[1:4, :2])
    assert not torch.equal(ro.latents[0, -1], ro.latents[1, -1])
    expected = {"branch": 2 * (2 + 4 * 2), "tree": 2 * (1 + 1 + 2 + 4)}[sampler]  # both: steps 0, 1 on one row
    assert ro.forwards == expected

    rewards = torch.tensor(result.combined, dtype=torch.float32)
    batch = trainer.algorithm.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    units = trainer.algorithm.plan(batch, torch.Generator().manual_seed(3))[0]
    stats = [trainer.algorithm.loss(trainer.ctx, unit)[1] for unit in units]
    assert all(float(s["ratio"]) == 1.0 and float(s["approx_kl"]) == 0.0 for s in stats)
    assert max(float(s["logp_gap"]) for s in stats) < 1e-3  # the rollout's shared forwards and the training's agree


def _fit(run_dir, model_dir, sampler, resume_from=None) -> tuple[dict, list[torch.Tensor]]:
    """Two RL epochs of GRPO with ``sampler`` (two optimizer steps each: the second is off-policy), checkpointed
    after each; from ``resume_from``'s checkpoint when given. Returns the last RL record and the weights."""
    trainer = tiny_trainer(
        run_dir,
        model_dir,
        "algorithm.name=grpo",
        "algorithm.group_size=4",
        "algorithm.sampler.num_steps=4",
        "algorithm.steps_per_epoch=2",
        *SAMPLERS[sampler],
        "data.prompts_per_epoch=2",
        "train.warmup_steps=0",
        "train.epochs=2",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=0",
        "eval.every=0",
        "logging.progress=false",
    )
    if resume_from is not None:
        trainer.resume(resume_from / "checkpoints" / "step-000000-000001")
    trainer.fit()
    trainer.logger.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["phase"] == "rl"][-1]
    return {k: v for k, v in last.items() if not k.startswith(("time", "images_per_s", "rollout_images_per_s"))}, [
        p.detach().clone() for p in trainer.adapter.trainable.parameters()
    ]


@pytest.mark.slow
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_a_resumed_branching_run_repeats_the_epoch_bit_for_bit(tmp_path, tiny_model_dir, sampler):
    full, weights = _fit(tmp_path / "full", tiny_model_dir, sampler)
    resumed, resumed_weights = _fit(tmp_path / "resumed", tiny_model_dir, sampler, resume_from=tmp_path / "full")
    assert full == resumed
    assert full["rollout_forwards_per_image"] == {"branch": 10 / 4, "tree": 8 / 4}[sampler]  # per prompt / 4 images
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed_weights, strict=True))
