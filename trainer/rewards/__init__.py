"""Rewards for the trainer: the reward client contract, its HTTP and in-process implementations, and a
local reward server pool for runs without configured reward URLs."""

from trainer.rewards.client import (
    HttpRewardClient,
    InProcessRewardClient,
    RewardClient,
    RewardClientError,
    RewardRequestError,
    RewardResult,
    RewardUnavailableError,
    combine,
)
from trainer.rewards.launcher import LocalRewardPool, RewardPoolError

__all__ = [
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
]
