"""The AWM presets (configs/presets/sd3_awm_*.yaml) against the authors' SD3.5-Medium recipes: each preset loads
and every value it reproduces equals the one the authors' config function (transcribed below, the keys that
matter) and training script give; where we depart on purpose (docs/departures.md) the mapping says so.

scxue/advantage_weighted_matching at be5137232e33a21b449ed65a533211d0deb97ed8: advantage_weighted_matching/config/
base_awm.py ``get_config``, config/dgx_awm.py ``compressibility`` and the three one-node recipes,
scripts/train_sd3_awm.py ``main`` (LoRA constants).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from transcribed import Source, transcribes

from trainer.config import load_config

REPO = Path(__file__).resolve().parents[2]
AUTHORS, COMMIT = "scxue/advantage_weighted_matching", "be5137232e33a21b449ed65a533211d0deb97ed8"


def _compressibility():
    """config/base_awm.py ``get_config`` then config/dgx_awm.py ``compressibility``: the keys the recipes read and
    do not set."""
    c = SimpleNamespace(seed=42, mixed_precision="fp16", use_lora=True, resolution=768)
    c.pretrained = SimpleNamespace(model="stabilityai/stable-diffusion-3.5-medium")
    c.sample = SimpleNamespace(guidance_scale=4.5, num_batches_per_epoch=4, global_std=False)
    c.train = SimpleNamespace(
        learning_rate=3e-4,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_weight_decay=1e-4,
        max_grad_norm=1.0,
        cfg=False,
        adv_clip_max=5,
        clip_range=1e-4,
        beta=0.0,
        ema=False,
        batch_size=4,
        gradient_accumulation_steps=2,
    )
    c.dataset = "dataset/pickscore"
    return c


def _one_node(c, dataset, reward_fn, num_batches, train_batch_size, noise_level, beta, time_type, freq):
    """The lines the three one-node recipes share, with what differs as arguments (their order kept)."""
    gpu_numbers = 8
    c.dataset = dataset
    c.sample.num_steps, c.sample.eval_num_steps, c.sample.guidance_scale = 14, 40, 1.0
    c.resolution = 512
    c.sample.train_batch_size, c.sample.num_image_per_prompt = 6, 24
    c.sample.num_batches_per_epoch = num_batches * 24 // gpu_numbers // 2
    c.sample.test_batch_size, c.sample.noise_level, c.sample.sde_frac = 6, noise_level, 0.0
    c.train.batch_size = train_batch_size
    c.train.gradient_accumulation_steps = (
        c.sample.train_batch_size // c.train.batch_size * c.sample.num_batches_per_epoch
    )
    c.train.num_batches_per_epoch = c.sample.train_batch_size // c.train.batch_size * c.sample.num_batches_per_epoch
    c.train.num_inner_epochs, c.train.beta, c.train.train_timesteps = 1, beta, 6
    c.train.kl_weight, c.train.advantage_max, c.train.ema, c.train.timestep_fraction = "Uniform", 1, True, 0.9
    c.train.loss_type, c.train.learning_rate, c.train.weighting, c.train.ghuber_power = (
        "exp_first",
        3e-4,
        "ghuber",
        0.25,
    )
    c.train.kl_ema_weight, c.train.kl_ema_decay, c.train.ema_beta = "Uniform", 0.3, 1
    c.train.kl_ema_decay_type, c.train.off_policy, c.train.use_sa_solver = "linear", False, True
    c.sample.global_std = True
    c.save_freq = c.eval_freq = freq
    c.reward_fn = reward_fn
    c.train.clip_range, c.lora_type, c.time_type, c.time_shift = 1, "attn", time_type, 3.0
    c.train.decay_steps, c.train.ema_decay, c.train.ema_update_step_interval = 10000000000, 0.99, 1
    c.gpu_numbers = gpu_numbers
    return c


def _geneval_sd3_no_cfg_1node():
    """config/dgx_awm.py ``geneval_sd3_no_cfg_1node``."""
    return _one_node(_compressibility(), "dataset/geneval", {"geneval": 1.0}, 24, 3, 0.4, 0.001, "discrete_wo_init", 50)


def _ocr_sd3_no_cfg_1node():
    """config/dgx_awm.py ``ocr_sd3_no_cfg_1node``."""
    return _one_node(_compressibility(), "dataset/ocr", {"ocr": 1.0}, 24, 3, 0.4, 0.003, "discrete_wo_init", 20)


def _pickscore_sd3_no_cfg_1node():
    """config/dgx_awm.py ``pickscore_sd3_no_cfg_1node``."""
    return _one_node(_compressibility(), "dataset/pickscore", {"pickscore": 1.0}, 8, 2, 0.0, 0.0001, "discrete", 50)


LORA = {
    "r": 32,
    "lora_alpha": 64,
    "attn": [
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    ],
}
"""scripts/train_sd3_awm.py ``main``: the LoraConfig, target modules by ``lora_type``."""
WEIGHTING = {"Uniform": "uniform", "t": "sigma", "t**2": "sigma**2", "huber": "huber", "ghuber": "ghuber"}
SCORERS = {"geneval": "geneval_flow_grpo", "ocr": "ocr", "pickscore": "pickscore"}
DATA = {
    "dataset/geneval": ("data/geneval/train_metadata.jsonl", "data/flow_grpo/geneval_test_metadata.jsonl"),
    "dataset/ocr": ("data/ocr/train_prompts.txt", "data/flow_grpo/ocr_test_prompts.txt"),
    "dataset/pickscore": (
        "data/flow_grpo/pickscore_train_prompts.txt",
        "data/flow_grpo/pickscore_test_prompts.txt",
    ),
}
"""Their dataset folder -> our (train, test) files: the same files as DGPO's (test_recipe_dgpo.py checks them)."""
DTYPE = {"fp16": "bfloat16"}
"""Their fp16 autocast over float32 weights -> our bfloat16 base weights (docs/departures.md, Algorithms)."""


def expected(c) -> dict:
    """Our settings that reproduce recipe ``c``, by dotted key."""
    samples = c.sample.train_batch_size * c.gpu_numbers * c.sample.num_batches_per_epoch
    steps = c.train.num_batches_per_epoch // c.train.gradient_accumulation_steps
    train, test = DATA[c.dataset]
    assert c.train.loss_type == "exp_first" and c.train.kl_weight == c.train.kl_ema_weight == "Uniform"
    assert not c.train.off_policy and not c.train.cfg and c.train.decay_steps >= 1e9  # old = own forward; constant lr
    return {
        "model.name": "sd3",
        "model.resolution": c.resolution,
        "model.lora.rank": LORA["r"],
        "model.lora.alpha": LORA["lora_alpha"],
        "model.lora.target_modules": LORA[c.lora_type],
        "model.dtype": DTYPE[c.mixed_precision],
        "algorithm.name": "awm",
        "algorithm.group_size": c.sample.num_image_per_prompt,
        "algorithm.time_weighting": WEIGHTING[c.train.weighting],
        "algorithm.ghuber_power": c.train.ghuber_power,
        "algorithm.clip_range": c.train.clip_range,
        "algorithm.adv_clip": c.train.adv_clip_max,
        "algorithm.advantage_max": c.train.advantage_max,
        "algorithm.global_std": c.sample.global_std,
        "algorithm.kl_beta": c.train.beta,
        "algorithm.ema_kl_beta": c.train.ema_beta,
        "algorithm.ema_decay": c.train.kl_ema_decay,
        "algorithm.ema_decay_ramp": {"linear": 0.001, "constant": 0.0}[c.train.kl_ema_decay_type],
        "algorithm.time_type": c.time_type,
        "algorithm.timestep_fraction": c.train.timestep_fraction,
        "algorithm.noise_draws": c.train.train_timesteps,
        "algorithm.micro_batch_size": c.train.batch_size * c.train.train_timesteps,
        "algorithm.inner_epochs": c.train.num_inner_epochs,
        "algorithm.steps_per_epoch": steps,
        "algorithm.sampler.num_steps": c.sample.num_steps,
        "algorithm.sampler.guidance_scale": c.sample.guidance_scale,
        "algorithm.sampler.noise_level": 0.0,  # Euler ODE for their SA-Solver (docs/departures.md, Algorithms)
        "data.name": "prompt_file",
        "data.path": train,
        "data.prompts_per_epoch": samples // c.sample.num_image_per_prompt,
        "train.warmup_steps": 0,
        "train.learning_rate": c.train.learning_rate,
        "train.weight_decay": c.train.adam_weight_decay,
        "train.adam_betas": (c.train.adam_beta1, c.train.adam_beta2),
        "train.max_grad_norm": c.train.max_grad_norm,
        "train.seed": c.seed,
        "train.ema_decay": c.train.ema_decay if c.train.ema else 0.0,
        "train.ema_every": c.train.ema_update_step_interval,
        "train.checkpoint_every": c.save_freq,
        "eval.path": test,
        "eval.samples_per_prompt": 1,
        "eval.num_steps": c.sample.eval_num_steps,
        "eval.guidance_scale": c.sample.guidance_scale,
        "eval.batch_size": c.sample.test_batch_size,
        "eval.every": c.eval_freq,
        "eval.use_ema": c.train.ema,
        "reward.weights": {SCORERS[name]: float(w) for name, w in c.reward_fn.items()},
    }


def _get(config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


RECIPES = {
    "sd3_awm_geneval": _geneval_sd3_no_cfg_1node,
    "sd3_awm_ocr": _ocr_sd3_no_cfg_1node,
    "sd3_awm_pickscore": _pickscore_sd3_no_cfg_1node,
}


@transcribes(
    "algorithm:awm",
    source=Source(
        AUTHORS,
        COMMIT,
        "advantage_weighted_matching/config/dgx_awm.py",
        "geneval_sd3_no_cfg_1node, ocr_sd3_no_cfg_1node, pickscore_sd3_no_cfg_1node",
    ),
)
@pytest.mark.parametrize("preset", sorted(RECIPES))
def test_the_preset_reproduces_the_authors_recipe(preset):
    c = RECIPES[preset]()
    assert c.pretrained.model == "stabilityai/stable-diffusion-3.5-medium" and c.use_lora
    assert c.sample.sde_frac == 0.0 and c.sample.noise_level in (0.0, 0.4)  # SA-Solver's noise (ours: none)
    config = load_config(str(REPO / "configs" / "presets" / f"{preset}.yaml"))
    for key, value in expected(c).items():
        got = _get(config, key)
        same = math.isclose(got, value) if isinstance(value, float) else got == value
        assert same, f"{preset}: {key} is {got!r}, the authors' {value!r}"
    header = (REPO / "configs" / "presets" / f"{preset}.yaml").read_text().replace("\n# ", " ")
    assert f"{AUTHORS} at commit {COMMIT}" in header and f"dgx_awm.py:{RECIPES[preset].__name__[1:]}" in header
