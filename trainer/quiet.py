"""A quiet start: third-party notices that say nothing about the run are dropped before those libraries load
(transformers' "requires torchvision" fallback notices, DeepSpeed's "Setting accelerator to CPU", the
progress bars of loading a few small weight files). Their other warnings and errors still show."""

from __future__ import annotations

import logging
import os

DROPPED = {
    "transformers.utils.import_utils": "requires torchvision (not installed)",
    "DeepSpeed": "Setting accelerator to CPU",
}
"""Logger name -> text of the records dropped from it."""


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_third_party() -> None:
    """Install the filters (once) and turn off Hugging Face loading bars unless HF_HUB_DISABLE_PROGRESS_BARS
    is set; call it before transformers, diffusers or deepspeed are imported."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name, text in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(text))
