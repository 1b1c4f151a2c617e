"""The trainer's side of the reward boundary: the HTTP client of a reward server pool, and a local pool of
server processes for runs without configured reward URLs. The result type and the client contract are in
:mod:`shared.rewards`."""

from trainer.rewards.client import HttpRewardClient
from trainer.rewards.errors import RewardClientError, RewardRequestError, RewardUnavailableError
from trainer.rewards.launcher import LocalRewardPool, RewardPoolError
from trainer.rewards.wire import DEFAULT_WIRE_FORMAT, WIRE_FORMATS

__all__ = [
    "DEFAULT_WIRE_FORMAT",
    "WIRE_FORMATS",
    "HttpRewardClient",
    "LocalRewardPool",
    "RewardClientError",
    "RewardPoolError",
    "RewardRequestError",
    "RewardUnavailableError",
]
