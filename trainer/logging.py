"""Run outputs: JSONL metrics, image grids and the reward curve, and the trackers (TensorBoard, W&B) fed from
them (rank 0 writes)."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from shared.imagecodec import DEFAULT_FPS
from trainer.models.base import ImageInputs
from trainer.trackers import Picture, TensorBoardTracker, Tracker, finite_numbers, pil_image
from trainer.video import is_video, save_video


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[B, C, H, W] in [0, 1] -> [B, H, W, C] uint8 (videos: [B, F, C, H, W] -> [B, F, H, W, C]), converted once for
    the whole batch."""
    order = (0, 1, 3, 4, 2) if is_video(images) else (0, 2, 3, 1)
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(*order).cpu().numpy()


GRID_ENLARGES_BELOW = 128
"""Images whose larger side is under this many pixels are enlarged in grids (nearest neighbour, up to 4x: a
16-pixel digit becomes visible); larger ones keep their size (16 rows of 1024-pixel images at 4x would be 270 M
pixels, more than PIL opens)."""


def grid_pixels(pixels: np.ndarray, rows: int) -> np.ndarray:
    """Images [N, H, W, C] uint8 -> a grid of ``rows`` rows (one per prompt) with 1-pixel borders, [H', W', C],
    small images enlarged (``GRID_ENLARGES_BELOW``); videos [N, F, H, W, C] -> an animated grid [F, H', W', C]."""
    if is_video(pixels):
        return np.stack([grid_pixels(np.ascontiguousarray(pixels[:, f]), rows) for f in range(pixels.shape[1])])
    n, h, w, c = pixels.shape
    cols = math.ceil(n / rows)
    grid = np.full((rows * (h + 1) + 1, cols * (w + 1) + 1, c), 64, dtype=np.uint8)
    for i, img in enumerate(pixels):
        r, col = divmod(i, cols)
        grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + col * (w + 1) : 1 + col * (w + 1) + w] = img
    scale = max(1, min(4, GRID_ENLARGES_BELOW // max(h, w)))
    return grid.repeat(scale, axis=0).repeat(scale, axis=1)


def save_image(pixels: np.ndarray, path: str | os.PathLike, fps: float = DEFAULT_FPS) -> Picture:
    """Save [H, W, C] uint8 (greyscale for one channel) as a PNG, or a JPEG where ``path`` ends in .jpg (quality 90:
    a view, encoded 20x faster). PNGs use zlib level 1: 4x faster than PIL's default for 20% more bytes (a
    1024-px evaluation grid took seconds on rank 0 at the default; bench/outputs.py). A video [F, H, W, C] at ``fps``:
    an animated GIF (.gif, .jpg) or a lossless APNG (.png) (``save_video``)."""
    if pixels.ndim == 4:
        return save_video(pixels, Path(path).with_suffix(".gif") if str(path).endswith(".jpg") else path, fps)
    height, width, channels = pixels.shape
    image = pil_image(pixels)
    if str(path).endswith(".jpg"):
        image.save(path, quality=90)
    else:
        image.save(path, compress_level=1)
    return Picture(Path(path), height, width, channels)


def save_grid(images: torch.Tensor, rows: int, path: str | os.PathLike, fps: float = DEFAULT_FPS) -> Picture:
    """Save images [N, C, H, W] (videos [N, F, C, H, W]) in [0, 1] as a grid of ``rows`` rows (``grid_pixels``,
    ``save_image``)."""
    return save_image(grid_pixels(to_uint8(images), rows), path, fps)


MASK_TINT = (1.0, 0.0, 1.0)
"""The colour half-blended into an inpainting source image where its mask says repaint (magenta)."""


def input_rows(inputs: ImageInputs | None, like: torch.Tensor) -> list[torch.Tensor]:
    """The images a rollout was conditioned on, as grid rows [N, C, H, W] shaped ``like`` (its outputs): the
    inpainting source with the repaint region tinted (``MASK_TINT``), each reference image, the style image, a
    video's last frame."""
    if inputs is None:
        return []
    if is_video(like):  # each input image held over the video's frames
        return [row[:, None].expand(-1, like.shape[1], -1, -1, -1) for row in input_rows(inputs, like[:, 0])]
    n, channels, size = len(like), like.shape[1], like.shape[-2:]
    rows = []
    if inputs.image is not None:
        image = inputs.image[:n].float()
        if inputs.mask is not None:
            mask = 0.5 * inputs.mask[:n].float()
            image = image * (1 - mask) + mask * torch.tensor(MASK_TINT[: image.shape[1]]).view(1, -1, 1, 1)
        rows.append(image)
    if inputs.reference is not None:
        reference = inputs.reference[:n].float()
        rows.extend(reference.unbind(1) if reference.dim() == 5 else [reference])
    if inputs.style is not None:
        rows.append(inputs.style[:n].float())
    if inputs.last_image is not None:
        rows.append(inputs.last_image[:n].float())
    fitted = []
    for row in rows:
        row = row.cpu()
        if row.shape[1] != channels:  # a greyscale model's view of an RGB input, or the other way round
            row = row.mean(1, keepdim=True) if channels == 1 else row.expand(-1, channels, -1, -1)
        if row.shape[-2:] != size:
            row = torch.nn.functional.interpolate(row, size=tuple(size), mode="bilinear", antialias=True)
        fitted.append(row)
    return fitted


def with_inputs(images: torch.Tensor, rows: int, inputs: ImageInputs | None) -> torch.Tensor:
    """``rows`` rows of samples [rows * S, C, H, W] with each row's image inputs (one item per row: ``input_rows``)
    put before its samples: [rows * (k + S), C, H, W] for k input images per item."""
    shown = input_rows(inputs, images[:: len(images) // rows])
    if not shown:
        return images
    return torch.cat(
        [torch.cat([*(row[r : r + 1] for row in shown), samples]) for r, samples in enumerate(images.chunk(rows))]
    )


WAIT_NOTED = 0.25
"""The share of an RL epoch spent waiting for rewards after sampling above which its printed line says so."""


def eval_line(metrics: dict[str, float]) -> str:
    """An evaluation's printed metrics: of a breakdown only the means (every value's is in metrics.jsonl), and
    failed_share only when some image got no reward."""
    return "  ".join(
        f"{k} {v:.3f}"
        for k, v in metrics.items()
        if (not k.startswith("by_") or k.endswith("/mean")) and not (k == "failed_share" and v == 0)
    )


def epoch_line(epoch: int, metrics: dict[str, float], shown: Sequence[str]) -> str:
    """RL epoch ``epoch``'s printed line: its reward, accuracies, the algorithm's ``shown`` metrics, the rates, and
    what went wrong (skipped steps; samples without a reward; no group whose rewards differ; a long wait for
    rewards)."""
    keys = [k for k in metrics if k.endswith("accuracy")] + [k for k in shown if k in metrics]
    line = (
        f"epoch {epoch:3d}  reward {metrics['reward_mean']:.3f}±{metrics['reward_std']:.3f}  "
        + "  ".join(f"{k} {metrics[k]:.3g}" for k in keys)
        + f"  img/s {metrics['images_per_s']:.2f}"
        + f"  rollout img/s {metrics['rollout_images_per_s']:.2f}"
    )
    if metrics.get("skipped_steps"):
        line += f"  ({metrics['skipped_steps']:.0f} steps skipped: gradients not finite)"
    if metrics.get("failed_share"):  # under reward.max_failed_share, else the run had stopped
        line += f"  ({metrics['failed_share']:.0%} of samples without a reward: they carry no signal)"
    if metrics["zero_std_share"] == 1.0:  # a saturated reward, or one blind to what differs within a group
        line += "  (no group's rewards differ: nothing to learn from them)"
    waited = metrics.get("time_reward_wait_s", 0.0) / max(metrics.get("time_epoch_s", 0.0), 1e-9)
    if waited > WAIT_NOTED and metrics.get("reward_failed_attempts"):  # retries and failovers took the time
        line += (
            f"  (waited {waited:.0%} of the epoch for rewards after sampling; {metrics['reward_failed_attempts']:.0f}"
            " reward requests failed and were retried: see the reward servers' logs)"
        )
    elif waited > WAIT_NOTED:  # sampling is done and scoring is not: the devices idle
        line += (
            f"  (waited {waited:.0%} of the epoch for rewards after sampling: the reward servers score slower "
            "than the model samples; more replicas would shorten it)"
        )
    return line


class RunLogger:
    """Writes metrics to ``metrics.jsonl`` under the run directory and passes them on to TensorBoard (when
    ``tensorboard``) and the other ``trackers``, which their maker closes (no-op off rank 0)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, trackers: Sequence[Tracker] = ()):
        self.run_dir = run_dir
        self.enabled = enabled
        self.history: list[dict] = []
        self.trackers: list[Tracker] = []
        self.fps: float = DEFAULT_FPS
        """A video model's frame rate, for its animated samples and grids (the trainer sets its adapter's)."""
        self._tensorboard = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(run_dir / "metrics.jsonl", "a")
            self._tensorboard = TensorBoardTracker(run_dir) if tensorboard else None
            self.trackers = [self._tensorboard, *trackers] if tensorboard else list(trackers)

    def truncate(self, warmup_steps_done: int, epochs_done: int) -> None:
        """After a resume: keep only the records of work the checkpoint holds, the ones written before its own
        "checkpoint" record (later ones are redone). Without that record (a kill between the checkpoint's
        rename and its record) the records of the steps it covers. Rewritten atomically; a last line cut off
        by a kill is dropped."""
        if not self.enabled:
            return
        path = self.run_dir / "metrics.jsonl"
        records = []
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # only the last line can be partial: the file is appended line by line
        mark = next(
            (
                i
                for i, r in enumerate(records)
                if r["phase"] == "checkpoint"
                and r["step"] == epochs_done
                and r.get("warmup_steps_done") == warmup_steps_done
            ),
            None,
        )
        if mark is not None:
            kept = records[: mark + 1]
        else:
            kept = [
                r
                for r in records
                if r["phase"] in ("warmup", "rl", "eval", "alarm", "checkpoint")
                and r["step"] <= (warmup_steps_done - 1 if r["phase"] == "warmup" else epochs_done)
            ]
        self._jsonl.close()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
        self._jsonl = open(path, "a")
        self.history = kept
        for tracker in self.trackers:
            tracker.rewind(warmup_steps_done, epochs_done)

    def log(self, step: int, phase: str, metrics: dict[str, float], alert: str = "") -> None:
        """Record ``metrics`` of ``phase`` at ``step``; ``alert``: a warning the trackers also send on (W&B's
        alerts reach Slack or email), with the record's ``alert`` field."""
        record = {"phase": phase, "step": step, "time": time.time(), **metrics, **({"alert": alert} if alert else {})}
        self.history.append(record)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        numbers = finite_numbers(metrics)
        for tracker in self.trackers if numbers else ():
            tracker.scalars(phase, numbers, step)
        for tracker in self.trackers if alert else ():
            tracker.alert(phase, alert)

    def image_grid(
        self,
        name: str,
        images: torch.Tensor,
        rows: int,
        step: int,
        prompts: Sequence[str] = (),
        inputs: ImageInputs | None = None,
    ) -> None:
        """``images`` [N, C, H, W] as ``name``.png in ``rows`` rows (videos [N, F, C, H, W]: a lossless animated PNG,
        and ``name``.gif for the trackers), each row's image ``inputs`` first (``with_inputs``); the trackers log
        every evaluation's grid as ``eval/samples`` (one series over the run)
        captioned with each row's prompt."""
        if not self.enabled:
            return
        pixels = grid_pixels(to_uint8(with_inputs(images, rows, inputs)), rows)
        picture = save_image(pixels, self.run_dir / f"{name}.png", self.fps)  # a video's: a lossless APNG
        if is_video(images):  # the trackers show an animated GIF
            picture = save_image(pixels, self.run_dir / f"{name}.gif", self.fps)
        caption = "\n".join(f"row {i}: {prompt[:200]}" for i, prompt in enumerate(prompts, 1))
        for tracker in self.trackers:
            tracker.image("eval/samples", picture, step, caption)

    def copy_grid(self, name: str, copy: str) -> None:
        """The grid ``name``.png saved again as ``copy``.png (the same evaluation under a second name; the
        trackers have it once)."""
        if self.enabled:
            shutil.copyfile(self.run_dir / f"{name}.png", self.run_dir / f"{copy}.png")

    def rollout_samples(
        self,
        step: int,
        images: torch.Tensor,
        prompts: list[str],
        rewards: list[float],
        scores: dict[str, list[float]],
        inputs: ImageInputs | None = None,
    ) -> None:
        """RL epoch ``step``'s ``images`` [N, C, H, W] with their prompts, rewards and each scorer's scores (NaN: it
        failed): a grid ``rollouts/epochNNNN.jpg`` (the images, then a row per image input they were conditioned
        on: ``input_rows``; videos [N, F, C, H, W]: an animated ``epochNNNN.gif``), a row per image in
        ``rollouts/epochNNNN.jsonl``, and each image captioned
        "prompt | reward (scores)" for the trackers (beside its inputs)."""
        if not self.enabled or not len(images):
            return
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        pixels = to_uint8(images)
        shown = [pixels, *map(to_uint8, input_rows(inputs, images))]
        grid = save_image(grid_pixels(np.concatenate(shown), len(shown)), folder / f"epoch{step:04d}.jpg", self.fps)
        rows = [
            {"prompt": prompt, "reward": reward, **{name: values[i] for name, values in scores.items()}}
            for i, (prompt, reward) in enumerate(zip(prompts, rewards, strict=True))
        ]
        (folder / f"epoch{step:04d}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        if not self.trackers:
            return
        captions = []
        for i, (prompt, reward) in enumerate(zip(prompts, rewards, strict=True)):
            each = ", ".join(f"{name} {values[i]:.3f}" for name, values in scores.items())
            captions.append(f"{prompt[:200]} | reward {reward:.3f}" + (f" ({each})" if len(scores) > 1 else ""))
        each_image = [np.concatenate(views, axis=-2) for views in zip(*shown[1:], pixels, strict=True)]  # inputs, image
        for tracker in self.trackers:
            tracker.samples("samples", grid, each_image, captions, step)

    def reward_curve(self, best_epoch: int = -1, select_by: str = "") -> None:
        """Plot the RL reward per epoch and every evaluation metric (fixed prompts and noise: the held-out reward,
        the task's metric, the alarm scorers) to reward_curve.png, marking the best evaluation (by ``select_by``)."""
        if not self.enabled:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rl = [r for r in self.history if r["phase"] == "rl"]
        evals = [r for r in self.history if r["phase"] == "eval"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in rl], [r["reward_mean"] for r in rl], label="reward (rollouts)")
        for key in sorted({k for r in evals for k in r} - {"phase", "step", "time"}):
            points = [(r["step"], r[key]) for r in evals if key in r]
            ax.plot(*zip(*points, strict=True), "o--", label=f"eval {key}")
        best = [r for r in evals if r["step"] == best_epoch and select_by in r]
        if best:
            ax.axvline(best_epoch, color="grey", linestyle=":", linewidth=1)
            ax.plot(
                [best_epoch],
                [best[-1][select_by]],
                "k*",
                markersize=12,
                label=f"best: epoch {best_epoch} ({select_by} {best[-1][select_by]:.3f})",
            )
        ax.set_xlabel("RL epoch")
        ax.set_ylabel("mean reward / eval metric")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(self.run_dir / "reward_curve.png", dpi=100)
        plt.close(fig)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            if self._tensorboard is not None:
                self._tensorboard.close()
