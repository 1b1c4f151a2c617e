"""RL algorithms, registered by name. A new algorithm is one file plus one line here."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.algorithms.grpo import GRPO, GRPOConfig


@dataclass(frozen=True)
class AlgorithmSpec:
    algorithm: type
    config_class: type


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(GRPO, GRPOConfig),
}


def build_algorithm(config):
    """The Algorithm that ``config.name`` names."""
    return ALGORITHMS[config.name].algorithm(config)
