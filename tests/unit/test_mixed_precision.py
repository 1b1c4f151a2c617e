"""Training in bf16 / fp16: where the optimizer's precision comes from, and fp16's loss scaling.

LoRA and IP-Adapter weights are float32 over a low-precision base (the adapters' side: the conformance suite);
a backend refuses low-precision weights it would update in place, and scales fp16 losses.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.distributed.backend import SingleProcess
from trainer.distributed.fsdp import upcast_hint


class HalfBase(nn.Module):
    """A trainable float32 layer (LoRA-like) feeding a frozen layer in ``dtype`` (the base)."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        super().__init__()
        torch.manual_seed(0)
        self.trainable = nn.Linear(4, 4)
        self.base = nn.Linear(4, 4).to(dtype).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(self.trainable(x).to(self.base.weight.dtype)).float()


def _prepared(module: nn.Module) -> SingleProcess:
    backend = SingleProcess(torch.device("cpu"))
    backend.prepare(module, [p for p in module.parameters() if p.requires_grad], lambda ps: torch.optim.SGD(ps, lr=1.0))
    return backend


def test_fp16_loss_scaling_keeps_gradients_that_fp16_would_flush_to_zero():
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    tiny = 1e-9  # the loss's gradient w.r.t. the fp16 output: below fp16's smallest subnormal (6e-8)

    unscaled = HalfBase()
    (tiny * unscaled(x).sum()).backward()
    assert float(unscaled.trainable.weight.grad.abs().max()) == 0.0  # the premise: plain fp16 backward loses it

    reference = HalfBase(torch.float32)  # the same weights, all float32
    (tiny * reference(x).sum()).backward()
    expected = reference.trainable.weight.detach() - reference.trainable.weight.grad

    module = HalfBase()
    backend = _prepared(module)
    assert backend.scaler.is_enabled()
    backend.backward(tiny * module(x).sum())
    before = module.trainable.weight.detach().clone()
    backend.step(max_grad_norm=0.0)
    assert not torch.equal(module.trainable.weight, before)
    torch.testing.assert_close(
        module.trainable.weight.detach(),
        expected,
        rtol=0,
        atol=float(reference.trainable.weight.grad.abs().max()) * 2e-2,
    )  # fp16 activations: ~1e-3 relative error


def test_an_overflowing_step_is_skipped_and_the_scale_round_trips():
    module = HalfBase()
    backend = _prepared(module)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    before = module.trainable.weight.detach().clone()
    backend.backward(module(x).sum() * 1e6)  # times the scale 65536: inf in the fp16 backward
    norm = backend.step(max_grad_norm=1.0)
    assert not torch.isfinite(torch.tensor(norm))
    assert torch.equal(module.trainable.weight, before)
    state = backend.optimizer_state()
    assert state["scaler"]["scale"] == 32768.0  # halved after the overflow

    fresh_module = HalfBase()
    fresh = _prepared(fresh_module)
    fresh.load_optimizer_state(state)
    assert fresh.scaler.get_scale() == 32768.0


def test_float32_models_are_not_scaled():
    module = nn.Linear(3, 3)
    backend = _prepared(module)
    assert not backend.scaler.is_enabled() and backend.optimizer_state()["scaler"] == {}
    loss = module(torch.ones(1, 3)).sum()
    backend.backward(loss)
    assert torch.equal(module.weight.grad, torch.ones(3, 1).expand(3, 3))  # the gradient of the loss itself


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_updated_in_place_are_refused(dtype):
    module = nn.Linear(3, 3).to(dtype)
    with pytest.raises(ValueError, match="model.dtype=float32.*zero2/zero3.*LoRA"):
        _prepared(module)


def test_fsdp2_says_when_it_would_compute_a_low_precision_model_in_float32():
    """FSDP2 casts gathered weights to param_dtype: a bf16 base with float32 LoRA under the default
    param_dtype=float32 would run in float32, so the backend names the setting; a float32 model, or a bf16
    one gathered as bf16, gets no hint."""
    base = nn.Linear(4, 4).to(torch.bfloat16)
    lora = nn.Linear(4, 1)
    model = nn.Sequential(base, lora)
    assert upcast_hint(model, torch.float32) == (
        "fsdp2 gathers the model's bfloat16 weights as parallel.param_dtype=float32: forwards and backwards run "
        "in float32. Set parallel.param_dtype=bfloat16 to compute in bfloat16"
    )
    assert upcast_hint(model, torch.bfloat16) is None
    assert upcast_hint(nn.Linear(4, 4), torch.float32) is None
