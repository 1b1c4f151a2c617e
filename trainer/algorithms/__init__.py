"""RL algorithms, registered by name. A new algorithm is one file plus one line here."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.algorithms.awm import AWM, AWMConfig
from trainer.algorithms.dgpo import DGPO, DGPOConfig
from trainer.algorithms.dpo import DPO, DPOConfig
from trainer.algorithms.grpo import GRPO, GRPOConfig
from trainer.algorithms.grpo_guard import GRPOGuard, GRPOGuardConfig
from trainer.algorithms.mixgrpo import MixGRPO, MixGRPOConfig
from trainer.algorithms.nft import NFT, NFTConfig
from trainer.algorithms.ppo import PPO, PPOConfig
from trainer.algorithms.ppo_critic import PPOCritic, PPOCriticConfig
from trainer.algorithms.sft_best import BestOfGroupConfig, BestOfGroupSFT


@dataclass(frozen=True)
class AlgorithmSpec:
    algorithm: type
    config_class: type


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(GRPO, GRPOConfig),
    "ppo": AlgorithmSpec(PPO, PPOConfig),
    "ppo_critic": AlgorithmSpec(PPOCritic, PPOCriticConfig),
    "dpo": AlgorithmSpec(DPO, DPOConfig),
    "sft_best": AlgorithmSpec(BestOfGroupSFT, BestOfGroupConfig),
    "nft": AlgorithmSpec(NFT, NFTConfig),
    "grpo_guard": AlgorithmSpec(GRPOGuard, GRPOGuardConfig),
    "mixgrpo": AlgorithmSpec(MixGRPO, MixGRPOConfig),
    "awm": AlgorithmSpec(AWM, AWMConfig),
    "dgpo": AlgorithmSpec(DGPO, DGPOConfig),
}


def build_algorithm(config):
    """The Algorithm that ``config.name`` names."""
    return ALGORITHMS[config.name].algorithm(config)
