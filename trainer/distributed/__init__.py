"""Parallel backends: the only package that imports ``torch.distributed``.

A ParallelBackend owns process-group setup, module wrapping, gradient synchronisation, the optimizer step
and collectives. The trainer calls it the same way in one CPU process or under torchrun on many nodes.
"""

from __future__ import annotations

from trainer.distributed.backend import ParallelBackend, SingleProcess, detect_world, init_backend

__all__ = ["ParallelBackend", "SingleProcess", "detect_world", "init_backend"]
