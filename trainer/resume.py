"""What a resume may change of the run it continues (where things are, how often to checkpoint or evaluate, how long
to train), and the warning it prints when it changes more: the run then no longer continues the one interrupted."""

from __future__ import annotations

import json
import os
from pathlib import Path

RESUME_MAY_CHANGE = (
    "logging.",
    "train.resume",
    "train.epochs",
    "train.init_from",
    "train.warmup_after_init",
    "train.device",
    "train.num_threads",
    "train.checkpoint_every",
    "train.warmup_checkpoint_every",
    "train.keep_checkpoints",
    "reward.urls",
    "reward.token",
    "reward.timeout_s",
    "reward.max_concurrency",
    "reward.replicas",
    "model.path",
    "model.text_embeddings",
    "model.image_latents",
    "data.path",
    "eval.every",
)
"""Config fields (or sections, ending in '.') a resume may change without changing what the run computes:
where things are, how often to checkpoint or evaluate, how long to train."""


def config_changes(saved: dict, current: dict) -> list[str]:
    """``"key: saved -> current"`` for every config field outside ``RESUME_MAY_CHANGE`` whose value differs
    between a checkpoint's config (``config.json``) and the resuming run's (both ``to_dict`` of a Config)."""
    flat = {}
    for which, tree in (0, saved), (1, current):
        stack = [("", tree)]
        while stack:
            prefix, node = stack.pop()
            for key, value in node.items():
                if isinstance(value, dict) and value and key != "weights":
                    stack.append((f"{prefix}{key}.", value))
                else:
                    flat.setdefault(f"{prefix}{key}", [None, None])[which] = json.loads(json.dumps(value, default=str))
    return [
        f"{key}: {old!r} -> {new!r}"
        for key, (old, new) in sorted(flat.items())
        if old != new and not key.startswith(RESUME_MAY_CHANGE) and not _made_absolute(old, new)
    ]


def _made_absolute(old: object, new: object) -> bool:
    """Whether ``new`` is relative path ``old`` made absolute here, as a run saves its paths now (an older
    run's config kept them as written)."""
    return (
        isinstance(old, str)
        and isinstance(new, str)
        and bool(old)
        and not os.path.isabs(old)
        and os.path.abspath(old) == new
    )


def changed_settings(path: Path, config: dict) -> str | None:
    """The warning for a resume from checkpoint ``path`` with ``config`` (``saved_dict`` of the run's Config) that
    changes what the run computes, or None."""
    changes = config_changes(json.loads((path / "config.json").read_text()), config)
    if not changes:
        return None
    return (
        f"warning: resuming with settings other than {path}'s, so the run no longer continues the "
        f"one that was interrupted: {'; '.join(changes)}"
    )
