"""configs/presets/flux_mixgrpo_multi_reward.yaml against MixGRPO's own FLUX recipe (the authors publish no other):
each value of the preset equals the one of their training script, its training code's constants and their
inference script, or is a departure docs/departures.md lists (asserted here as such)."""

from __future__ import annotations

from pathlib import Path

from transcribed import Source, transcribes

from trainer.config import load_config

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "configs" / "presets" / "flux_mixgrpo_multi_reward.yaml"
SCRIPT = Source(
    "Tencent-Hunyuan/MixGRPO",
    "e5cdd6a427778d8c8b2e7a48ce16972141adbe7c",
    "scripts/finetune/finetune_flux_grpo_MixGRPO.sh",
    "torchrun fastvideo/train_grpo_flux.py arguments",
)
SCORERS = {
    "HPSClipRewardModel": "hpsv2",
    "ImageRewardModel": "imagereward",
    "PickScoreRewardModel": "pickscore",
}
"""train_grpo_flux.py main's reward models for reward_model="multi_reward" (UnifiedReward only with a URL, None
there) -> our scorers."""


def _mixgrpo_flux_recipe() -> dict:
    """Tencent-Hunyuan/MixGRPO@e5cdd6a4: scripts/finetune/finetune_flux_grpo_MixGRPO.sh's variables and torchrun
    arguments; fastvideo/train_grpo_flux.py's guidance embedding (3.5 in sampling and training) and reward weights;
    scripts/inference/inference_flux.sh's evaluation (fastvideo/sample/sample_flux.py: guidance 3.5, one image
    per test prompt)."""
    return {
        "sampling_steps": 25,
        "eta": 0.7,
        "flow_grpo_sampling": True,
        "kl_coeff": 0.0,
        "iters_per_group": 25,
        "group_size": 4,
        "sample_strategy": "progressive",
        "prog_overlap": True,
        "prog_overlap_step": 1,
        "roll_back": True,
        "training_strategy": "part",
        "gradient_accumulation_steps": 3,
        "learning_rate": 1e-5,
        "weight_decay": 1e-4,
        "max_grad_norm": 1.0,
        "num_generations": 12,
        "use_group": True,
        "h": 720,
        "w": 720,
        "clip_range": 1e-4,
        "adv_clip_max": 5.0,
        "max_train_steps": 300,
        "checkpointing_steps": 50,
        "train_batch_size": 1,
        "nnodes": 4,
        "nproc_per_node": 8,
        "mixed_precision": "bf16",
        "guidance": 3.5,
        "weights": {"HPSClipRewardModel": 1.0, "ImageRewardModel": 1.0, "PickScoreRewardModel": 1.0},
        "multi_reward_mix": "advantage_aggr",
        "train_prompts": "data/prompts.txt",
        "eval_prompts": "data/prompts_test.txt",
        "total_sampling_steps": 50,
        "eval_guidance": 3.5,
    }


@transcribes("algorithm:mixgrpo", source=SCRIPT)
def test_mixgrpo_preset_is_the_authors_flux_recipe():
    ref, config = _mixgrpo_flux_recipe(), load_config(str(PRESET))
    model, algo, sampler, train = config.model, config.algorithm, config.algorithm.sampler, config.train
    assert (model.name, model.lora, model.resolution) == ("flux", None, ref["h"]) and ref["h"] == ref["w"]
    assert (model.dtype, config.parallel.backend, config.parallel.param_dtype) == (
        "float32",
        "fsdp2",
        "bfloat16",
    )
    assert algo.name == "mixgrpo" and ref["training_strategy"] == "part" and ref["sample_strategy"] == "progressive"
    assert (sampler.num_steps, sampler.noise_level, sampler.kind) == (
        ref["sampling_steps"],
        ref["eta"],
        "sde",
    )
    assert ref["flow_grpo_sampling"] and sampler.guidance_scale == ref["guidance"]
    assert (sampler.sde_window, algo.shift_every, algo.wrap) == (
        ref["group_size"],
        ref["iters_per_group"],
        ref["roll_back"],
    )
    assert ref["prog_overlap"] and algo.stride == ref["prog_overlap_step"]
    assert (sampler.ode_order, sampler.ode_compress, algo.timestep_fraction) == (
        1,
        1.0,
        1.0,
    )  # no DPM, whole window
    assert (algo.group_size, algo.global_std, algo.unbiased_std) == (
        ref["num_generations"],
        not ref["use_group"],
        True,
    )
    assert (algo.clip_range, algo.adv_clip, algo.kl_beta) == (
        ref["clip_range"],
        ref["adv_clip_max"],
        ref["kl_coeff"],
    )
    assert config.data.prompts_per_epoch == ref["train_batch_size"] * ref["nnodes"] * ref["nproc_per_node"]
    per_gpu = ref["train_batch_size"] * ref["num_generations"]
    assert algo.steps_per_epoch == per_gpu // ref["gradient_accumulation_steps"] and algo.inner_epochs == 1
    assert (train.learning_rate, train.weight_decay, train.max_grad_norm, train.adam_betas) == (
        ref["learning_rate"],
        ref["weight_decay"],
        ref["max_grad_norm"],
        (0.9, 0.999),
    )
    assert (train.epochs, train.checkpoint_every, train.ema_decay, train.warmup_steps) == (
        ref["max_train_steps"],
        ref["checkpointing_steps"],
        0.0,
        0,
    )
    assert dict(config.reward.weights) == {SCORERS[k]: w for k, w in ref["weights"].items()}
    # their advantage_aggr standardises each reward per group; we standardise each over the batch (a departure)
    assert ref["multi_reward_mix"] == "advantage_aggr" and config.reward.combine_mode == "normalise-then-sum"
    assert Path(config.data.path).name == Path(ref["train_prompts"]).name
    assert Path(config.eval.path).name == Path(ref["eval_prompts"]).name
    assert (
        config.eval.num_steps,
        config.eval.guidance_scale,
        config.eval.samples_per_prompt,
        config.eval.prompts,
    ) == (ref["total_sampling_steps"], ref["eval_guidance"], 1, 0)
