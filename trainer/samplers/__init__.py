"""Pure sampler step math. ``flow_step(kind)`` picks a flow-matching step by name."""

from trainer.samplers.flow_sde import STEP_FUNCTIONS, sde_step_with_logprob


def flow_step(kind: str):
    """The flow step function registered as ``kind`` ("sde", "cps" or "eta")."""
    try:
        return STEP_FUNCTIONS[kind]
    except KeyError:
        raise ValueError(f"sampler.kind={kind!r} is not one of {sorted(STEP_FUNCTIONS)}") from None


__all__ = ["flow_step", "sde_step_with_logprob", "STEP_FUNCTIONS"]
