"""configs/presets/sd3_grpo_guard_pickscore.yaml against what it cites: GRPO-Guard's authors publish no config, so
Flow-GRPO's SD3.5-M PickScore recipe (the framework their SD3.5-M runs extend) with the clip range of verl-omni's
GRPO-Guard script; each value of the preset equals the cited one."""

from __future__ import annotations

from pathlib import Path

from transcribed import Source, transcribes

from trainer.config import load_config

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "configs" / "presets" / "sd3_grpo_guard_pickscore.yaml"
FLOW_GRPO = Source("yifan123/flow_grpo", "ac4c86e8cae021841f1fde853d340e0db67690dd", "config/grpo.py", "pickscore_sd3")
VERL_OMNI_CLIP_RATIO = 2e-6
"""verl-project/verl-omni@a1139bafffb5b9711f0a6b6edff8ecaa60bfff30
examples/grpoguard_trainer/qwen_image/run_qwen_image_ocr_lora.sh: actor_rollout_ref.actor.diffusion_loss.clip_ratio."""


def _flow_grpo_pickscore_sd3() -> dict:
    """yifan123/flow_grpo@ac4c86e8 config/grpo.py pickscore_sd3 over config/base.py get_config, with
    scripts/train_sd3.py's LoraConfig and EMAModuleWrapper: the values of a run (32 GPUs there)."""
    gpu_number, train_batch_size, num_image_per_prompt = 32, 9, 24
    num_batches_per_epoch = int(48 / (gpu_number * train_batch_size / num_image_per_prompt))
    gradient_accumulation_steps = num_batches_per_epoch // 2
    return {
        "model": "stabilityai/stable-diffusion-3.5-medium",
        "resolution": 512,
        "lora_r": 32,
        "lora_alpha": 64,
        "num_steps": 10,
        "eval_num_steps": 40,
        "guidance_scale": 4.5,
        "noise_level": 0.7,
        "num_image_per_prompt": num_image_per_prompt,
        "global_std": True,
        "prompts_per_epoch": num_batches_per_epoch * gpu_number * train_batch_size // num_image_per_prompt,
        "optimizer_steps_per_epoch": num_batches_per_epoch // gradient_accumulation_steps,
        "num_inner_epochs": 1,
        "timestep_fraction": 0.99,
        "beta": 0.01,
        "clip_range": 1e-4,
        "adv_clip_max": 5,
        "learning_rate": 3e-4,
        "adam_weight_decay": 1e-4,
        "max_grad_norm": 1.0,
        "ema_decay": 0.9,
        "ema_update_step_interval": 8,
        "eval_freq": 60,
        "reward_fn": {"pickscore": 1.0},
        "train": "dataset/pickscore/train.txt",
        "test": "dataset/pickscore/test.txt",
    }


@transcribes("algorithm:grpo_guard", source=FLOW_GRPO)
def test_grpo_guard_preset_is_flow_grpos_pickscore_recipe_with_verl_omnis_clip():
    ref, config = _flow_grpo_pickscore_sd3(), load_config(str(PRESET))
    model, algo, sampler = config.model, config.algorithm, config.algorithm.sampler
    assert (model.name, model.resolution, model.lora.rank, model.lora.alpha) == (
        "sd3",
        ref["resolution"],
        ref["lora_r"],
        ref["lora_alpha"],
    )
    assert (algo.name, algo.reweight, sampler.kind) == ("grpo_guard", True, "sde")
    assert algo.clip_range == VERL_OMNI_CLIP_RATIO != ref["clip_range"]  # r~ is s_t times Flow-GRPO's log r
    assert (algo.group_size, algo.global_std, algo.unbiased_std) == (
        ref["num_image_per_prompt"],
        ref["global_std"],
        False,
    )
    assert (algo.kl_beta, algo.adv_clip, algo.timestep_fraction) == (
        ref["beta"],
        ref["adv_clip_max"],
        ref["timestep_fraction"],
    )
    assert (algo.steps_per_epoch, algo.inner_epochs) == (
        ref["optimizer_steps_per_epoch"],
        ref["num_inner_epochs"],
    )
    assert (sampler.num_steps, sampler.guidance_scale, sampler.noise_level, sampler.sde_window) == (
        ref["num_steps"],
        ref["guidance_scale"],
        ref["noise_level"],
        0,
    )
    train = config.train
    assert (train.learning_rate, train.weight_decay, train.max_grad_norm, train.adam_betas) == (
        ref["learning_rate"],
        ref["adam_weight_decay"],
        ref["max_grad_norm"],
        (0.9, 0.999),
    )
    assert (train.ema_decay, train.ema_every, train.warmup_steps) == (
        ref["ema_decay"],
        ref["ema_update_step_interval"],
        0,
    )
    assert config.data.prompts_per_epoch == ref["prompts_per_epoch"]
    assert dict(config.reward.weights) == ref["reward_fn"] and config.reward.combine_mode == "sum"
    # data/flow_grpo holds Flow-GRPO's dataset/ files unchanged (data/flow_grpo/README.md)
    assert config.data.path == "data/flow_grpo/pickscore_train_prompts.txt" and ref["train"].endswith("train.txt")
    assert config.eval.path == "data/flow_grpo/pickscore_test_prompts.txt" and ref["test"].endswith("test.txt")
    assert (
        config.eval.num_steps,
        config.eval.guidance_scale,
        config.eval.samples_per_prompt,
        config.eval.prompts,
        config.eval.every,
    ) == (ref["eval_num_steps"], ref["guidance_scale"], 1, 0, ref["eval_freq"])
    assert (REPO / config.data.path).is_file() and (REPO / config.eval.path).is_file()
