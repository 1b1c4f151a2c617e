"""The ``motion`` reward's rule (the embedded video task): the ink centroid's path through a clip and how far its
mean step points the named way. The server's ``motion`` scorer scores with it; the moving digits task's
``direction_accuracy`` is its ``margin > 0``. One implementation, numpy only (the CPU reward image has no torch)."""

from __future__ import annotations

import numpy as np

DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
"""Direction -> unit vector (x, y), y growing downwards as image rows do."""


def centroid_paths(ink: np.ndarray) -> np.ndarray:
    """[B, F, 2] ink centroid (x, y) per frame of clips of ink ``ink`` [B, F, H, W] (>= 0); an empty frame's is the
    frame's centre."""
    b, f, h, w = ink.shape
    flat = ink.reshape(b, f, h * w).astype(np.float64)
    mass = flat.sum(-1)
    ys, xs = np.divmod(np.arange(h * w), w)
    inked = mass > 1e-6
    safe = np.where(inked, mass, 1.0)
    cx = np.where(inked, (flat * xs).sum(-1) / safe, (w - 1) / 2)
    cy = np.where(inked, (flat * ys).sum(-1) / safe, (h - 1) / 2)
    return np.stack([cx, cy], axis=-1)


def direction_margins(mean_steps: np.ndarray, directions: list[str]) -> np.ndarray:
    """[B] pixels a frame: each clip's mean step [B, 2] along its named direction less its size across it (> 0: it
    moves that way more than any other way)."""
    unit = np.array([DIRECTIONS[d] for d in directions], dtype=np.float64)
    along = (mean_steps * unit).sum(1)
    across = np.abs(mean_steps[:, 0] * unit[:, 1] - mean_steps[:, 1] * unit[:, 0])
    return along - across


SPEED = 1.0
"""Pixels a frame of the named motion (the task's clips move one pixel a frame): the score's midpoint is half of it."""
SCALE = 0.25
"""Pixels a frame that move the score from sigmoid(0) to sigmoid(1)."""


def motion_scores(steps: np.ndarray, directions: list[str]) -> np.ndarray:
    """[B] in (0, 1): sigmoid((margin - spread / 4 - SPEED / 2) / SCALE) of per-frame centroid steps [B, F-1, 2],
    ``spread`` their mean distance from their mean. The named motion at SPEED, steady, scores 0.88, a still clip
    0.12, sideways or the wrong way less: the optimum is the named motion, not holding still."""
    mean = steps.mean(axis=1)
    spread = np.linalg.norm(steps - mean[:, None], axis=-1).mean(axis=1)
    effective = direction_margins(mean, directions) - spread / 4 - SPEED / 2
    return 1.0 / (1.0 + np.exp(-effective / SCALE))
