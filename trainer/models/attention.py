"""``model.attention``: which SDPA kernel runs the run's attention, chosen by evidence or by the user.

``auto`` on CUDA probes: one forward and backward of the run's denoiser blocks (each block class's first call,
captured from one forward at the run's shapes and dtype) per candidate kernel, each checked finite and close
to the math kernel's result, and timed; the fastest that passes is used. A named kernel is used as asked
(checked once: a kernel that cannot run the blocks here is refused). The choice is process-wide, so rollout,
training, reference and evaluation share it, and is applied before anything compiles: a compiled graph bakes
the kernel in, and the compile caches are tagged with it (pytorch/pytorch#185449: inductor's cache key ignores
the kernel, so a graph compiled for one would be reused for another).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_unflatten

from trainer.models.common import DTYPES
from trainer.models.compiling import repeated_blocks

logger = logging.getLogger(__name__)

ATTENTION_CHOICES = ("auto", "math", "flash", "efficient", "cudnn")
"""``model.attention`` values: ``auto`` chooses (a probe on CUDA; :data:`UNPROBED` elsewhere)."""
KERNELS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
CUDA_CANDIDATES = ("cudnn", "flash", "efficient", "math")
"""What ``auto`` tries on CUDA (math last: it is also the reference the others are checked against)."""
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2, torch.float16: 5e-3}
"""Largest relative error ||x - math|| / ||math|| of any block output or input gradient, by the run's dtype:
a few roundings of the dtype through softmax and the block's matmuls (TF32 ones in float32)."""
_SWITCHES = {
    "math": torch.backends.cuda.enable_math_sdp,
    "flash": torch.backends.cuda.enable_flash_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
}


@dataclass
class Verdict:
    """One candidate's outcome: passed (with its median seconds) or rejected, and why."""

    kernel: str
    passed: bool
    seconds: float | None
    reason: str
    runs: bool = True
    """False: the kernel raised (not available for these inputs here), rather than failing the checks."""


@dataclass
class AttentionChoice:
    """The kernel a run uses, how it was chosen (``auto``, or the user's ``model.attention``) and the evidence."""

    kernel: str
    mode: str
    verdicts: list[Verdict] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the run's output: the choice and each candidate's time or reason."""
        head = f"model.attention={self.mode}: {self.kernel}"
        if not self.verdicts:
            return head + (" (torch's order without cuDNN)" if self.kernel == "default" else "")
        parts = [
            f"{v.kernel} {v.seconds * 1e3:.2f} ms" if v.passed else f"{v.kernel} rejected ({v.reason})"
            for v in self.verdicts
        ]
        return f"{head} (blocks forward+backward: {'; '.join(parts)})"

    def record(self) -> dict:
        """The choice as a metrics.jsonl record: the kernel, each candidate's milliseconds or reason."""
        out: dict = {"kernel": self.kernel, "mode": self.mode}
        for v in self.verdicts:
            out[f"{v.kernel}_ms"] = v.seconds * 1e3 if v.passed else None
            if not v.passed:
                out[f"{v.kernel}_rejected"] = v.reason
        return out


def check_attention(value: str) -> str:
    """``value`` if it names a choice, else one error line naming them."""
    if value not in ATTENTION_CHOICES:
        raise ValueError(f"model.attention={value!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    return value


UNPROBED = ("flash", "efficient", "math")
"""``auto`` until a probe chooses (or where none runs: tests, benchmarks, scripts): torch's order without
cuDNN, whose backward gave NaN gradients for the FLUX.1 family on an H100 (bench/RESULTS_GPU.md)."""


def use_attention(kernel: str) -> None:
    """Make ``kernel`` the process's attention (``default``/``auto``: :data:`UNPROBED`). A named kernel runs
    every call it supports; math takes the rest (a text encoder's masked attention)."""
    enabled = set(UNPROBED) if kernel in ("default", "auto") else {check_attention(kernel), "math"}
    for name, switch in _SWITCHES.items():
        switch(name in enabled)


def probe(
    step: Callable[[], Sequence[torch.Tensor]],
    candidates: Sequence[str],
    dtype: torch.dtype,
    *,
    repeats: int = 3,
    sync: Callable[[], None] = lambda: None,
) -> AttentionChoice:
    """The fastest of ``candidates`` whose ``step()`` (a forward+backward returning outputs and gradients) gives
    finite results within ``TOLERANCE[dtype]`` of the math kernel's; math when none passes. Each candidate
    runs alone (``sdpa_kernel``), once checked, then ``repeats`` times timed (``sync`` waits for the device)."""
    with sdpa_kernel(SDPBackend.MATH):
        reference = [t.detach().float() for t in step()]
    verdicts = [_try(name, step, reference, TOLERANCE[dtype], repeats, sync) for name in candidates]
    passed = [v for v in verdicts if v.passed]
    best = min(passed, key=lambda v: v.seconds).kernel if passed else "math"
    return AttentionChoice(best, "auto", verdicts)


def _try(name: str, step, reference: list[torch.Tensor], tolerance: float, repeats: int, sync) -> Verdict:
    try:
        with sdpa_kernel(KERNELS[name]):
            result = [t.detach().float() for t in step()]
            bad = _mismatch(result, reference, tolerance)
            if bad:
                return Verdict(name, False, None, bad)
            times = []
            for _ in range(repeats):
                sync()
                start = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - start)
    except RuntimeError as error:
        if "CUDA error" in str(error):  # the context is unusable now: no later candidate could run
            raise ValueError(
                f"model.attention=auto: the {name} kernel broke the CUDA context "
                f"({str(error).splitlines()[0]}); set model.attention to another of "
                f"{', '.join(k for k in KERNELS if k != name)}"
            ) from error
        return Verdict(name, False, None, str(error).strip().splitlines()[0][:160], runs=False)
    return Verdict(name, True, statistics.median(times), "")


def _mismatch(result: list[torch.Tensor], reference: list[torch.Tensor], tolerance: float) -> str:
    """Why ``result`` fails against ``reference`` (non-finite, or too far), or ""."""
    for i, (got, want) in enumerate(zip(result, reference, strict=True)):
        if not bool(torch.isfinite(got).all()):
            return f"non-finite values in tensor {i + 1} of {len(result)} (outputs, then input gradients)"
        error = float((got - want).norm() / want.norm().clamp_min(1e-12))
        if error > tolerance:
            return f"relative error {error:.2g} > {tolerance:g} against math in tensor {i + 1} of {len(result)}"
    return ""


def block_step(
    blocks: Sequence[nn.Module], forward: Callable[[], object], seed: int = 0
) -> Callable[[], list[torch.Tensor]]:
    """A forward+backward of ``blocks`` at the run's shapes: ``forward()`` (one denoiser forward) runs once
    without gradients to capture each block class's first call; the returned function calls those blocks
    again and returns their outputs and the gradients of their floating-point inputs (fixed random
    cotangents), touching no parameter's ``.grad``."""
    calls: dict[type, tuple[nn.Module, tuple, dict]] = {}

    def capture(module, args, kwargs):
        if type(module) not in calls:
            calls[type(module)] = (module, *_detached((args, kwargs)))

    handles = [b.register_forward_pre_hook(capture, with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    if not calls:
        raise ValueError("model.attention: the denoiser's forward called none of its blocks")
    generator = torch.Generator().manual_seed(seed)
    cotangents: dict[type, list[torch.Tensor]] = {}

    def step() -> list[torch.Tensor]:
        results = []
        for cls, (block, args, kwargs) in calls.items():
            leaves, spec = tree_flatten((args, kwargs))
            inputs = [t.detach().requires_grad_(True) if _floating(t) else t for t in leaves]
            with torch.enable_grad():
                a, k = tree_unflatten(inputs, spec)
                outputs = [t for t in tree_flatten(block(*a, **k))[0] if _floating(t)]
                if cls not in cotangents:
                    cotangents[cls] = [torch.randn(o.shape, generator=generator).to(o) for o in outputs]
                pairs = [(o, c) for o, c in zip(outputs, cotangents[cls], strict=True) if o.requires_grad]
                wrt = [t for t in inputs if _floating(t)]
                grads = torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True)
            results += [o.detach() for o in outputs] + [g for g in grads if g is not None]
        return results

    return step


def _floating(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _detached(tree):
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves], spec)


def attention_for_run(
    adapter, mode: str, cond, sampler, broadcast: Callable[[object], object] = lambda choice: choice
) -> AttentionChoice:
    """Apply ``model.attention`` for a run, before its denoiser is compiled or wrapped: ``auto`` probes the
    CUDA candidates on the blocks of one denoiser forward (``cond``: one item's conditioning, at ``sampler``'s
    guidance and first noise level) and uses the
    fastest that passes (rank 0's choice on every rank, through ``broadcast``); elsewhere torch's order. A
    named kernel is checked on the blocks: one that cannot run them is refused, one that fails the checks is
    used as asked, with a warning."""
    device = torch.device(adapter.device)
    if mode == "auto" and device.type != "cuda":
        use_attention("auto")
        return AttentionChoice("default", mode)
    use_attention("auto")  # the probe sets each candidate itself
    blocks = repeated_blocks(adapter.denoiser, adapter.compiled_blocks)
    sigma = adapter.sigmas(sampler.num_steps)[:1]
    generator = torch.Generator(device).manual_seed(0)
    step = block_step(
        blocks,
        lambda: adapter.predict(
            adapter.denoiser, adapter.prepare_latents(1, generator), sigma, cond, sampler.guidance_scale
        ),
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = DTYPES[adapter.config.dtype]
    if mode == "auto":
        choice = broadcast(probe(step, CUDA_CANDIDATES, dtype, sync=sync))
    else:
        choice = probe(step, [check_attention(mode)], dtype, repeats=1, sync=sync)
        (verdict,) = choice.verdicts
        if not verdict.runs:
            usable = ", ".join(k for k in (KERNELS if device.type == "cuda" else ("math", "flash")) if k != mode)
            raise ValueError(
                f"model.attention={mode} cannot run this model's blocks on {device.type} "
                f"({verdict.reason}); use auto or one of {usable}"
            )
        if not verdict.passed:
            logger.warning(
                "warning: model.attention=%s failed the check against math on this model's blocks (%s); "
                "used as asked: model.attention=auto chooses a kernel that passes",
                mode,
                verdict.reason,
            )
        choice = AttentionChoice(mode, mode, choice.verdicts)
    use_attention(choice.kernel)
    return choice
