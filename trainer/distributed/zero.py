"""DeepSpeed ZeRO-2 and ZeRO-3 (``deepspeed.initialize`` with our torch optimizer as the client optimizer).

ZeRO-2 partitions gradients and optimizer state over ranks and keeps full parameters on each; ZeRO-3 also
partitions the parameters (gathered per module during forward and backward; once per rollout while sampling,
with ``parallel.gather_for_sampling``). The engine owns the optimizer step and gradient clipping. The
DeepSpeed config is a JSON template (``deepspeed_configs/zero{2,3}.json`` beside this module, package data
that ``deploy/deepspeed/`` links to; or ``parallel.deepspeed_config``) whose ``"auto"`` values are filled from
our config.

Checkpoints: the trainable weights are gathered to full tensors (rank 0 writes them); the optimizer state is
each rank's ZeRO partition (one file per rank, so resume needs the same world size), as DeepSpeed's own
checkpoints are.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from trainer.distributed.backend import DDP, World
from trainer.distributed.swap import ShardSwap
from trainer.distributed.weights import checked_trainable, main_only_copy, materialize, skeleton, trainable

TEMPLATES = Path(__file__).resolve().parent / "deepspeed_configs"

_DS_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def deepspeed_config(
    stage: int,
    path: str,
    *,
    max_grad_norm: float,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
) -> dict:
    """The DeepSpeed config for ``stage``: the JSON at ``path`` (default: our template) with every
    ``"auto"`` value filled from our config; explicit values are the user's and are kept."""
    file = Path(path) if path else TEMPLATES / f"zero{stage}.json"
    if not file.is_file():
        raise ValueError(f"DeepSpeed config {str(file)!r} not found; set parallel.deepspeed_config to a JSON file")
    config = json.loads(file.read_text())
    if config.get("zero_optimization", {}).get("stage") != stage:
        raise ValueError(
            f"{file} sets zero_optimization.stage={config.get('zero_optimization', {}).get('stage')}, "
            f"but parallel.backend=zero{stage}"
        )
    filled = {
        # The loop forms the micro-batches and calls step() once per optimizer step (the accumulation
        # boundary is set explicitly), so DeepSpeed's batch counters only feed its throughput log.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_grad_norm,
        "bf16.enabled": param_dtype == torch.bfloat16,
        "fp16.enabled": param_dtype == torch.float16,
        "communication_data_type": _DS_DTYPE[reduce_dtype],
        "zero_optimization.offload_optimizer.device": "cpu" if cpu_offload else "none",
        "zero_optimization.offload_param.device": "cpu" if cpu_offload and stage == 3 else "none",
    }
    for dotted, value in filled.items():
        *parents, key = dotted.split(".")
        node = config
        for name in parents:
            node = node.setdefault(name, {})
        if node.get(key, "auto") == "auto":
            node[key] = value
    zero = config["zero_optimization"]
    if stage == 3 and (
        zero.get("stage3_param_persistence_threshold") != 0 or zero.get("stage3_prefetch_bucket_size") != 0
    ):
        raise ValueError(
            f"{file}: set zero_optimization.stage3_param_persistence_threshold and "
            "stage3_prefetch_bucket_size to 0. Persistent and prefetched parameters stay gathered "
            "across forwards, so weights written into the partitions (EMA swapped in for evaluation, "
            "loaded checkpoints) would not reach the next forward"
        )
    if config["gradient_clipping"] != max_grad_norm:
        raise ValueError(
            f"{file} sets gradient_clipping={config['gradient_clipping']} but train.max_grad_norm="
            f'{max_grad_norm}; set it to "auto" (the engine clips, with our value)'
        )
    return config


class DeepSpeedZeRO(DDP):
    """A DeepSpeed engine around the policy; collectives (gather, mean, broadcast) as DDP's."""

    sharded_optimizer_state = True

    def __init__(
        self,
        device: torch.device,
        world: World,
        dist_backend: str,
        stage: int,
        config: dict,
        gather_for_sampling: bool = True,
    ):
        if device.type == "cpu":
            # Must precede importing deepspeed: it picks its accelerator once, at import.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        super().__init__(device, world, dist_backend)
        import deepspeed
        import deepspeed.ops

        if device.type == "cpu":
            # DeepSpeed's CPU all-reduce kernel is a C++ op JIT-built on first use (~40 s, a compiler
            # needed); gloo's all-reduce is used instead. Nothing else here builds an op: the optimizer is
            # a torch one.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.stage = stage
        self.name = f"zero{stage}"
        self.config = config
        self.gather_for_sampling = gather_for_sampling
        self.engine = None

    def prepare(self, module, params, make_optimizer, shard_units=()):
        import deepspeed

        want = {torch.bfloat16: self.config["bf16"]["enabled"], torch.float16: self.config["fp16"]["enabled"]}
        dtype = next(module.parameters()).dtype
        if any(want.values()) and not want.get(dtype, False):
            raise ValueError(
                f"the DeepSpeed config trains in {'bf16' if want[torch.bfloat16] else 'fp16'}, the model "
                f"is loaded in {dtype}: set model.dtype to match parallel.param_dtype (DeepSpeed runs "
                "the module in that dtype and does not cast its inputs)"
            )
        self.skeletons[id(module)] = skeleton(module)
        self.params = list(params)
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=make_optimizer(self.params), config=self.config, dist_init_required=False
        )
        return self.engine

    def prepare_auxiliary(self, module, make_optimizer):
        # An algorithm's own network (a critic) stays outside the engine, replicated and wrapped in torch's
        # DDP (inherited): the engine's backward is an autograd backward of the whole loss, so the network's
        # gradients land in its .grad and DDP all-reduces them; its optimizer steps after the engine's.
        if self.config["fp16"]["enabled"]:
            raise ValueError(
                "parallel.backend=zero2/zero3 with fp16 does not train an algorithm's own network (a "
                "critic): DeepSpeed's loss scale would reach its gradients unscaled; use bf16 "
                "(parallel.param_dtype=bfloat16) or parallel.backend=ddp/fsdp2"
            )
        return super().prepare_auxiliary(module, make_optimizer)

    def sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        # ZeRO reduces (and partitions) gradients in every backward; the boundary tells it which backward
        # completes the accumulation. The auxiliary networks' DDP wrappers skip their all-reduce until then.
        self.engine.set_gradient_accumulation_boundary(enabled)
        return super().sync(enabled)

    def sampling(self) -> contextlib.AbstractContextManager:
        """ZeRO-3 with ``gather_for_sampling``: every parameter is gathered once when the context opens and
        the engine's per-module gather/release hooks are off until it closes (DeepSpeed's
        ``unwrap_model_for_generation``), so a rollout's forwards run no collective; closing repartitions
        without writing back, so the next forward reads the partitions (the optimizer's, or an EMA swap's)."""
        if self.stage != 3 or not self.gather_for_sampling or self.engine is None:
            return contextlib.nullcontext()
        from deepspeed.runtime.zero import unwrap_model_for_generation

        return unwrap_model_for_generation(self.engine)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, max_grad_norm: float) -> float:
        assert max_grad_norm == self.config["gradient_clipping"], "the engine clips with the configured norm"
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self._step_auxiliary(max_grad_norm)
        return float(norm) if norm is not None else 0.0

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def reset_optimizer(self) -> None:
        self.engine.optimizer.optimizer.state.clear()
        for _, opt in self.auxiliary:
            opt.state.clear()

    def optimizer_state(self) -> dict:
        return {"main": self.engine.optimizer.state_dict(), "auxiliary": self._auxiliary_state()}

    def load_optimizer_state(self, state: dict) -> None:
        # ZeRO takes one state per data-parallel rank and picks its own; the fp32 master partition comes
        # from the saved state (exact also when the module trains in bf16).
        self.engine.optimizer.load_state_dict(
            [state["main"]] * self.world.world_size, load_optimizer_states=True, load_from_fp32_weights=True
        )
        self._load_auxiliary_state(state)

    def local_shards(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        if self.stage != 3:
            return [p.detach() for p in params]
        # The partition the forward gathers from (no parameter persists whole: see deepspeed_config).
        return [p.ds_tensor if hasattr(p, "ds_tensor") else p.detach() for p in params]

    @contextlib.contextmanager
    def gathered(self, params: Iterable[nn.Parameter]) -> Iterator[list[torch.Tensor]]:
        params = list(params)
        with self._gather(params), torch.no_grad():
            yield [p.detach() for p in params]

    def _gather(
        self, params: list[nn.Parameter], modifier_rank: int | None = None
    ) -> contextlib.AbstractContextManager:
        if self.stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)

    @torch.no_grad()
    def trainable_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        state = {}
        for name, p in trainable(module):
            with self._gather([p]):
                if self.world.rank == 0:
                    state[name] = p.detach().cpu().clone()
        return state

    @torch.no_grad()
    def load_trainable_state(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        named = checked_trainable(module, state)
        with self._gather([p for _, p in named], modifier_rank=0):
            for name, p in named:
                p.copy_(state[name])
        self.engine.optimizer.refresh_fp32_params()  # else the next step would restore the old weights

    @torch.no_grad()
    def frozen_copy(self, module: nn.Module) -> nn.Module:
        module = getattr(module, "module", module)  # the engine
        params = dict(module.named_parameters())
        with self._gather(list(params.values())):
            full = {name: p.detach().clone() for name, p in params.items()}
        return materialize(self.skeletons[id(module)], full, dict(module.named_buffers()))

    def reference(self, module: nn.Module, spec) -> nn.Module:
        """ZeRO-2 keeps whole weights on every rank (a functional call swaps them); ZeRO-3's forward gathers
        them from this rank's partitions, so swapped values are written into those."""
        if self.stage != 3:
            return super().reference(module, spec)
        return spec.build(module, self.frozen_copy, lambda named: ShardSwap(named, self.local_shards))

    @torch.no_grad()
    def main_copy(self, module: nn.Module) -> nn.Module | None:
        module = getattr(module, "module", module)  # the engine

        def gathered() -> Iterator[tuple[str, torch.Tensor]]:
            for name, p in module.named_parameters():
                with self._gather([p]):
                    yield name, p.detach()

        return main_only_copy(self.world.rank, self.skeletons[id(module)], gathered(), module)
