"""RL algorithms, registered by name. A new algorithm is one file plus one line here; its estimators and losses
are registered in ``core_algos``."""

from __future__ import annotations

from shared.registry import Entry, Registry
from trainer.algorithms.awm import AWM
from trainer.algorithms.dgpo import DGPO
from trainer.algorithms.dpo import DPO
from trainer.algorithms.draft import DRaFT
from trainer.algorithms.drtune import DRTune
from trainer.algorithms.grpo import GRPO
from trainer.algorithms.grpo_guard import GRPOGuard
from trainer.algorithms.mixgrpo import MixGRPO
from trainer.algorithms.nft import NFT
from trainer.algorithms.ppo import PPO
from trainer.algorithms.ppo_critic import PPOCritic
from trainer.algorithms.refl import ReFL
from trainer.algorithms.sft_best import BestOfGroupSFT

ALGORITHMS = Registry(
    {
        "grpo": Entry(GRPO),
        "ppo": Entry(PPO),
        "ppo_critic": Entry(PPOCritic),
        "dpo": Entry(DPO),
        "sft_best": Entry(BestOfGroupSFT),
        "nft": Entry(NFT),
        "grpo_guard": Entry(GRPOGuard),
        "mixgrpo": Entry(MixGRPO),
        "awm": Entry(AWM),
        "dgpo": Entry(DGPO),
        "refl": Entry(ReFL),
        "draft": Entry(DRaFT),
        "drtune": Entry(DRTune),
    },
    key="algorithm.name",
)
"""Algorithm name -> its class (its config dataclass: ``ALGORITHMS[name].config_class``)."""


def build_algorithm(config):
    """The Algorithm that ``config.name`` names."""
    return ALGORITHMS[config.name](config)
