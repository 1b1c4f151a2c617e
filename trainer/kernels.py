"""Counting the kernels a piece of code launches, independent of the device (benchmarks and tests)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class KernelCounter(TorchDispatchMode):
    """``with KernelCounter() as c: ...`` counts the aten ops that compute in ``c.kernels`` (views, detach
    and lift_fresh aside): on a GPU, at small sizes, each one is a launch."""

    def __init__(self):
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__.split(".")[0] not in ("detach", "lift_fresh"):
            self.kernels += 1
        return func(*args, **(kwargs or {}))
