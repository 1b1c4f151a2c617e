"""Scorers with a differentiable form, shared by the reward server and the trainer: one implementation, called
two ways. The server scores uint8 images with it; the differentiable-reward algorithms (refl, draft, drtune) call
its torch form on decoded images inside the trainer, where gradients can reach the model (they cannot cross HTTP).
Neither the trainer nor the server is imported here.
"""

from __future__ import annotations

from shared.registry import Entry, Registry

DIFFERENTIABLE = Registry(
    {
        "digit": Entry("scoring.modules:DigitProbability", accepts=()),
        "brightness": Entry("scoring.modules:Brightness", accepts=()),
        "aesthetic": Entry("scoring.aesthetic:DifferentiableAesthetic"),
    }
)
"""Scorer name (as the reward server names it) -> its differentiable torch module, built as ``Entry(model_dir=...)``
(the folder laid out as the server's ``--model-dir``; ``accepts=()``: a scorer without weights)."""


def needs_weights(name: str) -> bool:
    """Whether scorer ``name``'s differentiable form reads weights from a model folder."""
    return DIFFERENTIABLE[name].accepts != ()


def build_differentiable(name: str, model_dir: str | None = None):
    """The differentiable form of scorer ``name`` (weights from ``model_dir``), or a ValueError naming the scorers
    that have one."""
    if name not in DIFFERENTIABLE:
        raise ValueError(
            f"scorer {name!r} has no differentiable form: set algorithm.scorer to one of {', '.join(DIFFERENTIABLE)} "
            "(or train this reward with a policy-gradient algorithm, e.g. algorithm.name=grpo)"
        )
    return DIFFERENTIABLE[name](model_dir=model_dir)
