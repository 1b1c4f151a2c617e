"""Third-party notices that repeat: diffusers' prompt-truncation notice, once per long prompt and CLIP encoder,
is shown for the first prompt only (it was two lines per long prompt, for the whole run's prompt set)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

ENCODE = """
import sys
from trainer.quiet import quiet_third_party
quiet_third_party()
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
adapter = SD3Adapter(TinyConfig(path=sys.argv[1]))
adapter.prompts([" ".join(f"word{i}x{j}" for j in range(40)) for i in range(4)])
adapter.prompts(["a short one"])
print("encoded", len(adapter.prompts.cache))
"""


def test_the_truncation_notice_is_shown_for_the_first_cut_prompt_only(tiny_model_dir):
    run = subprocess.run(
        [sys.executable, "-c", ENCODE, tiny_model_dir], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and "encoded 5" in run.stdout, run.stderr[-2000:]
    assert run.stderr.count("The following part of your input was truncated") == 1, run.stderr[-3000:]
    assert "['word 0 x" in run.stderr  # the first prompt's cut part, as diffusers says it
    assert "(shown once: every prompt longer than a text encoder takes is cut the same way)" in run.stderr
