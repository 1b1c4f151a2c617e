"""Running out of device (or CPU) memory, said in one line: which part of the run ran out, read from the error's
frames, and the settings that lower that part's peak, instead of torch's traceback. The most common failure of a
first run on a new model, GPU or batch size."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer.config import Config

CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"
"""What torch's CPU allocator says (a RuntimeError, not torch.OutOfMemoryError) when an allocation fails."""
GPU_LIBRARIES = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
"""What a failed allocation inside a CUDA kernel launch or cuBLAS says (a RuntimeError too)."""


def _on_gpu(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and any(said in str(exc) for said in GPU_LIBRARIES)
    )


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed: a GPU's (torch.OutOfMemoryError, CUDA's, cuBLAS's) or the CPU
    allocator's."""
    return _on_gpu(exc) or (isinstance(exc, RuntimeError) and CPU_ALLOCATOR in str(exc))


PARTS = (
    ("Trainer.evaluate", "an evaluation"),
    ("Trainer.sample_and_score", "a rollout"),
    ("Trainer.warmup_step", "a warm-up step"),
    ("Trainer._new_reference", "making the reference model"),
    ("Trainer.rl_epoch", "an RL update"),
    ("build_adapter", "loading the model"),
    ("Trainer.__init__", "preparing training"),
)
"""(a function of the trainer on the error's stack, the part of the run it is), the most specific first."""
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _part(exc: BaseException) -> str:
    """Which part of the run was allocating ("the run" when none of ``PARTS`` is on the error's stack)."""
    names = set()
    tb = exc.__traceback__
    while tb is not None:
        names.add(tb.tb_frame.f_code.co_qualname)
        tb = tb.tb_next
    return next((part for qualname, part in PARTS if qualname in names), "the run")


def _settings(part: str, config: Config) -> str:
    """The settings that lower ``part``'s peak memory, with their values now."""
    model, ev = config.model, config.eval
    checkpointing = "" if getattr(model, "gradient_checkpointing", True) else ", or model.gradient_checkpointing=true"
    sharding = (
        ""
        if config.parallel.backend in ("fsdp2", "zero3")
        else "; parallel.backend=fsdp2 or zero3 shards the weights, gradients and optimizer state over the GPUs"
    )
    chunks = config.train.rollout_chunks or "0, auto: at least 8 images a chunk"
    micro = getattr(config.algorithm, "micro_batch_size", None)
    return {
        "an evaluation": f"lower eval.batch_size (now {ev.batch_size} prompts a forward, eval.samples_per_prompt="
        f"{ev.samples_per_prompt} images each)",
        "a rollout": f"raise train.rollout_chunks (now {chunks}) to sample fewer images at once{sharding}",
        "a warm-up step": f"lower warmup.micro_batch_size (now {config.warmup.micro_batch_size}){checkpointing}",
        "an RL update": f"lower algorithm.micro_batch_size{f' (now {micro})' if micro else ''}{checkpointing}",
        "making the reference model": "train LoRA (model.lora): full fine-tuning keeps a frozen copy of the denoiser "
        f"as the reference{sharding}",
        "loading the model": f"load the weights in bfloat16 (model.dtype, now {model.dtype}), or precompute the text "
        f"embeddings (model.text_embeddings: the text encoders are not loaded){sharding}",
        "preparing training": f"train LoRA (model.lora){sharding}",
    }.get(part, f"lower the batch sizes (algorithm.micro_batch_size, eval.batch_size){sharding}")


def memory_advice(exc: BaseException, config: Config) -> str:
    """One line for an ``out_of_memory`` error: where, how much was asked for and free, and what to change."""
    text = str(exc)
    asked = re.search(r"(?:Tried to allocate|you tried to allocate) ([\d.]+) ?(\w+)", text)
    amount = "" if asked is None else f"{asked[1]} {asked[2]}"
    if asked is not None and asked[2] == "bytes":  # the CPU allocator's unit
        amount = f"{float(asked[1]) / 2**30:.1f} GiB"
    free = re.search(r"total capacity of ([\d.]+ \w+) of which ([\d.]+ \w+) is free", text)
    detail = ", ".join(
        filter(None, [f"{amount} asked for" if amount else "", f"{free[2]} of {free[1]} free" if free else ""])
    )
    spare = re.search(r"([\d.]+) (\w+) is reserved by PyTorch but unallocated", text)
    fragmented = ""
    if spare and float(spare[1]) * _UNITS.get(spare[2], 0) >= 2**30:
        fragmented = (
            f"; {spare[1]} {spare[2]} was reserved but unallocated (fragmented): "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may be enough"
        )
    part = _part(exc)
    return (
        f"out of {'GPU' if _on_gpu(exc) else 'CPU'} memory in {part}{f' ({detail})' if detail else ''}: "
        f"{_settings(part, config)}{fragmented}"
    )
