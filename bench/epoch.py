"""The real trainer's RL epoch at a chosen shape, with ``model.compile`` and attention variants side by side.

Defaults follow issue 20's recipe: 10 steps, guidance 4.5, noise level 0.7, groups of 8, 4 prompts an epoch
(32 images), training micro-batches of 8 (16 rows with CFG), KL beta 0.04, clip 1e-4, LoRA rank 32 / alpha 64, lr
3e-4, reward ``jpeg_compressibility`` served
by a local replica, on the model's tiny test dataset. ``--denoiser tiny`` runs the adapter's tiny test model (CPU);
``--denoiser real`` its published architecture with random weights (bench/adapters.py; a GPU). Per variant:
median of the epochs after the first (which compiles), with

    epoch s, img/s (whole epoch), rollout / reward-wait / update s, TFLOP/s (the epoch's FLOPs counted once in
    eager mode by torch's FlopCounterMode, over the epoch's time) and its fraction of a GEMM peak measured here,
    the same for the rollout alone (its FLOPs over the rollout's time) and the update alone (training units with
    their backward and reference forwards), peak memory (GPU: allocated; CPU: the process's peak RSS, which
    only grows), compile s and recompiles.

Attention variants are ``model.attention`` values, set as a run sets them (``auto`` probes on CUDA; its row
names the kernel it chose).

    python bench/epoch.py [--model sd3] [--denoiser tiny|real] [--compile none,blocks] [--attention auto,flash]
                          [--epochs 3] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the repository, and the tests' tiny models and datasets

import tiny_data  # noqa: E402
import tiny_models  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from bench.shapes import DENOISER_SIZES, SHAPES, denoiser_shape, resize_denoiser  # noqa: E402
from trainer.algorithms import build_algorithm  # noqa: E402
from trainer.algorithms.sft import SFT  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data import build_task  # noqa: E402
from trainer.distributed import SingleProcess  # noqa: E402
from trainer.logging import RunLogger  # noqa: E402
from trainer.models import build_adapter  # noqa: E402
from trainer.models.attention import ATTENTION_CHOICES  # noqa: E402
from trainer.models.common import LoraSettings  # noqa: E402
from trainer.rewards.client import HttpRewardClient  # noqa: E402
from trainer.rewards.launcher import LocalRewardPool  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

RECIPE = [
    "algorithm.name=grpo",
    "algorithm.group_size=8",
    "data.prompts_per_epoch=4",
    "algorithm.micro_batch_size=8",
    "algorithm.kl_beta=0.04",
    "algorithm.clip_range=1e-4",
    "algorithm.sampler.num_steps=10",
    "algorithm.sampler.guidance_scale=4.5",
    "algorithm.sampler.noise_level=0.7",
    "algorithm.sampler.sde_window=0",
    "algorithm.sampler.window_range=[0, 0]",
    "train.learning_rate=3e-4",
    "train.warmup_steps=0",
    "train.ema_decay=0",
    "reward.weights={jpeg_compressibility: 1.0}",
    "reward.replicas=1",
    "logging.progress=false",
]


def gemm_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s of a large square matmul in ``dtype`` here (best of a few): the peak the epoch is held to."""
    side = 8192 if device.type == "cuda" else 1024
    a, b = (torch.randn(side, side, device=device, dtype=dtype) for _ in range(2))
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * side**3 / best / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_trainer(config, device: torch.device, client, run_dir: Path) -> Trainer:
    torch.manual_seed(config.train.seed)
    adapter = build_adapter(config.model, device)
    trainer = Trainer(
        config,
        adapter,
        build_algorithm(config.algorithm),
        SFT(config.warmup),
        build_task(config.data),
        client,
        SingleProcess(device),
        RunLogger(run_dir, False, False),
    )
    trainer.backend.set_lr(config.train.learning_rate)
    if trainer.algorithm.needs_reference:
        trainer._new_reference()
    return trainer


def epoch_flops(config, device, client, run_dir: Path, prompts: int | None = None) -> tuple[float, float]:
    """FLOPs of one RL epoch (rollout, reward encoding aside, update and reference) and of its rollout alone,
    counted in eager mode; ``prompts``: count an epoch of that many prompts and scale (every FLOP of an epoch
    is per prompt's group)."""
    config.model.compile, attention = "none", config.model.attention
    # No probe; FLOPs do not depend on the kernel, memory does: math's attention matrices overflowed an H100's
    # 80 GB at SD3.5-Medium's shape (batch 16, 1229 tokens, 24 layers kept for the backward)
    config.model.attention = "flash" if device.type == "cuda" else "math"
    full = config.data.prompts_per_epoch
    config.data.prompts_per_epoch = prompts or full
    trainer = make_trainer(config, device, client, run_dir / "flops")
    config.model.attention, config.data.prompts_per_epoch = attention, full
    marks, update = [], trainer._update
    with FlopCounterMode(display=False) as counter:

        def marked(*args, **kwargs):  # the rollout's FLOPs: those counted when the first update starts
            marks.append(counter.get_total_flops())
            return update(*args, **kwargs)

        trainer._update = marked
        trainer.rl_epoch(0)
    del trainer
    gc.collect()
    scale = full / (prompts or full)
    return float(counter.get_total_flops()) * scale, float(marks[0]) * scale


def run_variant(config, device, client, run_dir: Path, epochs: int) -> dict[str, float]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch._dynamo.reset()  # dynamo does not guard on the attention kernel: no graph of the last variant is reused
    trainer = make_trainer(config, device, client, run_dir)
    records = []
    for epoch in range(epochs):
        sync(device)
        start = time.perf_counter()
        metrics = trainer.rl_epoch(epoch)
        sync(device)
        records.append({**metrics, "epoch_s": time.perf_counter() - start})
    steady = records[1:] or records
    row = {
        k: statistics.median(r[k] for r in steady)
        for k in ("epoch_s", "time_rollout_s", "time_reward_wait_s", "time_train_s", "rollout_images_per_s")
    }
    row["images"] = len(trainer.sampler.epoch(0)[0])
    row["kernel"] = trainer.attention.kernel
    row["compile_s"] = records[-1].get("compile_s", 0.0)
    row["recompiles"] = records[-1].get("compile_recompiles", 0)
    row["fallbacks"] = records[-1].get("compile_fallbacks", 0)
    row["peak_gib"] = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ) / 2**30
    del trainer
    gc.collect()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sd3", help="a registered text-to-image model (its tiny spec)")
    parser.add_argument("--denoiser", choices=sorted(DENOISER_SIZES), default="tiny")
    parser.add_argument("--compile", default="none,blocks", help="model.compile values, comma-separated")
    parser.add_argument(
        "--attention",
        default="auto",
        help=f"model.attention values, comma-separated, of {', '.join(ATTENTION_CHOICES)}",
    )
    parser.add_argument("--layers", type=int, default=None, help="cap the denoiser's depth (real widths on a CPU)")
    parser.add_argument(
        "--flops-prompts",
        type=int,
        default=None,
        help="count FLOPs on an epoch of this many prompts, scaled (default: the whole epoch)",
    )
    parser.add_argument("--epochs", type=int, default=3, help="epochs per variant; the first is not counted")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="model.dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--config", action="append", default=[], help="YAML files applied before the overrides")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config = load_config(args.config, RECIPE + args.overrides)
    with (
        tempfile.TemporaryDirectory() as root,
        LocalRewardPool(sorted(config.reward.weights), replicas=1, log_dir=Path(root) / "replicas") as pool,
    ):
        spec = tiny_models.tiny(args.model)
        if (shape := denoiser_shape(args.model, args.denoiser)) is not None:
            resize_denoiser(root, args.model, shape, args.layers, args.device, dtype)
        # Real shapes: 1024 image tokens, as at 512 px with SD3's VAE (the tiny VAE downsamples less)
        config.model = tiny_models.tiny_config(
            args.model,
            root,
            dtype=dtype,
            lora=LoraSettings(rank=32, alpha=64),
            **({"resolution": 2 * SHAPES[args.model].resolution} if args.denoiser == "real" else {}),
        )
        config.data.name, config.data.path = spec.data, tiny_data.tiny_dataset(spec.data, root)
        client = HttpRewardClient(pool.urls, config.reward.weights, batch_size=config.reward.batch_size)
        flops = epoch_flops(config, device, client, Path(root), args.flops_prompts)
        peak = gemm_peak_tflops(device, getattr(torch, dtype))
        print(
            f"epoch FLOPs {flops[0]:.4g} (rollout {flops[1]:.4g}); GEMM peak {peak:.4g} TFLOP/s",
            file=sys.stderr,
            flush=True,
        )
        rows = []
        for mode in args.compile.split(","):
            for attention in args.attention.split(","):
                config.model.compile, config.model.attention = mode, attention
                try:
                    row = run_variant(config, device, client, Path(root) / f"{mode}-{attention}", args.epochs)
                except (RuntimeError, ValueError) as error:  # e.g. an attention kernel this device lacks
                    print(f"{mode} / {attention}: failed: {str(error).splitlines()[0]}", flush=True)
                    continue
                rows.append((mode, attention, row))
                print(
                    f"{mode} / {attention}: {table_row(mode, attention, row, flops, peak)}", file=sys.stderr, flush=True
                )  # a run cut short still shows the variants it measured
        client.close()
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else "?"
    print(
        f"\n{args.model}, {args.denoiser} denoiser, {dtype} on {device} ({torch.get_num_threads()} threads), "
        f"{rows[0][2]['images'] if rows else '?'} images an epoch, {config.algorithm.sampler.num_steps} steps; "
        f"epoch FLOPs {flops[0]:.3g} (rollout {flops[1]:.3g}); GEMM peak {peak:.3g} TFLOP/s; "
        f"median of epochs 2-{max(args.epochs, 2)}; "
        f"load average {' '.join(load)}\n"
    )
    print(
        "| compile | attention | epoch s | img/s | rollout img/s | rollout s | reward wait s | update s "
        "| TFLOP/s | of peak | rollout of peak | update of peak | peak GiB | compile s | recompiles | fallbacks |"
    )
    print("|---" * 16 + "|")
    for mode, attention, r in rows:
        print(table_row(mode, attention, r, flops, peak))


def table_row(mode: str, attention: str, r: dict[str, float], flops: tuple[float, float], peak: float) -> str:
    """``flops``: (the epoch's, its rollout's); the update's are the rest."""
    total, rollout = flops
    tflops = total / r["epoch_s"] / 1e12
    rollout_share = rollout / r["time_rollout_s"] / 1e12 / peak
    update_share = (total - rollout) / r["time_train_s"] / 1e12 / peak
    shown = attention if attention == r["kernel"] else f"{attention} ({r['kernel']})"
    return (
        f"| {mode} | {shown} | {r['epoch_s']:.2f} | {r['images'] / r['epoch_s']:.2f} "
        f"| {r['rollout_images_per_s']:.2f} | {r['time_rollout_s']:.2f} | {r['time_reward_wait_s']:.2f} "
        f"| {r['time_train_s']:.2f} | {tflops:.3g} | {tflops / peak:.1%} | {rollout_share:.1%} "
        f"| {update_share:.1%} | {r['peak_gib']:.2f} | {r['compile_s']:.1f} | {r['recompiles']:.0f} "
        f"| {r['fallbacks']:.0f} |"
    )


if __name__ == "__main__":
    main()
