"""Loading a scorer's transformers weights strictly (the reward server's scorers and ``scoring``'s share it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_strict(model_class: Any, path: Path, what: str, *, unexpected_ok: bool = True, **kwargs: Any) -> Any:
    """``model_class.from_pretrained(path, **kwargs)`` in float32 (as the reference scorers run; a half-precision
    checkpoint is upcast, exactly); ValueError when weights are missing or mis-shaped
    (transformers would initialise them at random), or, unless ``unexpected_ok``, left unused."""
    model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    unloaded = list(info["missing_keys"]) + ([] if unexpected_ok else list(info["unexpected_keys"]))
    unloaded += [str(entry) for entry in info["mismatched_keys"]]
    if unloaded:
        raise ValueError(f"{path} lacks or mis-shapes {what} weights: {unloaded[:5]}")
    return model.float()
