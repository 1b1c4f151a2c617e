"""Scorers with a differentiable form, shared by the reward server and the trainer: one implementation, called
two ways. The server scores uint8 images with it; the differentiable-reward algorithms (refl, draft, drtune) call
its torch form on decoded images inside the trainer, where gradients can reach the model (they cannot cross HTTP).
Neither the trainer nor the server is imported here.
"""

from __future__ import annotations

from shared.registry import Entry, Registry

DIFFERENTIABLE = Registry(
    {
        "digit": Entry("scoring.digit:DigitProbability"),
    }
)
"""Scorer name (as the reward server names it) -> its differentiable torch module, built as ``Entry()``."""


def build_differentiable(name: str):
    """The differentiable form of scorer ``name``, or a ValueError naming the scorers that have one."""
    if name not in DIFFERENTIABLE:
        raise ValueError(
            f"scorer {name!r} has no differentiable form: set algorithm.scorer to one of {', '.join(DIFFERENTIABLE)} "
            "(or train this reward with a policy-gradient algorithm, e.g. algorithm.name=grpo)"
        )
    return DIFFERENTIABLE[name]()
