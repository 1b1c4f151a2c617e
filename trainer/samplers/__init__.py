"""Pure sampler step math. ``flow_step(kind, schedule)`` binds a flow-matching step to a schedule."""

from trainer.samplers.flow_sde import STEP_FUNCTIONS, scheduled_flow_step, sde_step_with_logprob
from trainer.samplers.noise import generator_device, standard_normal


def flow_step(kind: str, schedule):
    """The flow step registered as ``kind`` ("sde", "cps" or "eta") on ``schedule`` (sigmas t[0..T]), called
    with step indices; sigma_max = t[1] stands in for sigma = 1 (no division by zero)."""
    if kind not in STEP_FUNCTIONS:
        raise ValueError(f"sampler.kind={kind!r} is not one of {sorted(STEP_FUNCTIONS)}")
    return scheduled_flow_step(kind, schedule, sigma_max=schedule[1])


DEFAULT_KIND = {"flow": "sde", "ddim": "ddim"}
"""The step used for ``sampler.kind=auto``, by the adapter's ``sampler_kind``."""


def resolve_kind(kind: str, sampler_kind: str) -> str:
    """``kind``, or the model family's default step when it is "auto"."""
    return DEFAULT_KIND[sampler_kind] if kind == "auto" else kind


__all__ = [
    "DEFAULT_KIND",
    "flow_step",
    "resolve_kind",
    "sde_step_with_logprob",
    "STEP_FUNCTIONS",
    "generator_device",
    "standard_normal",
]
