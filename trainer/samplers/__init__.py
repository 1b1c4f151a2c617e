"""Pure sampler step math. ``flow_step(kind)`` picks a flow-matching step by name."""

from trainer.samplers.flow_sde import STEP_FUNCTIONS, sde_step_with_logprob


def flow_step(kind: str):
    """The flow step function registered as ``kind`` ("sde", "cps" or "eta")."""
    try:
        return STEP_FUNCTIONS[kind]
    except KeyError:
        raise ValueError(f"sampler.kind={kind!r} is not one of {sorted(STEP_FUNCTIONS)}") from None


DEFAULT_KIND = {"flow": "sde", "ddim": "ddim"}
"""The step used for ``sampler.kind=auto``, by the adapter's ``sampler_kind``."""


def resolve_kind(kind: str, sampler_kind: str) -> str:
    """``kind``, or the model family's default step when it is "auto"."""
    return DEFAULT_KIND[sampler_kind] if kind == "auto" else kind


__all__ = ["DEFAULT_KIND", "flow_step", "resolve_kind", "sde_step_with_logprob", "STEP_FUNCTIONS"]
