"""Overhead of the adapters over plain diffusers, per adapter, on tiny random models (CPU by default).

    .venv/bin/python bench/adapters.py [--names flux,sd15_inpaint,flux+ip] [--repeats 3] [--threads 2]
                                       [--scale 2] [--denoiser 9m] [--device cuda --dtype bfloat16]

``flux+ip`` is FLUX with a trainable IP-Adapter (random weights, LoRA as well); the plain pipeline gets the
same style embeddings (``ip_adapter_image_embeds``).

Columns (median over ``--repeats`` back-to-back pairs of ours / plain; lower is better):
  rollout   ``trainer.rollout.rollout`` (SDE or DDIM steps with log-probs, text encoding with an emptied
            prompt cache, image conditioning, VAE decode) / the model's diffusers pipeline on the same
            components, prompts, image inputs, steps, batch and guidance (decoding to images as well).
  train     one GRPO optimizer step's loss + backward over its units (LoRA rank 8) / replaying the very same
            denoiser calls (same CFG batch) as forward + backward of a mean-square loss, plus the reference
            network's forward when the KL is on. Optimizer steps are excluded from both.
  sampler   the adapter's rollout step (noise drawn, log-prob recorded) over T steps / the diffusers
            scheduler's ``step`` over T steps on the same tensors (FlowMatchEulerDiscreteScheduler: the
            deterministic Euler step; DDIMScheduler with the same eta, which draws noise too), at the
            rollout's own latent size in this table (e.g. [4, 256, 4] for FLUX): small tensors, where the
            per-call host time that a fast GPU also pays is what counts.
  sampler_big  the same at production latent sizes (FLUX 1024 px packed: [B, 4096, 64]; SD1.5 512 px:
            [B, 4, 64, 64]), where the step's arithmetic and, on the CPU, the serial noise draw count.
  noisy     ``sampler_big`` against the scheduler's own stochastic step (FlowMatchEulerDiscreteScheduler with
            ``stochastic_sampling=True``; DDIM as above): on the CPU, drawing the Gaussian noise alone costs
            several deterministic Euler steps, so this is the like-for-like cost of the log-probability.
  scored    the adapter's step scoring a given next sample (no noise draw: the training-time call, and the
            rollout step's arithmetic) / the deterministic Euler step: the overhead of the mean and the
            log-probability alone. On the CPU the noise draw is serial (mt19937: 3.5 ms for [4, 4096, 64],
            21 Euler steps); a GPU draws it in about one elementwise pass.
  kernels   kernels (non-view aten ops) one rollout step launches / one deterministic scheduler step: on a
            GPU, at small models, launches are the cost, so this is the device-independent part of ``sampler``.
  train_kernels  the same for ``train`` with the KL off: one GRPO step's units / their replay. The difference
            is what a unit adds to the denoiser's own forward and backward (batch selection, CFG batching, the
            step, the loss, statistics), whatever the machine's timing noise.
  rollout_ms, train_ms   our median times: the whole rollout batch, and one GRPO step's units (KL off).
  peak_GiB  the GPU's peak allocated memory over the train-step timings (CUDA only).
Large CPU temporaries are kept in the heap for the whole run (``keep_freed_memory``), as a GPU's caching
allocator keeps them: with glibc's defaults every step would time the kernel zeroing fresh pages instead.
``--denoiser 9m`` widens each denoiser to about 9 M parameters (the size of the public figure the issue
quotes: 1.00x rollout, 1.02-1.05x train step for a 9 M-parameter SD3 transformer); the text encoders, VAEs
and token counts stay tiny, so the denoiser's share of the time is what grows.
``--denoiser real`` gives each denoiser the published architecture's widths, heads and depths with random
weights, for a GPU: 2.23 B parameters for SD3.5 Medium, 11.89 B FLUX.1, 20.42 B Qwen-Image, 0.84 B the SD1.5
UNet (0.86 B published: its cross-attention reads the tiny text width); see bench/shapes.py. ``--scale 4``
then gives 4096 image tokens, as at 1024 px (SD1.5: 64x64 latents, as at 512 px); ``--scale 2`` 1024.
``--layers 1`` caps the transformers' depth so that the real widths run on a CPU. A resized denoiser whose copy
would not fit the disk is saved in float8 and loaded back in ``--dtype`` (``--store``; FLUX.2 [dev]: 32 GB, not
64). ``--gradient-checkpointing`` recomputes the denoiser's activations in the backward of both train columns, as
a real-size run would; bench/RESULTS_GPU.md holds an H100's table taken with it.
``--device cuda --dtype bfloat16`` runs the same comparison on a GPU (every timed call ends with a
device synchronisation; the noise generators live on the GPU, as the trainer's rollout generator does).
Targets: rollout <= 1.01x, train <= 1.01x, sampler <= 3x. The machine is shared: expect a few % of noise.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the repository, and the tests' tiny models and datasets

import diffusers  # noqa: E402
import tiny_models  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from bench import plain  # noqa: E402
from bench.shapes import DENOISER_SIZES, SHAPES, denoiser_shape, resize_denoiser  # noqa: E402
from trainer.algorithms.base import LossContext, Rewards  # noqa: E402
from trainer.algorithms.grpo import GRPO, GRPOConfig  # noqa: E402
from trainer.kernels import KernelCounter  # noqa: E402
from trainer.models import MODELS, build_adapter  # noqa: E402
from trainer.models.common import LoraSettings  # noqa: E402
from trainer.rollout import SamplerSettings, rollout  # noqa: E402
from trainer.samplers import standard_normal  # noqa: E402

BATCH = 4
NUM_STEPS = 4


def model_root(root: str, case: str) -> Path:
    """Where ``case``'s model folder lives: a variant's under a folder of its own."""
    variant = case.removesuffix("+ip").partition("@")[2]
    return Path(root) / variant if variant else Path(root)


def keep_freed_memory() -> None:
    """glibc: serve allocations up to 32 MiB from the heap and return freed memory to the kernel only past
    256 MiB of slack (defaults: mmap from 128 KiB, adaptively, and trim past 128 KiB)."""
    if sys.platform == "linux":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD


def synchronize() -> None:
    """Wait for queued GPU work (a no-op on the CPU), so that a timed call includes its kernels."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timing(NamedTuple):
    ratio: float
    """Median over pairs of time(ours) / time(plain)."""
    ours_ms: float
    plain_ms: float


def compare(ours: Callable[[], object], plain: Callable[[], object], repeats: int) -> Timing:
    """Median over ``repeats`` back-to-back pairs of time(``ours``) / time(``plain``), after one warm-up
    call each: a pair shares the machine's state of the moment, so load drifts cancel in its ratio. The
    median times themselves come along, in milliseconds."""
    ours(), plain()
    ratios, pairs = [], []
    for _ in range(repeats):
        times = []
        for fn in (ours, plain):
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            times.append(time.perf_counter() - start)
        ratios.append(times[0] / times[1])
        pairs.append(times)
    return Timing(statistics.median(ratios), *(1e3 * statistics.median(t) for t in zip(*pairs, strict=True)))


class Recorder(nn.Module):
    """Calls ``net`` and appends (net, args, kwargs) of every call to ``calls`` (for replay)."""

    def __init__(self, net: nn.Module, calls: list):
        super().__init__()
        self.net, self.calls = net, calls

    def forward(self, *args, **kwargs):
        self.calls.append((self.net, args, kwargs))
        return self.net(*args, **kwargs)


def bench_adapter(
    case: str,
    root: str,
    repeats: int,
    scale: int = 1,
    denoiser: str = "tiny",
    device: str = "cpu",
    dtype: str = "float32",
    max_layers: int | None = None,
    gradient_checkpointing: bool = False,
    store: str = "auto",
) -> dict[str, float]:
    """One table row for ``case`` (``name``, ``name+ip`` or ``name@variant``); ``denoiser``: a DENOISER_SIZES key."""
    name, _, variant = case.removesuffix("+ip").partition("@")
    root = str(model_root(root, case))
    shape = denoiser_shape(name, denoiser, variant)
    if shape is not None and not (Path(root) / name / "model_index.json").is_file():
        resize_denoiser(root, name, shape, max_layers, device, dtype, store)
    overrides: dict = {"gradient_checkpointing": gradient_checkpointing}
    if SHAPES[name].resolution is not None:
        overrides["resolution"] = SHAPES[name].resolution * scale
    if case.endswith("+ip"):
        overrides["ip_adapter"] = tiny_models.tiny_ip_adapter(root)
    adapter = build_adapter(
        tiny_models.tiny_config(name, root, dtype=dtype, lora=LoraSettings(rank=8, alpha=8), **overrides), device
    )
    if case.endswith("+ip"):
        tiny_models.randomize_ip_adapter(adapter)
    adapter.pipeline.set_progress_bar_config(disable=True)
    prompts = [p for p in ("a photo of a cat", "the digit five") for _ in range(BATCH // 2)]
    group_ids = torch.arange(BATCH) // 2
    inputs = tiny_models.image_inputs(adapter, BATCH)
    ddim = adapter.sampler_kind == "ddim"
    settings = SamplerSettings(
        num_steps=NUM_STEPS,
        guidance_scale=SHAPES[name].guidance,
        kind="ddim" if ddim else "sde",
        noise_level=1.0 if ddim else 0.7,
    )
    row = {"params": sum(p.numel() for n, p in adapter.denoiser.named_parameters() if "lora" not in n) / 1e6}

    def ours_rollout():
        adapter.prompts.clear()
        return rollout(
            adapter, adapter.denoiser, prompts, group_ids, settings, torch.Generator(device).manual_seed(0), inputs
        )

    def plain_rollout():
        generator = torch.Generator(device).manual_seed(0)
        with plain.stand_ins(adapter.pipeline, name):
            out = tiny_models.run_pipeline(
                adapter, prompts, inputs, NUM_STEPS, SHAPES[name].guidance, generator, plain.output_type(adapter, name)
            )
        return plain.decoded(adapter.pipeline, name, out)

    timing = compare(ours_rollout, plain_rollout, repeats)
    row["rollout"], row["rollout_ms"] = timing.ratio, timing.ours_ms

    ro = ours_rollout()
    rewards = torch.arange(BATCH, dtype=torch.float32)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    for kl in (0.0, 0.04):
        algorithm = GRPO(GRPOConfig(group_size=2, kl_beta=kl, sampler=settings, timestep_fraction=0.5))
        batch = algorithm.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
        (units,) = algorithm.plan(batch, torch.Generator().manual_seed(0))
        calls: list = []
        ctx = LossContext(
            adapter, Recorder(adapter.denoiser, calls), Recorder(adapter.trainable.reference(), calls) if kl else None
        )

        def ours_train(ctx=ctx, algorithm=algorithm, units=units):
            for unit in units:
                algorithm.loss(ctx, unit)[0].backward()
            adapter.denoiser.zero_grad(set_to_none=True)

        ours_train()
        replay = list(calls)

        def plain_train(replay=replay):
            for net, args, kwargs in replay:
                if net is adapter.denoiser:
                    out = net(*args, **kwargs)[0]  # a tensor, or one per sample (Z-Image)
                    (out if isinstance(out, torch.Tensor) else torch.stack(out)).float().square().mean().backward()
                else:
                    with torch.no_grad():
                        net(*args, **kwargs)
            adapter.denoiser.zero_grad(set_to_none=True)

        timing = compare(ours_train, plain_train, repeats)
        row["train_kl_on" if kl else "train_kl_off"] = timing.ratio
        if not kl:
            row["train_ms"] = timing.ours_ms
            row["train_kernels"] = "/".join(str(count_kernels(fn)) for fn in (ours_train, plain_train))
    row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else "-"

    row["sampler"] = bench_sampler(adapter, settings, repeats, shape=(BATCH, *adapter.latent_shape)).ratio
    row["sampler_big"] = bench_sampler(adapter, settings, repeats).ratio
    row["noisy"] = bench_sampler(adapter, settings, repeats, stochastic_baseline=True).ratio
    row["scored"] = bench_sampler(adapter, settings, repeats, scored=True).ratio
    row["kernels"] = count_step_kernels(adapter, settings)
    return row


def bench_sampler(
    adapter,
    settings: SamplerSettings,
    repeats: int,
    loops: int = 5,
    stochastic_baseline: bool = False,
    scored: bool = False,
    shape: tuple[int, ...] | None = None,
) -> Timing:
    """T steps of the adapter's step function vs T steps of its diffusers scheduler, on the same tensors
    (with the flow scheduler's ``stochastic_sampling`` when ``stochastic_baseline``; scoring a given next
    sample against the deterministic step when ``scored``)."""
    if shape is None:
        shape = (BATCH, 4, 64, 64) if adapter.sampler_kind == "ddim" else (BATCH, 4096, 64)
    loops *= max(1, (BATCH * 4096 * 64) // (20 * math.prod(shape)))  # small tensors: more calls per timing
    device = adapter.device
    x = standard_normal(shape, torch.Generator().manual_seed(0), device)
    out = standard_normal(shape, torch.Generator().manual_seed(1), device)
    schedule = adapter.sigmas(NUM_STEPS)
    step = adapter.step_function(settings.kind, schedule)
    scheduler = adapter.scheduler
    timesteps = scheduler.timesteps
    eta = {"eta": settings.noise_level} if adapter.sampler_kind == "ddim" and not scored else {}
    g = torch.Generator(device).manual_seed(2)
    given = {"prev_sample": standard_normal(shape, torch.Generator().manual_seed(3), device)} if scored else {}

    def ours():
        for _ in range(loops):
            for i in range(NUM_STEPS):
                step(out, x, i, settings.noise_level, generator=g, **given)

    def plain():
        for _ in range(loops):
            if hasattr(scheduler, "set_begin_index"):
                scheduler._step_index = None
                scheduler.set_begin_index(0)
            for t in timesteps:
                scheduler.step(out, t, x, generator=g, **eta)

    flow = adapter.sampler_kind != "ddim"
    if stochastic_baseline and flow:
        scheduler.register_to_config(stochastic_sampling=True)
    try:
        return compare(ours, plain, repeats)
    finally:
        if stochastic_baseline and flow:
            scheduler.register_to_config(stochastic_sampling=False)


def count_kernels(fn: Callable[[], object]) -> int:
    """Kernels (non-view aten ops) one call of ``fn`` launches."""
    with KernelCounter() as counter:
        fn()
    return counter.kernels


def count_step_kernels(adapter, settings: SamplerSettings) -> str:
    """ "ours/plain": kernels of one mid-schedule rollout step and of the scheduler's deterministic step."""
    shape = (BATCH, 4, 8, 8) if adapter.sampler_kind == "ddim" else (BATCH, 64, 64)
    x, out = torch.randn(shape, device=adapter.device), torch.randn(shape, device=adapter.device)
    step = adapter.step_function(settings.kind, adapter.sigmas(NUM_STEPS))
    scheduler, t = adapter.scheduler, adapter.scheduler.timesteps[1]
    step(out, x, 1, settings.noise_level)  # its constants are computed once, at the first call
    counts = []
    for fn in (lambda: step(out, x, 1, settings.noise_level), lambda: scheduler.step(out, t, x)):
        if hasattr(scheduler, "set_begin_index"):
            scheduler._step_index = None
        counts.append(count_kernels(fn))
    return f"{counts[0]}/{counts[1]}"


def _cell(column: str, value) -> str:
    if isinstance(value, str):
        return f"{value:>14}"
    return f"{value:>14.1f}" if column.endswith(("_ms", "_GiB")) else f"{value:>13.3f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--names",
        default=",".join(sorted(MODELS)),
        help="comma-separated adapter names, flux+ip (FLUX with an IP-Adapter), or name@variant "
        "(another published size with --denoiser real: sd3@large)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--scale",
        type=int,
        default=1,
        help="image side x scale (scale^2 x the tokens): how the overheads shrink with the work",
    )
    parser.add_argument(
        "--denoiser",
        choices=tuple(DENOISER_SIZES),
        default="tiny",
        help="denoiser size: the tests' tiny one, widened to about 9 M parameters, or the real "
        "architectures' widths and depths (random weights; a GPU's work)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="cap each transformer stack at this many blocks (e.g. --denoiser real --layers 1 "
        "checks the real widths on a CPU)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute the denoiser's activations in backward (both columns of train), as a "
        "real-size run would; bench/RESULTS_GPU.md was taken with it",
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weights and forward dtype of every component (the step math stays float32)",
    )
    parser.add_argument(
        "--store",
        choices=("auto", "float8_e5m2"),
        default="auto",
        help="the dtype a resized denoiser is saved in before the adapter loads it in --dtype: "
        "auto: --dtype, or float8_e5m2 where that copy would not fit the disk (FLUX.2 [dev])",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    diffusers.utils.logging.disable_progress_bar()  # saving and loading each model would print bars
    transformers.utils.logging.disable_progress_bar()
    if args.device == "cpu":
        keep_freed_memory()
    columns = (
        "rollout",
        "train_kl_off",
        "train_kl_on",
        "sampler",
        "sampler_big",
        "noisy",
        "scored",
        "kernels",
        "train_kernels",
        "rollout_ms",
        "train_ms",
        "peak_GiB",
    )
    print(
        f"batch {BATCH}, {NUM_STEPS} steps, LoRA rank 8, {args.dtype} on {args.device}, {args.threads} threads, "
        f"image side x{args.scale}, {args.denoiser} denoiser"
        + (f" capped at {args.layers} blocks per stack" if args.layers else "")
        + "; ratio = ours / plain, "
        "ms = ours (rollout: the whole batch; train: one GRPO step's units, KL off), peak_GiB: GPU memory"
    )
    print(f"{'adapter':<14}{'params':>9}" + "".join(f"{c:>14}" for c in columns))
    cases = args.names.split(",")
    with tempfile.TemporaryDirectory() as root:
        for i, case in enumerate(cases):
            try:
                row = bench_adapter(
                    case,
                    root,
                    args.repeats,
                    args.scale,
                    args.denoiser,
                    args.device,
                    args.dtype,
                    args.layers,
                    args.gradient_checkpointing,
                    args.store,
                )
                print(f"{case:<14}{row['params']:>8.1f}M" + "".join(_cell(c, row[c]) for c in columns), flush=True)
            except torch.OutOfMemoryError as error:
                print(f"{case:<14}  out of memory: {str(error).splitlines()[0]}", flush=True)
            name = case.removesuffix("+ip")
            if args.denoiser != "tiny" and all(c.removesuffix("+ip") != name for c in cases[i + 1 :]):
                shutil.rmtree(model_root(root, case) / name.partition("@")[0])  # real sizes: up to 41 GB each
            gc.collect()
            if args.device != "cpu":
                torch.cuda.empty_cache()
    print("targets: rollout <= 1.01x, train <= 1.01x, sampler <= 3x")


if __name__ == "__main__":
    main()
