"""Parallel backends: the only package that imports ``torch.distributed`` (and DeepSpeed).

A ParallelBackend owns process-group setup, module wrapping or sharding, gradient synchronisation, the
optimizer step and collectives. The trainer calls it the same way in one CPU process or under torchrun on
many nodes; ``parallel.backend`` picks the engine by name from ``BACKENDS``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from shared.registry import Entry, Registry
from trainer.distributed.backend import DDP, ParallelBackend, SingleProcess, World, detect_world

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gathers_for_sampling(parallel: Any) -> bool:
    """``parallel.gather_for_sampling``, or when unset: on unless ``parallel.cpu_offload``."""
    return parallel.gather_for_sampling if parallel.gather_for_sampling is not None else not parallel.cpu_offload


def init_backend(parallel: Any, device: torch.device, max_grad_norm: float) -> ParallelBackend:
    """The backend ``parallel.backend`` names, set up from the ``parallel`` config section (a
    ``ParallelConfig``); ``max_grad_norm`` is handed to engines that clip themselves (DeepSpeed)."""
    world = detect_world()
    kind = parallel.backend
    if kind == "auto":
        kind = "ddp" if world.world_size > 1 else "single"
    if kind not in BACKENDS:
        raise ValueError(f"parallel.backend={kind!r} is not one of auto, {', '.join(BACKENDS)}")
    world = dataclasses.replace(world, sequence_parallel=sequence_groups(parallel.sequence_parallel, kind, world))
    param_dtype, reduce_dtype = _DTYPES[parallel.param_dtype], _DTYPES[parallel.reduce_dtype]
    if kind in ("single", "ddp") and (
        param_dtype != torch.float32 or reduce_dtype != torch.float32 or parallel.cpu_offload
    ):
        raise ValueError(
            f"parallel.backend={kind} trains the model in model.dtype without offloading; "
            "parallel.param_dtype / reduce_dtype / cpu_offload need fsdp2, zero2 or zero3"
        )
    if parallel.deepspeed_config and kind not in ("zero2", "zero3"):
        raise ValueError(
            f"parallel.deepspeed_config={parallel.deepspeed_config!r} is read by zero2 and zero3 only, "
            f"not by parallel.backend={kind}: set parallel.backend=zero2 or zero3, or drop it"
        )
    return BACKENDS[kind](parallel, device, world, max_grad_norm)


def sequence_groups(size: int, kind: str, world: World) -> int:
    """``parallel.sequence_parallel``, checked against the backend ``kind`` and the ``world``'s ranks."""
    if size > 1 and kind not in ("ddp", "fsdp2"):
        raise ValueError(
            f"parallel.sequence_parallel={size} runs under parallel.backend=ddp or fsdp2, not {kind}: "
            "set one of them, or parallel.sequence_parallel=1"
        )
    if world.world_size % size:
        raise ValueError(
            f"parallel.sequence_parallel={size} does not divide the {world.world_size} ranks: choose a divisor "
            "(the ranks form data-parallel replicas of that many ranks each)"
        )
    return size


def _single(parallel: Any, device: torch.device, world: World, max_grad_norm: float) -> ParallelBackend:
    if world.world_size > 1:
        raise ValueError("parallel.backend=single under torchrun with several processes; use ddp or auto")
    return SingleProcess(device)


def _process_group(kind: str, parallel: Any, device: torch.device, world: World) -> str:
    """The torch.distributed backend (``parallel.dist_backend``; auto: nccl on CUDA, else gloo) of a job that
    torchrun started, or the ValueError saying how to start one for backend ``kind``."""
    if world.world_size == 1 and "RANK" not in os.environ:
        raise ValueError(
            f"parallel.backend={kind} needs the torch.distributed environment; start the job with "
            f"torchrun (e.g. `torchrun --nproc_per_node=2 trainer/main.py parallel.backend={kind} ...`),"
            " or use parallel.backend=single for one process"
        )
    if parallel.dist_backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return parallel.dist_backend


def _ddp(parallel: Any, device: torch.device, world: World, max_grad_norm: float) -> ParallelBackend:
    return DDP(device, world, _process_group("ddp", parallel, device, world))


def _fsdp2(parallel: Any, device: torch.device, world: World, max_grad_norm: float) -> ParallelBackend:
    from trainer.distributed.fsdp import FSDP2

    dtypes = _DTYPES[parallel.param_dtype], _DTYPES[parallel.reduce_dtype]
    dist_backend = _process_group("fsdp2", parallel, device, world)
    return FSDP2(device, world, dist_backend, *dtypes, parallel.cpu_offload, gathers_for_sampling(parallel))


def _zero(parallel: Any, device: torch.device, world: World, max_grad_norm: float, stage: int) -> ParallelBackend:
    from trainer.distributed.zero import DeepSpeedZeRO, deepspeed_config

    dist_backend = _process_group(f"zero{stage}", parallel, device, world)
    config = deepspeed_config(
        stage,
        parallel.deepspeed_config,
        max_grad_norm=max_grad_norm,
        param_dtype=_DTYPES[parallel.param_dtype],
        reduce_dtype=_DTYPES[parallel.reduce_dtype],
        cpu_offload=parallel.cpu_offload,
    )
    return DeepSpeedZeRO(device, world, dist_backend, stage, config, gathers_for_sampling(parallel))


BACKENDS = Registry(
    {
        "single": Entry(_single),
        "ddp": Entry(_ddp),
        "fsdp2": Entry(_fsdp2),
        "zero2": Entry(_zero, stage=2),
        "zero3": Entry(_zero, stage=3),
    },
    key="parallel.backend",
)
"""Backend name (``parallel.backend``; ``auto`` is ddp under torchrun with more than one process, else single) ->
its builder (the ``parallel`` config section, the device, the world, ``max_grad_norm``)."""


__all__ = [
    "BACKENDS",
    "ParallelBackend",
    "SingleProcess",
    "World",
    "detect_world",
    "gathers_for_sampling",
    "init_backend",
    "weights_rank_spread",
]


@torch.no_grad()
def weights_rank_spread(backend: ParallelBackend, params) -> float:
    """Largest difference between ranks of a float64 checksum of the trainable weights ``params`` (0 when every
    rank holds the same weights, as data parallelism requires). Sharded backends compare the gathered full weights."""
    with backend.gathered(params) as full:
        checksum = sum(t.double().sum() * (i + 1) for i, t in enumerate(full))
    every = backend.gather(torch.as_tensor(checksum, dtype=torch.float64).reshape(1))
    return float(every.max() - every.min())
