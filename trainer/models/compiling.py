"""``model.compile``: torch.compile of the denoiser's repeated blocks (or of its whole forward), in place.

A block's ``forward`` is replaced by one compiled function per block class, bound to the block: parameter
names, state dicts, hooks (FSDP2, ZeRO-3, IP-Adapter casts) and gradient checkpointing stay as they are, and a
deep copy (a frozen reference) binds the copy's own weights. The same compiled code serves the rollout, the
training forward and the reference, so that they compute identically (the on-policy ratio stays 1).
Blocks are found without help (``repeated_blocks``); an adapter whose blocks that misses may declare them as a
class attribute ``compiled_blocks`` (a tuple of block classes).
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

COMPILE_MODES = ("none", "blocks", "full")


def repeated_blocks(denoiser: nn.Module, declared: tuple[type[nn.Module], ...] = ()) -> list[nn.Module]:
    """The blocks to compile: every module of a ``declared`` class where an adapter declares them, else the
    entries of each ``nn.ModuleList`` whose entries are all of one class and are not leaves (transformer
    blocks, a UNet's resnets and attentions), outermost first: nothing inside a found block is taken again."""
    if declared:
        return [m for m in denoiser.modules() if isinstance(m, declared)]
    found: list[nn.Module] = []
    taken: list[str] = []
    for name, module in denoiser.named_modules():
        if any(name.startswith(prefix) for prefix in taken):
            continue
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and len({type(m) for m in module}) == 1
            and next(module[0].children(), None) is not None
        ):
            found.extend(module)
            taken.append(f"{name}.")
    return found


class CompileMonitor:
    """What compiling cost and whether it held, since construction: graphs compiled, recompiles (a graph
    compiled again for a new variant of code compiled before), compile seconds, and the fallbacks to eager at
    the recompile limit (each a warning naming its cause)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.fallbacks: list[str] = []
        self.recompiles = 0
        self._start = self._totals()
        self._seen = {str(m.compile_id) for m in _metrics()}
        _LimitHandler.install().monitor = self  # the latest monitor counts (one handler per process)

    @staticmethod
    def _totals() -> tuple[int, float]:
        from torch._dynamo.utils import compilation_time_metrics, counters

        return counters["stats"]["unique_graphs"], sum(compilation_time_metrics.get("_compile.compile_inner", []))

    def report(self) -> dict[str, float]:
        """``compile_graphs``, ``compile_recompiles``, ``compile_s`` and ``compile_fallbacks`` so far."""
        for m in _metrics():  # dynamo keeps the latest 64 or so: read at least once per epoch
            if str(m.compile_id) not in self._seen:
                self._seen.add(str(m.compile_id))
                self.recompiles += m.recompile_reason is not None
        graphs, seconds = self._totals()
        return {
            "compile_graphs": graphs - self._start[0],
            "compile_recompiles": self.recompiles,
            "compile_s": seconds - self._start[1],
            "compile_fallbacks": len(self.fallbacks),
        }

    def summary(self, mode: str, metrics: dict[str, float]) -> str:
        """One line on what compiling ``mode`` cost, from an epoch's ``metrics`` (``report()``'s keys)."""
        return (
            f"model.compile={mode}: {metrics['compile_graphs']:.0f} graphs compiled in {metrics['compile_s']:.1f} "
            f"s, {metrics['compile_recompiles']:.0f} recompiles (limit {self.limit}), "
            f"{metrics['compile_fallbacks']:.0f} fallbacks to eager"
        )


def _metrics() -> list:
    from torch._dynamo.utils import get_compilation_metrics

    return get_compilation_metrics()


class _LimitHandler(logging.Handler):
    """Turns dynamo's 'hit config.recompile_limit' record into our warning and a counted fallback."""

    installed: _LimitHandler | None = None

    def __init__(self):
        super().__init__(logging.WARNING)
        self.monitor: CompileMonitor | None = None

    @classmethod
    def install(cls) -> _LimitHandler:
        if cls.installed is None:
            cls.installed = cls()
            logging.getLogger("torch._dynamo").addHandler(cls.installed)
        return cls.installed

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.monitor is not None and "hit config." in message and "limit" in message:
            cause = " ".join(line.strip() for line in message.splitlines()[1:3])
            self.monitor.fallbacks.append(cause)
            logger.warning(
                "warning: model.compile: a compiled block runs eagerly from now on (its recompile limit "
                "%d is reached: %s); raise it or make the block's inputs stable",
                self.monitor.limit,
                cause,
            )


def compile_denoiser(
    denoiser: nn.Module,
    mode: str,
    declared: tuple[type[nn.Module], ...] = (),
    recompile_limit: int = 8,
    backend: str = "inductor",
) -> list[nn.Module]:
    """Compile ``denoiser`` in place as ``mode`` says ("blocks": its ``repeated_blocks``; "full": its whole
    forward; "none": nothing); returns the modules whose forward is now compiled. ``recompile_limit`` bounds
    the variants (shapes, grad mode, LoRA on / off) each compiled function keeps before running eagerly."""
    if mode == "none":
        return []
    if mode not in COMPILE_MODES:
        raise ValueError(f"model.compile={mode!r}: use one of {', '.join(COMPILE_MODES)}")
    modules = [denoiser] if mode == "full" else repeated_blocks(denoiser, declared)
    if not modules:
        raise ValueError(
            f"model.compile=blocks found no repeated blocks in {type(denoiser).__name__}: use "
            "model.compile=full, or declare the adapter's compiled_blocks"
        )
    tag_compile_caches()
    by_class: dict[type, list[nn.Module]] = {}
    for module in modules:
        by_class.setdefault(type(module), []).append(module)
    for cls, members in by_class.items():
        # Blocks of one class at several widths (a UNet's resnets and attentions, which also run at several
        # resolutions) compile for static shapes: inductor's code generation for their symbolic sizes fails
        # (sd15_inpaint on the CPU), and each instance may meet shapes of its own, so the limit grows with them.
        static = len({_widths(m) for m in members}) > 1
        limit = recompile_limit * (len(members) if static else 1)
        if "recompile_limit" in inspect.signature(torch.compile).parameters:
            compiled = torch.compile(
                cls.forward, backend=backend, dynamic=False if static else None, recompile_limit=limit
            )
        else:  # torch < 2.13 (CUDA images that ship their own torch): the process-wide limit
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            compiled = torch.compile(cls.forward, backend=backend, dynamic=False if static else None)
        for module in members:
            module.forward = types.MethodType(compiled, module)
    return modules


def _widths(module: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


def tag_compile_caches() -> None:
    """Name the enabled SDPA kernels in ``torch.compiler.config.cache_key_tag``, which inductor's FX graph and
    AOTAutograd cache keys include: a compiled graph bakes in the kernel that was enabled when it compiled, and
    those keys leave the kernel out (pytorch/pytorch#185449), so another run's graph could be reused."""
    cuda = torch.backends.cuda
    enabled = {
        "math": cuda.math_sdp_enabled(),
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "cudnn": cuda.cudnn_sdp_enabled(),
    }
    tag = torch.compiler.config.cache_key_tag.split("|sdpa=")[0]
    torch.compiler.config.cache_key_tag = f"{tag}|sdpa={','.join(k for k, on in enabled.items() if on)}"


def recompile_limit(batch_sizes: Iterable[int], reference_view: bool) -> int:
    """The variants a run's compiled block may meet, doubled for margin: each batch size (rollout chunks,
    training units, evaluation), with and without CFG's doubling, in and out of grad mode and train mode, and
    again with LoRA disabled where the reference is a view of the policy; never below torch's default of 8."""
    variants = len({n * k for n in batch_sizes for k in (1, 2)}) * 2 * 2 * (2 if reference_view else 1)
    return max(8, 2 * variants)


def compile_for_run(adapter, mode: str, batch_sizes: Iterable[int], backend: str = "inductor") -> CompileMonitor | None:
    """``mode`` applied to ``adapter``'s denoiser with torch.compile's ``backend`` and a recompile limit sized for
    ``batch_sizes``; the monitor reports what compiling cost (None for ``"none"``)."""
    if mode == "none":
        return None
    limit = recompile_limit(batch_sizes, not adapter.trainable.reference_spec.copy)
    monitor = CompileMonitor(limit)
    compile_denoiser(adapter.denoiser, mode, adapter.compiled_blocks, limit, backend)
    return monitor
