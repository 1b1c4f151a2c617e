"""Counting the kernels a piece of code launches, independent of the device (benchmarks and tests)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class KernelCounter(TorchDispatchMode):
    """``with KernelCounter() as c: ...`` counts the aten ops that compute in ``c.kernels`` (views, detach
    and lift_fresh aside): on a GPU, at small sizes, each one is a launch. ``c.ops`` counts them by name
    (e.g. "mul", or "_allgather_base_": collectives dispatch as ops too)."""

    def __init__(self):
        super().__init__()
        self.kernels = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not func.is_view and name not in ("detach", "lift_fresh"):
            self.kernels += 1
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))
