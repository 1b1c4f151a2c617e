"""Rewards on both sides of the boundary: the result type, the weighted combination and the client contract.

numpy only, so that the trainer's clients and the in-process scorer client share one definition of a batch's
rewards. A reward that could not be computed is NaN, never 0: the algorithm gives such samples no advantage
and counts them (:func:`failed_share`).

Combination over the items of one batch, with weights ``w`` and components ``c_k`` (components with weight 0
are scored and logged but take no part):

* ``sum``: ``sum_k w_k * c_k``.
* ``sum-then-normalise``: ``standardise(sum_k w_k * c_k)``.
* ``normalise-then-sum``: ``sum_k w_k * standardise(c_k)``, so that components on different scales count by
  their weights rather than by their spreads.

``standardise(x) = (x - mean(x)) / (std(x) + 1e-8)`` with the mean and the population standard deviation
(ddof 0) over the finite entries of ``x`` in the batch (under data parallelism each rank's batch); NaN entries
stay NaN and take no part in the statistics. An item with a NaN in any weighted component is NaN in every mode.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

COMBINE_MODES = ("sum", "sum-then-normalise", "normalise-then-sum")
STANDARDISE_EPS = 1e-8


@dataclass
class RewardResult:
    """Rewards of one batch.

    Attributes:
        components: scorer name -> float64 ``[B]``; NaN where that scorer failed for the item.
        combined: float64 ``[B]``, the weighted combination (see :class:`Combination`); NaN if any weighted
            component is NaN.
        errors: scorer name -> {item index: "CODE: message"} for the NaN entries.
        instances: ids of the server instances that answered (one entry per chunk).
    """

    components: dict[str, np.ndarray]
    combined: np.ndarray
    errors: dict[str, dict[int, str]] = field(default_factory=dict)
    instances: list[str] = field(default_factory=list)

    @property
    def num_failed(self) -> int:
        """Items without a combined reward."""
        return int(np.isnan(self.combined).sum())


def failed_share(rewards: Any) -> float:
    """Share of the entries of ``rewards`` (array-like; CPU tensors too) that are NaN: samples with no reward."""
    return float(np.isnan(np.asarray(rewards, dtype=np.float64)).mean())


def standardise(values: np.ndarray) -> np.ndarray:
    """``(x - mean) / (std + 1e-8)`` over the finite entries (population std); NaN entries stay NaN."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    if not finite.any():
        return np.full_like(values, np.nan)
    mean = values[finite].mean()
    std = values[finite].std()
    return np.where(finite, (values - mean) / (std + STANDARDISE_EPS), np.nan)


def check_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """The weights as floats; ValueError unless they are finite and at least one is non-zero."""
    bad = {name: w for name, w in weights.items() if not np.isfinite(w)}
    if bad:
        raise ValueError(f"reward.weights must be finite numbers, got {bad}")
    weights = {name: float(w) for name, w in weights.items()}
    if not any(weights.values()):
        raise ValueError(
            f"reward.weights={weights} gives no scorer a weight (the combined reward would be 0 for "
            "every item, scored or not): name at least one with a non-zero weight, e.g. "
            "reward.weights={digit: 1.0}"
        )
    return weights


def check_combine_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`COMBINE_MODES`, else ValueError."""
    if mode not in COMBINE_MODES:
        raise ValueError(f"combine_mode must be one of {COMBINE_MODES}, got {mode!r}")
    return mode


@dataclass(frozen=True, init=False)
class Combination:
    """Scorer weights and a combine mode, checked once: how components become one reward per item."""

    weights: dict[str, float]
    mode: str

    def __init__(self, weights: Mapping[str, float], mode: str = "sum") -> None:
        object.__setattr__(self, "weights", check_weights(weights))
        object.__setattr__(self, "mode", check_combine_mode(mode))

    def __call__(self, components: Mapping[str, np.ndarray]) -> np.ndarray:
        """The combined reward of each item (see the module docstring)."""
        length = len(next(iter(components.values())))
        combined = np.zeros(length, dtype=np.float64)
        for name, weight in self.weights.items():
            if weight != 0.0:
                component = np.asarray(components[name], dtype=np.float64)
                combined += weight * (standardise(component) if self.mode == "normalise-then-sum" else component)
        return standardise(combined) if self.mode == "sum-then-normalise" else combined

    def empty(self, num_items: int) -> tuple[dict[str, np.ndarray], dict[str, dict[int, str]]]:
        """All-NaN components and empty errors for ``num_items`` items, to be filled in by a client."""
        return {name: np.full(num_items, np.nan) for name in self.weights}, {name: {} for name in self.weights}

    def result(
        self, components: dict[str, np.ndarray], errors: dict[str, dict[int, str]], instances: list[str]
    ) -> RewardResult:
        return RewardResult(components, self(components), errors, instances)

    def cat(self, parts: Sequence[RewardResult]) -> RewardResult:
        """Join the results of consecutive chunks of one batch. The combination is recomputed over the whole
        batch, so the normalising modes standardise over the batch, not over each chunk."""
        components = {name: np.concatenate([p.components[name] for p in parts]) for name in parts[0].components}
        errors: dict[str, dict[int, str]] = {}
        offset = 0
        for part in parts:
            for name, items in part.errors.items():
                errors.setdefault(name, {}).update({offset + i: msg for i, msg in items.items()})
            offset += len(part.combined)
        return self.result(components, errors, [i for p in parts for i in p.instances])


def combine(components: Mapping[str, np.ndarray], weights: Mapping[str, float], mode: str = "sum") -> np.ndarray:
    """Combine the components with their weights (modes: see the module docstring).

    A NaN in a component with a non-zero weight makes the item NaN; components with weight 0 never affect (or
    invalidate) the combination.
    """
    return Combination(weights, mode)(components)


def check_batch(
    images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None
) -> tuple[np.ndarray, list[str], list[dict[str, Any]]]:
    """Validate a batch, images uint8 ``[B, H, W, C]`` or videos uint8 ``[B, F, H, W, C]`` (C = 1 or 3), and return a
    private copy (the caller may reuse its buffers at once)."""
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
        raise ValueError(f"images must be a uint8 numpy array [B, H, W, C], got {type(images).__name__}")
    if images.ndim not in (4, 5) or images.shape[-1] not in (1, 3) or (images.ndim == 5 and images.shape[1] == 0):
        raise ValueError(
            "images must be [B, H, W, C] (images) or [B, F, H, W, C] (videos, F >= 1) with C = 1 or 3, got shape "
            f"{list(images.shape)}"
        )
    if len(prompts) != len(images):
        raise ValueError(f"got {len(images)} images but {len(prompts)} prompts")
    if metadata is not None and len(metadata) != len(images):
        raise ValueError(f"got {len(images)} images but {len(metadata)} metadata entries")
    meta = [dict(m) for m in metadata] if metadata is not None else [{} for _ in prompts]
    return np.array(images, copy=True, order="C"), [str(p) for p in prompts], meta


class RewardClient(Protocol):
    """What the trainer needs from a reward client (a pool of HTTP replicas, or scorers in this process)."""

    batch_size: int
    """Items per request: the trainer cuts its rollout chunks at multiples of it, so that no chunk ends in a
    partial request (a server's batch costs about as much partly filled as full)."""

    failed_attempts: int
    """Requests that failed and were tried again (or given up) so far: a count that grows says the reward pool is
    failing, not slow (0 for scorers in this process)."""

    @property
    def weights(self) -> dict[str, float]:
        """Scorer name -> weight: the components of every result."""
        ...

    async def score_async(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult: ...

    def submit(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> concurrent.futures.Future[RewardResult]:
        """Start scoring uint8 ``[B, H, W, C]`` images (or ``[B, F, H, W, C]`` videos, their fps in each item's
        metadata under ``fps``, default 16) in the background; inputs are checked and copied here."""
        ...

    def score(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult: ...

    def merge(self, parts: Sequence[RewardResult]) -> RewardResult:
        """One result for consecutive chunks of a batch, combined over the whole batch with this client's
        weights and mode."""
        ...

    def close(self) -> None: ...
