"""Flow-GRPO's own SD3.5-Medium recipes as presets (configs/presets/sd35m_flow_grpo_*.yaml): each loads, cites the
config function and commit it reproduces, and holds that function's values (config/grpo.py over config/base.py,
with the LoRA and EMA settings of scripts/train_sd3.py and scripts/train_sd3_fast.py), value for value.

Where their config computes a value (images per epoch from 32 GPUs, per-GPU batches and gradient accumulation),
``_flow_grpo_epoch`` transcribes that arithmetic; the expected values below are theirs, not copied from the presets.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trainer.config import load_config

REPO = Path(__file__).resolve().parents[2]
COMMIT = "74db69191de9a0a54869c9c3341ce4b54db7005f"
"""yifan123/flow_grpo, the newest commit of config/grpo.py read (its SD3 recipes and train_sd3_fast.py)."""


def _flow_grpo_epoch(
    num_image_per_prompt: int,
    gpu_number: int = 32,
    train_batch_size: int = 9,
    unique_prompt_per_epoch: int | None = None,
    numerator: int = 48,
) -> tuple[int, int]:
    """(prompts an epoch, optimizer steps an epoch) as their config computes them: ``num_batches_per_epoch`` from
    math.lcm(k m, G b) / (G b) (the recipes with ``unique_prompt_per_epoch``) or int(numerator / (G b / k)) (the
    fast ones: 48 or 64), ``gradient_accumulation_steps`` = num_batches_per_epoch // 2 batches per optimizer step."""
    k, per_batch = num_image_per_prompt, gpu_number * train_batch_size
    if unique_prompt_per_epoch is not None:
        num_batches = math.lcm(k * unique_prompt_per_epoch, per_batch) // per_batch
    else:
        num_batches = int(numerator / (per_batch / k))
    accumulation = num_batches // 2
    return per_batch * num_batches // k, num_batches // accumulation


SHARED = {
    "model.name": "sd3",
    "model.resolution": 512,  # config.resolution
    "model.lora.rank": 32,  # LoraConfig(r=32, lora_alpha=64) in train_sd3.py / train_sd3_fast.py
    "model.lora.alpha": 64,
    "algorithm.name": "grpo",
    "algorithm.adv_clip": 5.0,  # base.py train.adv_clip_max
    "algorithm.global_std": True,  # sample.global_std
    "algorithm.drop_zero_advantage": True,  # the training scripts drop samples of zero advantage
    "algorithm.sampler.num_steps": 10,  # sample.num_steps
    "train.learning_rate": 3e-4,  # base.py train.learning_rate
    "train.weight_decay": 1e-4,  # train.adam_weight_decay
    "train.adam_betas": (0.9, 0.999),
    "train.max_grad_norm": 1.0,
    "train.ema_decay": 0.9,  # train.ema: EMAModuleWrapper(decay=0.9, update_step_interval=8)
    "train.ema_every": 8,
    "train.seed": 42,  # base.py seed
    "train.warmup_steps": 0,
    "train.checkpoint_every": 60,  # save_freq
    "eval.num_steps": 40,  # sample.eval_num_steps
    "eval.samples_per_prompt": 1,
    "eval.every": 60,  # eval_freq
}
"""What every SD3.5-M recipe of theirs sets alike."""

STANDARD = {
    "algorithm.group_size": 24,  # sample.num_image_per_prompt
    "algorithm.clip_range": 1e-4,  # base.py train.clip_range
    "algorithm.timestep_fraction": 0.99,  # train.timestep_fraction
    "algorithm.sampler.guidance_scale": 4.5,  # sample.guidance_scale, train.cfg true
    "algorithm.sampler.kind": "sde",  # sde_step_with_logprob's default sde_type
    "algorithm.sampler.noise_level": 0.7,  # base.py sample.noise_level
    "algorithm.sampler.sde_window": 0,  # every step stochastic: train_sd3.py has no window
    "eval.guidance_scale": 4.5,  # train_sd3.py evaluates with sample.guidance_scale
}
FAST = {
    "algorithm.clip_range": 1e-5,
    "algorithm.kl_beta": 0.0,
    "algorithm.timestep_fraction": 1.0,  # num_train_timesteps = sde_window_size
    "algorithm.sampler.guidance_scale": 1.0,  # sample.guidance_scale = 1, train.cfg = False
    "algorithm.sampler.kind": "cps_mse",  # sample.sde_type = "cps", scored -mean((x - mean)^2) as theirs
    "algorithm.sampler.noise_level": 0.8,
    "algorithm.sampler.sde_window": 3,  # sample.sde_window_size
    # window starts: randint(0, sde_window_range[1] - size) = 0..2, both ends inclusive; [lo, hi) here
    "algorithm.sampler.window_range": (0, 10 // 2 - 3 + 1),
    "eval.guidance_scale": 1.0,  # sample.eval_guidance_scale
}

RECIPES = {
    "sd35m_flow_grpo_pickscore.yaml": (
        "pickscore_sd3",
        24,
        48,
        {
            **STANDARD,
            "algorithm.kl_beta": 0.01,
            "reward.weights": {"pickscore": 1.0},
            "eval.batch_size": 16,
            "data.path": "data/flow_grpo/pickscore_train_prompts.txt",
            "eval.path": "data/flow_grpo/pickscore_test_prompts.txt",
        },
    ),
    "sd35m_flow_grpo_geneval.yaml": (
        "geneval_sd3",
        24,
        48,
        {
            **STANDARD,
            "algorithm.kl_beta": 0.04,
            "reward.weights": {"geneval_flow_grpo": 1.0},
            "eval.batch_size": 14,
            "data.path": "data/geneval/train_metadata.jsonl",
            "eval.path": "data/flow_grpo/geneval_test_metadata.jsonl",
        },
    ),
    "sd35m_flow_grpo_ocr.yaml": (
        "general_ocr_sd3",
        24,
        48,
        {
            **STANDARD,
            "algorithm.kl_beta": 0.04,
            "reward.weights": {"ocr_flow_grpo": 1.0},
            "eval.batch_size": 16,
            "data.path": "data/ocr/train_prompts.txt",
            "eval.path": "data/flow_grpo/ocr_test_prompts.txt",
        },
    ),
    "sd35m_flow_grpo_fast_geneval.yaml": (
        "geneval_sd3_fast_nocfg",
        24,
        None,
        {
            **FAST,
            "algorithm.group_size": 24,
            "reward.weights": {"geneval_flow_grpo": 1.0},
            "eval.batch_size": 14,
            "data.path": "data/geneval/train_metadata.jsonl",
            "eval.path": "data/flow_grpo/geneval_test_metadata.jsonl",
        },
    ),
    "sd35m_flow_grpo_fast_pickscore.yaml": (
        "pickscore_sd3_fast_nocfg",
        18,
        None,
        {
            **FAST,
            "algorithm.group_size": 18,
            "reward.weights": {"pickscore": 1.0},
            "eval.batch_size": 16,
            "data.path": "data/flow_grpo/pickscore_train_prompts.txt",
            "eval.path": "data/flow_grpo/pickscore_test_prompts.txt",
        },
    ),
}
"""Preset -> (their config function, num_image_per_prompt, unique_prompt_per_epoch or None, its values)."""


def _value(config, dotted: str):
    value = config
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


def test_every_flow_grpo_preset_is_checked():
    assert sorted(p.name for p in (REPO / "configs" / "presets").glob("sd35m_flow_grpo_*.yaml")) == sorted(RECIPES)


@pytest.mark.parametrize("preset", sorted(RECIPES))
def test_preset_holds_its_flow_grpo_recipes_values(preset):
    """Loaded with ``load_config``, the preset holds the cited function's values: theirs where they set them,
    config/base.py's elsewhere, and the epoch's prompts and optimizer steps their config's arithmetic gives
    (48 x 24 and 64 x 18 images: 1152 an epoch on 32 GPUs x 9 x 4 batches, 2 optimizer steps)."""
    function, images_per_prompt, unique_prompts, values = RECIPES[preset]
    path = REPO / "configs" / "presets" / preset
    config = load_config(str(path))
    header = " ".join(line[2:] for line in path.read_text().splitlines() if line.startswith("# "))
    assert f"yifan123/flow_grpo@{COMMIT} config/grpo.py `{function}`" in header, header
    prompts, steps = _flow_grpo_epoch(
        images_per_prompt,
        unique_prompt_per_epoch=unique_prompts,
        numerator=48 if images_per_prompt == 24 else 64,
    )
    expected = {**SHARED, **values, "data.prompts_per_epoch": prompts, "algorithm.steps_per_epoch": steps}
    for dotted, want in expected.items():
        got = _value(config, dotted)
        if isinstance(want, tuple):
            got = tuple(got)
        if dotted.endswith(".path"):
            assert Path(got) == Path(want) or str(got).endswith(want), (preset, dotted, got, want)
        else:
            assert got == want, (preset, dotted, got, want)
