"""One registry shape (shared/registry.py) for algorithms, models, scorers, datasets, backends, estimators and
losses; the algorithm vocabulary in one module (trainer/algorithms/core_algos.py); ``weighted_mean``; ``Rewards``'
own rows."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from reward_server.scorers import SCORERS
from shared.registry import Entry, Registry, UnknownName
from trainer.algorithms import ALGORITHMS, build_algorithm, core_algos
from trainer.algorithms.base import Rewards
from trainer.algorithms.core_algos import ADVANTAGE_ESTIMATORS, LOSSES, weighted_mean
from trainer.data import DATASETS
from trainer.distributed import BACKENDS, init_backend
from trainer.models import MODELS, ModelSpec


def test_an_entry_imports_its_target_on_use_and_calls_it_with_its_arguments_first():
    entry = Entry("fractions:Fraction", denominator=4)
    assert entry.load().__name__ == "Fraction" and entry(3) == 0.75
    assert Entry(dict, a=1)(b=2) == {"a": 1, "b": 2}
    assert Entry(dict, accepts=("b",), a=1)(b=2, model_dir="x") == {"a": 1, "b": 2}  # what it takes, no more
    assert Entry(dict, accepts=())(model_dir="x") == {}


def test_a_registry_keeps_its_order_and_registers_by_decorator():
    registry = Registry({"b": Entry(int)})

    @registry.register("a")
    def double(x):
        return 2 * x

    assert list(registry) == ["b", "a"] and registry["a"](4) == 8 and double(1) == 2
    with pytest.raises(AssertionError, match="registered twice"):
        registry.register("a")(double)


@pytest.mark.parametrize(
    "registry",
    [ALGORITHMS, MODELS, SCORERS, DATASETS, BACKENDS, ADVANTAGE_ESTIMATORS, LOSSES],
    ids=lambda r: str(list(r)[0]),
)
def test_every_registry_has_the_one_shape(registry):
    assert isinstance(registry, Registry) and all(isinstance(entry, Entry) for entry in registry.values())


def test_a_name_not_registered_is_one_line_naming_the_setting_and_the_choices():
    with pytest.raises(
        ValueError, match=r"^model.name='nosuch' is not registered; choose one of: chroma, .*, z_image$"
    ):
        MODELS["nosuch"]
    with pytest.raises(KeyError):  # a mapping's lookup error too
        DATASETS["nosuch"]
    assert str(UnknownName("data.name='x' is not registered")) == "data.name='x' is not registered"  # no quotes
    assert "nosuch" not in MODELS and MODELS.get("nosuch") is None


def test_a_model_entry_is_an_entry_of_its_adapter_with_its_variant_as_data():
    fill = MODELS["flux_fill"]
    assert isinstance(fill, ModelSpec) and fill.load().__name__ == "FluxAdapter" and fill.target == fill.adapter
    assert fill.pipeline_class.__name__ == "FluxFillPipeline" and fill.config_class.__name__ == "FluxConfig"
    assert MODELS["tiny"].config_class.__name__ == "TinyConfig"  # the variant's own config class


def test_names_and_messages_are_the_ones_users_know():
    assert list(ALGORITHMS) == ["grpo", "ppo", "ppo_critic", "dpo", "sft_best", "nft", "grpo_guard", "mixgrpo"] + [
        "awm",
        "dgpo",
        "refl",
        "draft",
        "drtune",
    ]
    assert list(BACKENDS) == ["single", "ddp", "fsdp2", "zero2", "zero3"]
    assert ALGORITHMS["grpo"].config_class.__name__ == "GRPOConfig"
    config = ALGORITHMS["ppo"].config_class()
    assert type(build_algorithm(config)).__name__ == "PPO"
    parallel = SimpleNamespace(backend="nosuch", sequence_parallel=1)
    with pytest.raises(ValueError, match=r"^parallel.backend='nosuch' is not one of auto, single, ddp, fsdp2, zero2, "):
        init_backend(parallel, torch.device("cpu"), 1.0)
    parallel = SimpleNamespace(
        backend="zero3",
        param_dtype="float32",
        reduce_dtype="float32",
        cpu_offload=False,
        deepspeed_config=None,
        sequence_parallel=1,
    )
    with pytest.raises(ValueError, match=r"^parallel.backend=zero3 needs the torch.distributed environment"):
        init_backend(parallel, torch.device("cpu"), 1.0)


def test_every_estimator_and_loss_lives_in_core_algos_with_its_formula():
    for name, entry in [*ADVANTAGE_ESTIMATORS.items(), *LOSSES.items()]:
        function = entry.load()
        assert inspect.getmodule(function) is core_algos, name
        assert "=" in (function.__doc__ or ""), f"{name}: its docstring states no formula"
    assert {"group", "batch", "gae", "optimality"} <= set(ADVANTAGE_ESTIMATORS)
    assert {"ppo_clip", "denoising", "diffusion_dpo", "nft", "dgpo", "awm"} <= set(LOSSES)


def test_weighted_mean_is_the_expression_it_replaces_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(7, generator=g, requires_grad=True)
    for weights, floor in ((torch.tensor([1.0, 0, 1, 1, 0, 1, 1]), 1.0), (torch.rand(7, generator=g) * 0.1, 1e-12)):
        ours = weighted_mean(values, weights, floor)
        (grad,) = torch.autograd.grad(ours, values)
        theirs = (values * weights).sum() / weights.sum().clamp_min(floor)
        (their_grad,) = torch.autograd.grad(theirs, values)
        assert torch.equal(ours, theirs) and torch.equal(grad, their_grad)
    assert weighted_mean(values, torch.zeros(7)).item() == 0.0  # no weight: 0, never a division by 0
    small = torch.full((7,), 0.01)  # fractional weights: the 1e-12 floor is their mean, 1 would shrink it
    assert weighted_mean(torch.ones(7), small, 1e-12).item() == pytest.approx(1.0)
    assert weighted_mean(torch.ones(7), small).item() == pytest.approx(0.07)
    rows = torch.randn(3, 4, generator=g)
    mask = (torch.rand(3, 4, generator=g) > 0.5).float()
    assert torch.equal(
        weighted_mean(rows, mask, dim=1, keepdim=True),
        (rows * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp_min(1),
    )


def test_rewards_hand_each_rank_its_own_rows():
    gathered = torch.arange(12.0)
    rewards = Rewards(gathered[4:8], gathered, torch.arange(12) // 4, offset=4)  # rank 1 of 3
    assert torch.equal(rewards.local_rows(gathered * 10), gathered[4:8] * 10)
    assert rewards.is_local(torch.tensor([0, 3, 4, 7, 8, 11])).tolist() == [False, False, True, True, False, False]
