"""Where a run's scalars and image grids go besides metrics.jsonl: TensorBoard and Weights & Biases (rank 0).
Both plot on two step axes, warm-up steps and RL epochs (evaluations, checkpoints and alarms are on the RL one)."""

from __future__ import annotations

import io
import math
import os
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

AXES = ("warmup", "rl")
STEP_KEYS = {"warmup": "warmup/step", "rl": "rl/epoch"}
"""W&B: the key of each axis's step, logged with every row of it."""


def axis_of(phase: str) -> str:
    return "warmup" if phase == "warmup" else "rl"


def finite_numbers(metrics: dict) -> dict[str, float]:
    """The values a chart can show: finite ints and floats (NaN marks a missing value in metrics.jsonl)."""
    return {k: v for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}


@dataclass(frozen=True)
class Picture:
    """An image file the run wrote (PNG or JPEG; an animated GIF for a video) and its size: trackers log the file's
    bytes as they are, instead of encoding the pixels again (seconds for a PNG of a grid of 1024-px images)."""

    path: Path
    height: int
    width: int
    channels: int  # 1: greyscale, 3: RGB
    frames: int = 1  # > 1: an animation (trackers show a video)
    fps: float = 0.0


def pil_image(pixels: np.ndarray):
    """[H, W, C] uint8 as a PIL image: greyscale ("L") for one channel, else RGB."""
    from PIL import Image

    return Image.fromarray(pixels[..., 0], "L") if pixels.shape[-1] == 1 else Image.fromarray(pixels, "RGB")


def gif_bytes(frames: np.ndarray, fps: float) -> bytes:
    """uint8 ``[F, H, W, C]`` as an animated GIF that loops (256 colours a frame: a preview, not the pixels)."""
    images = [pil_image(frame) for frame in frames]
    buffer = io.BytesIO()
    duration = max(10 * round(100 / fps), 20)  # GIF counts in 10 ms; browsers play delays under 20 ms at 100 ms
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=duration, loop=0)
    return buffer.getvalue()


class Tracker(Protocol):
    def scalars(self, phase: str, metrics: dict[str, float], step: int) -> None: ...

    def image(self, name: str, picture: Picture, step: int, caption: str = "") -> None:
        """A grid named ``section/name``, on the RL axis, with what its rows show (``caption``: a line per row)."""

    def samples(self, name: str, grid: Picture, images: list[np.ndarray], captions: list[str], step: int) -> None:
        """Rollout images of RL epoch ``step``: their one-row grid, and each image ([H, W, C] uint8, or a video
        [F, H, W, C] at the grid's fps) with its caption."""

    def alert(self, phase: str, text: str) -> None:
        """A warning of ``phase`` for whoever watches the run."""

    def rewind(self, warmup_steps_done: int, epochs_done: int) -> None:
        """After a resume: what comes next redoes the steps after these."""


class TensorBoardTracker:
    """One event log per step axis under ``tensorboard/``, so that a resume hides each axis's redone steps."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.writers: dict[str, object] = {}
        self._open({})

    def _open(self, purge: dict[str, int]) -> None:
        """(Re)open the writers; ``purge``: axis -> first step whose earlier events are hidden."""
        from torch.utils.tensorboard import SummaryWriter

        for writer in self.writers.values():
            writer.close()
        self.writers = {
            axis: SummaryWriter(str(self.run_dir / "tensorboard" / axis), purge_step=purge.get(axis)) for axis in AXES
        }

    def scalars(self, phase: str, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writers[axis_of(phase)].add_scalar(f"{phase}/{key}", value, step)

    def image(self, name: str, picture: Picture, step: int, caption: str = "") -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        image = Summary.Image(
            height=picture.height,
            width=picture.width,
            colorspace=picture.channels,
            encoded_image_string=picture.path.read_bytes(),
        )
        self.writers["rl"].file_writer.add_summary(Summary(value=[Summary.Value(tag=name, image=image)]), step)
        if caption:
            self.writers["rl"].add_text(name, caption, step)

    def samples(self, name: str, grid: Picture, images: list[np.ndarray], captions: list[str], step: int) -> None:
        self.image(f"rollouts/{name}", grid, step)
        self.writers["rl"].add_text(f"rollouts/{name}", "\n".join(f"{i}. {c}" for i, c in enumerate(captions, 1)), step)

    def alert(self, phase: str, text: str) -> None:
        pass  # TensorBoard has no alerts: the record and the printed warning say it

    def rewind(self, warmup_steps_done: int, epochs_done: int) -> None:
        # a warm-up checkpoint (no epoch done) holds no RL-axis event: the evaluation before RL is redone
        self._open({"warmup": warmup_steps_done, "rl": epochs_done + 1 if epochs_done else 0})

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


class WandbTracker:
    """A W&B run kept in ``<run>/wandb/``; its id, in ``<run>/wandb-run-id``, lets a resumed job continue it.
    W&B cannot drop history, so a resume logs the redone steps again at the same x: resume is exact, so with the
    same values. ``mode`` offline: upload later with ``wandb sync <run>/wandb/offline-run-*``. W&B failing mid-run
    (its service killed, its disk full) costs the run its W&B rows, never the run: one warning, then W&B is off."""

    ID_FILE = "wandb-run-id"

    def __init__(self, run_dir: Path, mode: str, project: str, entity: str, config: dict):
        import wandb

        id_file = run_dir / self.ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        project = project or os.environ.get("WANDB_PROJECT") or "rewardflow"
        self._wandb = wandb
        self.failed = False
        self._defined: set[str] = set()
        try:
            self.run = wandb.init(
                project=project,
                entity=entity or None,
                name=run_dir.name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                mode=mode,
                config=config,
                settings=wandb.Settings(init_timeout=60),
            )
            for axis in AXES:
                self.run.define_metric(STEP_KEYS[axis])
                self._define(axis)
        except Exception as exc:  # wandb raises its own types, and network errors as they come
            cause = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(
                f"logging.wandb={mode}: W&B did not start ({cause}): run `wandb login` or set "
                "WANDB_API_KEY, or use logging.wandb=offline and upload later with `wandb sync`"
            ) from None
        id_file.write_text(run_id)

    def _define(self, prefix: str) -> None:
        """Plot ``prefix/*`` against its axis's step (phases and images are defined on first use)."""
        if prefix not in self._defined:
            self._defined.add(prefix)
            self.run.define_metric(f"{prefix}/*", step_metric=STEP_KEYS[axis_of(prefix)])

    def _safely(self, send: Callable[[], object]) -> None:
        if self.failed:
            return
        try:
            send()
        except Exception as exc:  # whatever W&B raises: the training run goes on
            self.failed = True
            cause = " ".join(str(exc).split()) or type(exc).__name__
            print(
                f"warning: W&B logging failed ({cause}) and is off for the rest of the run; metrics.jsonl holds "
                "every record",
                file=sys.stderr,
                flush=True,
            )

    def _log(self, prefix: str, row: dict) -> None:
        self._define(prefix)
        self.run.log(row)

    def scalars(self, phase: str, metrics: dict[str, float], step: int) -> None:
        row = {**{f"{phase}/{key}": value for key, value in metrics.items()}, STEP_KEYS[axis_of(phase)]: step}
        self._safely(lambda: self._log(phase, row))

    def image(self, name: str, picture: Picture, step: int, caption: str = "") -> None:
        def send():
            if picture.frames > 1:  # an animated GIF: a video in W&B (from the file: no encoder needed)
                image = self._wandb.Video(str(picture.path), caption=caption or name, format="gif")
            else:
                image = self._wandb.Image(str(picture.path), caption=caption or name)
            self._log(name.split("/")[0], {name: image, STEP_KEYS["rl"]: step})

        self._safely(send)

    def samples(self, name: str, grid: Picture, images: list[np.ndarray], captions: list[str], step: int) -> None:
        def send():
            pictures = [self._sample(image, caption, grid.fps) for image, caption in zip(images, captions, strict=True)]
            self._log("rollouts", {f"rollouts/{name}": pictures, STEP_KEYS["rl"]: step})

        self._safely(send)

    def _sample(self, image: np.ndarray, caption: str, fps: float):
        """One rollout for W&B: an image ([H, W, C]) as a JPEG, a video ([F, H, W, C]) as an animated GIF."""
        if image.ndim == 4:
            return self._wandb.Video(io.BytesIO(gif_bytes(image, fps or 16)), caption=caption, format="gif")
        return self._wandb.Image(pil_image(image), caption=caption, file_type="jpg")

    def alert(self, phase: str, text: str) -> None:
        self._safely(
            lambda: self.run.alert(
                title=f"rewardflow {phase}: {self.run.name}", text=text, level=self._wandb.AlertLevel.WARN
            )
        )

    def rewind(self, warmup_steps_done: int, epochs_done: int) -> None:
        pass  # see the class docstring

    def __enter__(self) -> WandbTracker:
        return self

    def __exit__(self, failure, *_) -> None:
        """The W&B run ends as the job does: failed (exit code 1) when an exception ends it."""
        self._safely(lambda: self.run.finish(exit_code=1 if failure is not None else 0))
