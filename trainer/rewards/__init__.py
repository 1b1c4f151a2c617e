"""Rewards for the trainer: the reward client contract, its HTTP and in-process implementations, and a
local reward server pool for runs without configured reward URLs."""

from trainer.rewards.client import (
    COMBINE_MODES,
    DEFAULT_WIRE_FORMAT,
    WIRE_FORMATS,
    HttpRewardClient,
    InProcessRewardClient,
    RewardClient,
    RewardClientError,
    RewardRequestError,
    RewardResult,
    RewardUnavailableError,
    combine,
    standardise,
)
from trainer.rewards.launcher import LocalRewardPool, RewardPoolError

__all__ = [
    "COMBINE_MODES",
    "DEFAULT_WIRE_FORMAT",
    "WIRE_FORMATS",
    "HttpRewardClient",
    "InProcessRewardClient",
    "LocalRewardPool",
    "RewardClient",
    "RewardClientError",
    "RewardPoolError",
    "RewardRequestError",
    "RewardResult",
    "RewardUnavailableError",
    "combine",
    "standardise",
]
