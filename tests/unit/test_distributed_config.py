"""Backend selection and DeepSpeed config filling: user mistakes are ValueErrors that say what to do."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.config import ParallelConfig
from trainer.distributed import SingleProcess, gathers_for_sampling, init_backend
from trainer.distributed.zero import deepspeed_config

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_auto_and_single_give_one_process():
    assert isinstance(init_backend(ParallelConfig(), CPU, 1.0), SingleProcess)
    assert isinstance(init_backend(ParallelConfig(backend="single"), CPU, 1.0), SingleProcess)


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "zero2", "zero3"])
def test_distributed_backends_without_torchrun_say_what_to_run(backend):
    with pytest.raises(ValueError, match=f"torchrun --nproc_per_node=2 trainer/main.py parallel.backend={backend}"):
        init_backend(ParallelConfig(backend=backend), CPU, 1.0)


def test_mixed_precision_needs_a_sharding_backend():
    with pytest.raises(ValueError, match="need fsdp2, zero2 or zero3"):
        init_backend(ParallelConfig(backend="single", param_dtype="bfloat16"), CPU, 1.0)


@pytest.mark.parametrize("backend", ["auto", "single", "ddp", "fsdp2"])
def test_a_deepspeed_config_is_refused_where_no_deepspeed_reads_it(backend):
    """It used to be ignored without a word: the run went on under another backend than the one configured."""
    with pytest.raises(ValueError, match=r"read by zero2 and zero3 only, not by parallel.backend="):
        init_backend(ParallelConfig(backend=backend, deepspeed_config="ds.json"), CPU, 1.0)


def test_auto_values_are_filled_from_our_config_and_explicit_ones_kept(tmp_path):
    config = deepspeed_config(
        3, "", max_grad_norm=0.5, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cpu_offload=True
    )
    assert config["gradient_clipping"] == 0.5 and config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    assert config["communication_data_type"] == "fp32"
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    own = tmp_path / "ds.json"
    own.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
                "communication_data_type": "bf16",
            }
        )
    )
    config = deepspeed_config(
        2, str(own), max_grad_norm=1.0, param_dtype=torch.float32, reduce_dtype=torch.float32, cpu_offload=True
    )
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "none"  # the file's choice
    assert config["communication_data_type"] == "bf16" and config["gradient_clipping"] == 1.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"zero_optimization": {"stage": 2}}, "but parallel.backend=zero3"),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "stage3_param_persistence_threshold": 0,
                    "stage3_prefetch_bucket_size": 0,
                },
                "gradient_clipping": 2.0,
            },
            'set it to "auto"',
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "stage3_param_persistence_threshold": 1000,
                    "stage3_prefetch_bucket_size": 0,
                }
            },
            "stage3_param_persistence_threshold",
        ),
    ],
)
def test_bad_deepspeed_configs_are_refused(tmp_path, content, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        deepspeed_config(
            3, str(path), max_grad_norm=1.0, param_dtype=torch.float32, reduce_dtype=torch.float32, cpu_offload=False
        )
    with pytest.raises(ValueError, match="not found; set parallel.deepspeed_config"):
        deepspeed_config(
            3,
            str(tmp_path / "missing.json"),
            max_grad_norm=1.0,
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            cpu_offload=False,
        )


@pytest.mark.parametrize(
    ("gather", "offload", "expected"),
    [
        (None, False, True),
        (None, True, False),
        (True, True, True),
        (False, False, False),
    ],
)
def test_sampling_gathers_unless_offloading_or_told(gather, offload, expected):
    """Unset, gather_for_sampling follows cpu_offload: offloading exists not to hold the full weights on the
    device, which gathering them for a rollout would do."""
    assert gathers_for_sampling(ParallelConfig(gather_for_sampling=gather, cpu_offload=offload)) is expected


def test_compiling_under_zero3_is_refused_as_the_config_is_read():
    """ZeRO-3's per-layer gather hooks split compiled blocks into per-layer graphs (the tiny SD3 under 2 gloo
    processes: 94 graphs and fallbacks to eager); the other sharded backends compile (tests/integration)."""
    from trainer.config import ConfigError, load_config

    with pytest.raises(
        ConfigError,
        match=r"model.compile=blocks does not compose with parallel.backend=zero3: .*; "
        r"use parallel.backend=fsdp2 .* or zero2, or model.compile=none$",
    ):
        load_config(overrides=["parallel.backend=zero3", "model.compile=blocks"])
    assert load_config(overrides=["parallel.backend=zero2", "model.compile=blocks"]).model.compile == "blocks"


@pytest.mark.parametrize(
    ("backend", "size", "message"),
    [
        ("single", 2, "runs under parallel.backend=ddp or fsdp2, not single"),
        ("zero3", 2, "runs under parallel.backend=ddp or fsdp2, not zero3"),
        ("fsdp2", 3, "parallel.sequence_parallel=3 does not divide the 2 ranks"),
    ],
)
def test_sequence_parallelism_names_its_backends_and_a_divisor_of_the_ranks(monkeypatch, backend, size, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before any process group forms
    with pytest.raises(ValueError, match=message):
        init_backend(ParallelConfig(backend=backend, sequence_parallel=size), CPU, 1.0)


def test_a_sequence_parallel_group_is_one_replica():
    from trainer.distributed import World

    ranks = [World(rank, 8, rank, 8, sequence_parallel=4) for rank in range(8)]
    assert [w.replica for w in ranks] == [0, 0, 0, 0, 1, 1, 1, 1] and {w.replicas for w in ranks} == {2}
    assert World(5, 8, 5, 8).replica == 5 and World(5, 8, 5, 8).replicas == 8


def test_sequence_parallelism_refuses_an_ip_adapter_as_the_config_is_read():
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel=2 does not compose with model\.ip_adapter"):
        load_config(
            overrides=[
                "model.name=flux",
                "model.ip_adapter={image_encoder: /enc, num_tokens: 4}",
                "parallel.backend=fsdp2",
                "parallel.sequence_parallel=2",
            ]
        )
