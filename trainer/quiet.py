"""A quiet start: third-party notices that say nothing about the run are dropped before those libraries load
(transformers' "requires torchvision" fallback notices, DeepSpeed's "Setting accelerator to CPU", the
progress bars of loading a few small weight files), and diffusers' prompt-truncation notice is shown once, not
once per long prompt and text encoder. Their other warnings and errors still show."""

from __future__ import annotations

import logging
import os

DROPPED = {
    "transformers.utils.import_utils": "requires torchvision (not installed)",
    "DeepSpeed": "Setting accelerator to CPU",
}
"""Logger name -> text of the records dropped from it."""

ONCE = "The following part of your input was truncated"
"""diffusers' notice (CLIP's 77 tokens, T5's max_sequence_length) for each prompt it cuts: shown for the first."""


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


class _Once(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text, self.seen = text, False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text not in record.getMessage():
            return True
        if self.seen:
            return False
        self.seen = True
        record.msg, record.args = (
            (f"{record.getMessage()}\n(shown once: every prompt longer than a text encoder takes is cut the same way)"),
            (),
        )
        return True


def quiet_third_party() -> None:
    """Install the filters (once) and turn off Hugging Face loading bars unless HF_HUB_DISABLE_PROGRESS_BARS
    is set; call it before transformers, diffusers or deepspeed are imported."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name, text in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(text))


def truncation_notice_once() -> None:
    """Show diffusers' prompt-truncation notice for the first prompt it cuts only (idempotent). A filter on the
    handler of diffusers' library logger, which every pipeline's logger passes its records to; call it once
    diffusers is imported."""
    from diffusers.utils.logging import get_logger

    get_logger("diffusers")  # diffusers makes its handler on first use
    for handler in logging.getLogger("diffusers").handlers:
        if not any(isinstance(f, _Once) for f in handler.filters):
            handler.addFilter(_Once(ONCE))
