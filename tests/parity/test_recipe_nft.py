"""The DiffusionNFT presets (configs/presets/sd3_nft_*.yaml) hold the authors' SD3.5-Medium recipes: each value is
read from NVlabs/DiffusionNFT's config/nft.py recipe function (with ``_get_config`` and config/base.py), and from
scripts/train_nft_sd3.py where the script fixes it (LoRA, EMA), transcribed below at the commit ``NFT_CONFIG``
names; the prompt files are the authors' (the same bytes where the repository holds them).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from transcribed import Source, transcribes

from trainer.config import load_config

REPO = Path(__file__).resolve().parents[2]
COMMIT = "24af5554898d85e93efa492f42b5e9cdf4156e9b"
NFT_CONFIG = Source(
    "NVlabs/DiffusionNFT",
    COMMIT,
    "config/nft.py",
    "sd3_pickscore, sd3_hpsv2, sd3_ocr, sd3_geneval, sd3_multi_reward (_get_config, config/base.py)",
)

DECAY_TYPES = {1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}
"""scripts/train_nft_sd3.py ``return_decay``: decay_type -> (flat, uprate, uphold)."""
LORA_TARGETS = [
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
]
"""scripts/train_nft_sd3.py ``main``: LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", ...)."""
PROMPTS = {  # dataset/<name>/{train,test}.txt or _metadata.jsonl -> our copies (md5 of the authors' file, or None)
    "pickscore": (
        ("data/flow_grpo/pickscore_train_prompts.txt", "b47611e6956a46742728f8c16f5b241e"),
        ("data/flow_grpo/pickscore_test_prompts.txt", "97bd2d2a709dd515fa954c0b5a39084c"),
    ),
    "ocr": (
        ("data/ocr/train_prompts.txt", None),
        ("data/flow_grpo/ocr_test_prompts.txt", "b62cdf3da0a36558c1f98bef6320d7d3"),
    ),
    "geneval": (
        ("data/geneval/train_metadata.jsonl", None),
        ("data/flow_grpo/geneval_test_metadata.jsonl", "76b5117f7ea6a9ef5755a9cfbf0ddfd2"),
    ),
}
"""The authors' train files of ocr and geneval are not in the commit's stored snapshot: their paths only."""
SCORERS = {
    "pickscore": "pickscore",
    "hpsv2": "hpsv2",
    "clipscore": "clipscore",
    "ocr": "ocr",
    "geneval": "geneval_flow_grpo",
}
"""flow_grpo/rewards.py ``multi_score``'s reward names -> our scorers (GenEval: Flow-GRPO's training reward)."""


def _authors_config(recipe: str) -> dict:
    """``recipe``() of config/nft.py at NVlabs/DiffusionNFT@24af555, flattened to the fields that have a
    counterpart here (their names; ``gradient_step_per_epoch`` and ``dataset`` as passed to ``_get_config``)."""
    config = {  # config/base.py
        "seed": 42,
        "save_freq": 30,
        "eval_freq": 10,
        "use_lora": True,
        "sample.global_std": True,
        "train.learning_rate": 3e-4,
        "train.adam_beta1": 0.9,
        "train.adam_beta2": 0.999,
        "train.adam_weight_decay": 1e-4,
        "train.max_grad_norm": 1.0,
        "train.num_inner_epochs": 1,
        "train.adv_clip_max": 5,
        "train.timestep_fraction": 0.99,
        "train.ema": True,
    }
    config.update(
        {  # _get_config(base_model="sd3"): the sd3 branch, then the common settings
            "resolution": 512,
            "sample.num_steps": 10,
            "sample.eval_num_steps": 40,
            "train.beta": 0.0001,
            "sample.noise_level": 0.7,
            "sample.num_image_per_prompt": 24,
            "num_groups": 48,
            "decay_type": 1,
            "beta": 1.0,
            "train.adv_mode": "all",
            "sample.guidance_scale": 1.0,
            "sample.deterministic": True,
            "sample.solver": "dpm2",
        }
    )
    recipes = {
        "sd3_pickscore": (
            {"dataset": "pickscore", "gradient_step_per_epoch": 1, "reward_fn": {"pickscore": 1.0}},
            {},
        ),
        "sd3_hpsv2": (
            {"dataset": "pickscore", "gradient_step_per_epoch": 1, "reward_fn": {"hpsv2": 1.0}},
            {},
        ),
        "sd3_geneval": (
            {"dataset": "geneval", "gradient_step_per_epoch": 1, "reward_fn": {"geneval": 1.0}},
            {},
        ),
        "sd3_ocr": (
            {"dataset": "ocr", "gradient_step_per_epoch": 2, "reward_fn": {"ocr": 1.0}},
            {"beta": 0.1, "decay_type": 2},
        ),
        "sd3_multi_reward": (
            {
                "dataset": "pickscore",
                "gradient_step_per_epoch": 1,
                "reward_fn": {"pickscore": 1.0, "hpsv2": 1.0, "clipscore": 1.0},
            },
            {"sample.num_steps": 25, "beta": 0.1},
        ),
    }
    arguments, after = recipes[recipe]
    config.update(arguments)
    config["sample.test_batch_size"] = 14 if arguments["dataset"] == "geneval" else 16
    config.update(after)
    return config


def _expected(authors: dict) -> dict:
    """Our fields' values that give the authors' ``authors`` config."""
    flat, uprate, uphold = DECAY_TYPES[authors["decay_type"]]
    (train_path, _), (test_path, _) = PROMPTS[authors["dataset"]]
    assert authors["train.adv_mode"] == "all" and authors["use_lora"] and authors["train.ema"]
    return {
        "model.resolution": authors["resolution"],
        "model.lora.rank": 32,
        "model.lora.alpha": 64,
        "model.lora.target_modules": LORA_TARGETS,
        "algorithm.name": "nft",
        "algorithm.group_size": authors["sample.num_image_per_prompt"],
        "data.prompts_per_epoch": authors["num_groups"],
        "algorithm.sampler.num_steps": authors["sample.num_steps"],
        "algorithm.sampler.noise_level": 0.0 if authors["sample.deterministic"] else authors["sample.noise_level"],
        "algorithm.sampler.ode_order": {"dpm2": 2, "flow": 1}[authors["sample.solver"]],
        "algorithm.sampler.guidance_scale": authors["sample.guidance_scale"],
        "algorithm.beta": authors["beta"],
        "algorithm.kl_weight": authors["train.beta"],
        "algorithm.optimality_scale": authors["train.adv_clip_max"],
        "algorithm.loss_scale": authors["train.adv_clip_max"],
        "algorithm.adaptive_weight": True,
        "algorithm.global_std": authors["sample.global_std"],
        "algorithm.noise_levels": "schedule",
        "algorithm.noise_draws": int(authors["sample.num_steps"] * authors["train.timestep_fraction"]),
        "algorithm.steps_per_epoch": authors["gradient_step_per_epoch"],
        "algorithm.inner_epochs": authors["train.num_inner_epochs"],
        "algorithm.old_decay": uphold,
        "algorithm.old_decay_rate": uprate,
        "algorithm.old_decay_delay": flat,
        "train.learning_rate": authors["train.learning_rate"],
        "train.adam_betas": (authors["train.adam_beta1"], authors["train.adam_beta2"]),
        "train.weight_decay": authors["train.adam_weight_decay"],
        "train.max_grad_norm": authors["train.max_grad_norm"],
        "train.seed": authors["seed"],
        "train.ema_decay": 0.9,
        "train.ema_every": 1,  # main: EMAModuleWrapper(decay=0.9, update_step_interval=1)
        "train.checkpoint_every": authors["save_freq"],
        "data.path": train_path,
        "eval.path": test_path,
        "eval.prompts": 0,
        "eval.samples_per_prompt": 1,  # eval_fn: every test prompt, one image each
        "eval.batch_size": authors["sample.test_batch_size"],
        "eval.num_steps": authors["sample.eval_num_steps"],
        "eval.guidance_scale": authors["sample.guidance_scale"],
        "eval.every": authors["eval_freq"],
        "eval.use_ema": authors["train.ema"],
        "reward.weights": {SCORERS[name]: weight for name, weight in authors["reward_fn"].items()},
    }


def _ours(config, dotted: str):
    value = config
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


@transcribes("algorithm:nft", source=NFT_CONFIG)
@pytest.mark.parametrize("recipe", ["sd3_pickscore", "sd3_hpsv2", "sd3_ocr", "sd3_geneval", "sd3_multi_reward"])
def test_the_preset_holds_the_authors_recipe(recipe):
    path = REPO / "configs" / "presets" / f"sd3_nft_{recipe.removeprefix('sd3_')}.yaml"
    header = path.read_text()
    assert f"NVlabs/DiffusionNFT@{COMMIT} config/nft.py {recipe}()" in header
    config = load_config(str(path))
    expected = _expected(_authors_config(recipe))
    ours = {key: _ours(config, key) for key in expected}
    ours["reward.weights"] = {name: w for name, w in config.reward.weights.items() if w}  # weight 0: logged only
    ours["data.path"], ours["eval.path"] = (
        str(Path(p).resolve().relative_to(REPO.resolve())) if Path(p).is_absolute() else p
        for p in (config.data.path, config.eval.path)
    )
    assert ours == expected


@transcribes("algorithm:nft", source=NFT_CONFIG)
def test_the_presets_prompt_files_are_the_authors():
    """The repository's copies of the authors' dataset files hold the same bytes (md5 of dataset/<name>/*)."""
    for files in PROMPTS.values():
        for path, md5 in files:
            if md5 is not None:
                assert hashlib.md5((REPO / path).read_bytes()).hexdigest() == md5, path
