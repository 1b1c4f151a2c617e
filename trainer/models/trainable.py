"""The weights a run trains in a denoiser, in one place: LoRA adapters on a frozen base, every weight (full
fine-tuning), or an added module that trains by itself (a trainable IP-Adapter), with or without LoRA. It
sets them up (float32 masters where the model computes in bf16/fp16), saves and loads them, and describes the
reference policy they imply (``ReferenceSpec``). Adapters hold one as ``adapter.trainable``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from trainer.config.fields import PositiveInt
from trainer.models.reference import Reference, ReferenceSpec

LORA_WEIGHTS = "adapter_model.safetensors"
LORA_CONFIG = "adapter_config.json"
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class LoraSettings:
    """LoRA on the attention projections (peft); the disabled adapter is the reference policy."""

    rank: PositiveInt = 32
    """Adapter rank: capacity of the update; 32-64 is common for SD3/FLUX RL."""
    alpha: PositiveInt = 64
    """Scale numerator: the update is scaled by alpha / rank."""
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module names that get adapters; attention projections as in Flow-GRPO."""


class AddedWeights(Protocol):
    """Weights an adapter adds inside the denoiser (an IP-Adapter), in a file format of their own."""

    trainable: bool
    """Whether they train (then, without LoRA, nothing else of the denoiser does)."""
    parameter_names: list[str]
    """Their parameters' names in the denoiser."""

    def parameters(self) -> list[nn.Parameter]: ...

    def trainable_layers(self) -> list[nn.Module]:
        """The modules holding every one of the weights, each called on activations."""
        ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...


class ComputeInWeightDtype:
    """Forward hooks on ``layer``: its floating inputs cast to its weights' dtype at call time (float32 here;
    bf16 where a parallel engine casts the weights for compute), its output back to the first input's dtype."""

    def __init__(self, layer: nn.Module):
        self.activation_dtype: torch.dtype | None = None
        layer.register_forward_pre_hook(self.cast_inputs)
        layer.register_forward_hook(self.cast_output)

    def cast_inputs(self, layer: nn.Module, args: tuple) -> tuple:
        self.activation_dtype = args[0].dtype
        dtype = next(layer.parameters()).dtype
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    def cast_output(self, layer: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(self.activation_dtype)


class LinearInInputDtype(nn.Linear):
    """An ``nn.Linear`` whose matmul runs in its input's dtype: float32 master weights are cast to bf16/fp16
    per call (autograd returns their gradients in float32), so a trained layer costs a low-precision GEMM
    instead of casts plus a float32 GEMM. Set on existing layers by ``compute_in_input_dtype``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.weight.to(x.dtype), bias)


def compute_in_input_dtype(layer: nn.Linear) -> None:
    """Make ``layer`` a ``LinearInInputDtype`` in place: same parameters, names and state dict."""
    assert type(layer) in (nn.Linear, LinearInInputDtype), type(layer)
    layer.__class__ = LinearInInputDtype


class Trainable:
    """Makes ``denoiser`` trainable as configured, on construction: LoRA adapters (``lora``) on a frozen base,
    or every weight, or no base weight when ``added`` weights train by themselves; ``added`` train exactly
    when they say so."""

    def __init__(
        self,
        denoiser: nn.Module,
        lora: LoraSettings | None,
        gradient_checkpointing: bool = False,
        added: AddedWeights | None = None,
    ):
        self.denoiser, self.lora, self.added = denoiser, lora, added
        self.trains_added = added is not None and added.trainable
        self.full = lora is None and not self.trains_added
        """Whether every weight of the denoiser trains (the reference is then a frozen copy)."""
        self._reference: Reference | None = None
        denoiser.requires_grad_(self.full)
        if lora is not None:
            from peft import LoraConfig

            denoiser.add_adapter(
                LoraConfig(
                    r=lora.rank,
                    lora_alpha=lora.alpha,
                    init_lora_weights="gaussian",
                    target_modules=lora.target_modules,
                )
            )
        if added is not None:
            for p in added.parameters():
                p.requires_grad_(added.trainable)
        if not self.full:
            self._train_in_float32()
        if gradient_checkpointing:
            denoiser.enable_gradient_checkpointing()

    def _train_in_float32(self) -> None:
        """Store the trainable LoRA / added weights in float32 when the denoiser is bf16 or fp16, the base
        staying in that dtype (what peft's ``autocast_adapter_dtype`` does): an optimizer updates a weight in
        its own dtype, where bf16 rounds small Adam steps away and fp16 underflows Adam's eps. LoRA layers run
        their matmuls in the model's dtype all the same (``LinearInInputDtype``: no float32 GEMM, no cast of
        activations); the added layers' other modules (the IP-Adapter's per-image projection) compute in
        float32 (``ComputeInWeightDtype``)."""
        low = [p for p in self.denoiser.parameters() if p.requires_grad and p.dtype in LOW_PRECISION]
        if not low:
            return
        for p in low:
            p.data = p.data.float()
        if self.lora is not None:
            from peft.tuners.lora import LoraLayer

            for layer in self.denoiser.modules():
                linears = [*layer.lora_A.values(), *layer.lora_B.values()] if isinstance(layer, LoraLayer) else []
                if linears and all(type(m) in (nn.Linear, LinearInInputDtype) for m in linears):
                    layer.cast_input_dtype_enabled = False  # peft would cast x to float32 before lora_A
                    for linear in linears:
                        compute_in_input_dtype(linear)
        if self.trains_added:
            for layer in self.added.trainable_layers():
                if type(layer) is nn.Linear:
                    compute_in_input_dtype(layer)
                else:
                    ComputeInWeightDtype(layer)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters the optimizer updates."""
        return (p for p in self.denoiser.parameters() if p.requires_grad)

    @property
    def reference_spec(self) -> ReferenceSpec:
        """Full fine-tuning: a frozen copy. Otherwise the same network with LoRA disabled and / or the trained
        added weights swapped for their values when it is built (no copy of the base)."""
        if self.full:
            return ReferenceSpec(copy=True)
        return ReferenceSpec(
            disable_lora=self.lora is not None, swapped=tuple(self.added.parameter_names) if self.trains_added else ()
        )

    def reference(self) -> Reference:
        """The reference built in this process (no parallel backend) at the first call, the same one after."""
        if self._reference is None:
            self._reference = self.reference_spec.build(self.denoiser)
        return self._reference

    def save(self, directory: str) -> None:
        """LoRA: ``adapter_model.safetensors`` + ``adapter_config.json`` (peft format); trained added weights
        in their own format; full fine-tuning: the whole denoiser with ``save_pretrained``."""
        os.makedirs(directory, exist_ok=True)
        if self.trains_added:
            self.added.save(directory)
        if self.full:
            self.denoiser.save_pretrained(directory)
        if self.lora is None:
            return
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(self.denoiser).items()}
        save_file(state, os.path.join(directory, LORA_WEIGHTS))
        peft_config = self.denoiser.peft_config["default"].to_dict()
        peft_config["target_modules"] = sorted(peft_config["target_modules"])
        with open(os.path.join(directory, LORA_CONFIG), "w") as f:
            json.dump(peft_config, f, indent=2, default=str)

    def load(self, directory: str) -> None:
        """Load what ``save`` wrote into the denoiser in place; a mismatch raises a ValueError."""
        if self.trains_added:
            self.added.load(directory)
        if self.full:
            self._load_full(directory)
        if self.lora is None:
            return
        from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
        from safetensors.torch import load_file

        path = os.path.join(directory, LORA_WEIGHTS)
        if not os.path.isfile(path):
            raise ValueError(f"{directory!r} holds no LoRA weights ({LORA_WEIGHTS}); was it saved with LoRA on?")
        state = load_file(path)
        expected = get_peft_model_state_dict(self.denoiser)
        if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in state):
            raise ValueError(
                f"LoRA weights in {directory!r} do not match this model's adapter (different "
                "target_modules or rank than model.lora)"
            )
        set_peft_model_state_dict(self.denoiser, state)

    def _load_full(self, directory: str) -> None:
        """The whole denoiser from ``save_pretrained`` output; frozen added weights keep their loaded values."""
        loaded = type(self.denoiser).from_pretrained(directory, torch_dtype=self.denoiser.dtype)
        missing, unexpected = self.denoiser.load_state_dict(loaded.state_dict(), strict=False)
        if unexpected or set(missing) != set(self.added.parameter_names if self.added else ()):
            raise ValueError(f"the denoiser saved in {directory!r} is another architecture than model.path's")
