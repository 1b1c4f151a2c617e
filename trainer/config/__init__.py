"""The trainer's configuration: ``fields`` (the checked types config dataclasses are written in),
``building`` (plain dicts <-> dataclasses), ``schema`` (the sections and ``Config``) and ``loading`` (YAML
files, ``key=value`` overrides, what a run saves).

The names below load on first use: algorithm and model configs import ``trainer.config.fields`` and the
schema imports them, so importing the schema here, eagerly, would make an import cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config.building import to_dict
    from trainer.config.fields import ConfigError
    from trainer.config.loading import load_config, saved_dict, user_error_exit
    from trainer.config.schema import (
        Config,
        DataConfig,
        EvalConfig,
        LoggingConfig,
        ParallelConfig,
        RewardConfig,
        TrainConfig,
        reward_token,
    )

_HOMES = {
    "to_dict": "building",
    "ConfigError": "fields",
    "load_config": "loading",
    "saved_dict": "loading",
    "user_error_exit": "loading",
    "Config": "schema",
    "DataConfig": "schema",
    "EvalConfig": "schema",
    "LoggingConfig": "schema",
    "ParallelConfig": "schema",
    "RewardConfig": "schema",
    "TrainConfig": "schema",
    "reward_token": "schema",
}
"""Each public name's module."""


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'trainer.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trainer.config.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "ParallelConfig",
    "RewardConfig",
    "TrainConfig",
    "load_config",
    "reward_token",
    "saved_dict",
    "to_dict",
    "user_error_exit",
]
