"""Out of memory in each part of a real (tiny) run: one line naming the part and the settings that lower its peak,
and, once training has started, the command that continues the run; no traceback. The failing allocation is torch's
CPU allocator's own error (16 TiB asked for), raised inside the part: a GPU's cannot be had here."""

from __future__ import annotations

import pytest
import torch

from trainer.main import main

TINY = [
    "train.warmup_steps=2",
    "warmup.batch_size=4",
    "train.epochs=2",
    "train.checkpoint_every=1",
    "data.prompts_per_epoch=2",
    "algorithm.group_size=2",
    "eval.samples_per_prompt=1",
    "eval.num_steps=2",
    "logging.progress=false",
    "logging.tensorboard=false",
    "reward.weights={brightness: 1}",
]


@pytest.fixture(scope="module")
def brightness_url(tmp_path_factory):
    from trainer.rewards.launcher import LocalRewardPool

    with LocalRewardPool(["brightness"], replicas=1, log_dir=tmp_path_factory.mktemp("server")) as pool:
        yield pool.urls[0]


def _allocate_too_much(*args, **kwargs):
    torch.empty(2**44, dtype=torch.uint8)


def _after(calls: int, real):
    """``real``, whose call number ``calls`` (from 1) runs out of memory instead."""
    made = []

    def wrapped(*args, **kwargs):
        made.append(1)
        if len(made) == calls:
            _allocate_too_much()
        return real(*args, **kwargs)

    return wrapped


def _run(tmp_path, capsys, tiny_model_dir, url, *overrides) -> tuple[int, str, str]:
    code = main(
        [
            f"model.path={tiny_model_dir}",
            f"logging.output_dir={tmp_path / 'out'}",
            f"reward.urls=[{url}]",
            *TINY,
            *overrides,
        ]
    )
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err[-3000:]
    return code, out, err


def test_out_of_memory_in_an_rl_rollout_names_the_setting_and_the_command_that_continues(
    tmp_path, capsys, monkeypatch, tiny_model_dir, brightness_url
):
    import trainer.trainer

    monkeypatch.setattr(trainer.trainer, "rollout", _after(2, trainer.trainer.rollout))  # RL epoch 2's
    code, out, _ = _run(tmp_path, capsys, tiny_model_dir, brightness_url)
    (run_dir,) = (tmp_path / "out").iterdir()
    assert code == 1
    assert (
        "\nout of CPU memory in a rollout (16384.0 GiB asked for): raise train.rollout_chunks (now 0, auto: at least "
        "8 images a chunk) to sample fewer images at once; parallel.backend=fsdp2 or zero3 shards the weights, "
        "gradients and optimizer state over the GPUs: stopped in RL epoch 2 of 2; continuing starts from the newest "
        f"checkpoint, {run_dir}/checkpoints/step-000002-000001 (warm-up steps 2, RL epochs 1)\n"
    ) in out
    assert "continue with: python trainer/main.py --resume auto " in out and f"logging.run_name={run_dir.name}" in out


@pytest.mark.parametrize(
    ("part", "said"),
    [
        (
            "warm-up",
            "a warm-up step (16384.0 GiB asked for): lower warmup.micro_batch_size (now 64), or "
            "model.gradient_checkpointing=true",
        ),
        (
            "update",
            "an RL update (16384.0 GiB asked for): lower algorithm.micro_batch_size (now 32), or "
            "model.gradient_checkpointing=true",
        ),
        (
            "evaluation",
            "an evaluation (16384.0 GiB asked for): lower eval.batch_size (now 1 prompts a forward, "
            "eval.samples_per_prompt=1 images each)",
        ),
    ],
)
def test_out_of_memory_in_training_names_its_part(
    tmp_path, capsys, monkeypatch, tiny_model_dir, brightness_url, part, said
):
    from trainer.distributed import SingleProcess
    from trainer.evaluation import Evaluation

    extra = []
    if part == "evaluation":
        monkeypatch.setattr(Evaluation, "__call__", _allocate_too_much)
    else:  # the first backward: the warm-up's, or with no warm-up an RL update's
        monkeypatch.setattr(SingleProcess, "backward", _after(1, SingleProcess.backward))
        extra = ["train.warmup_steps=0"] if part == "update" else []
    code, out, _ = _run(tmp_path, capsys, tiny_model_dir, brightness_url, *extra)
    assert code == 1 and f"\nout of CPU memory in {said}" in out, out[-3000:]
    assert "continue with: python trainer/main.py --resume auto " in out


def test_out_of_memory_while_the_model_loads_is_one_error_line_and_leaves_no_run(
    tmp_path, capsys, monkeypatch, tiny_model_dir, brightness_url
):
    import trainer.models.attention

    monkeypatch.setattr(trainer.models.attention, "use_attention", _allocate_too_much)  # inside build_adapter
    code, _, err = _run(tmp_path, capsys, tiny_model_dir, brightness_url)
    assert code == 2 and not (tmp_path / "out").exists()
    assert err.splitlines()[0] == (
        "error: out of CPU memory in loading the model (16384.0 GiB asked for): load the weights in bfloat16 "
        "(model.dtype, now float32), or precompute the text embeddings (model.text_embeddings: the text encoders are "
        "not loaded); parallel.backend=fsdp2 or zero3 shards the weights, gradients and optimizer state over the GPUs"
    )


def test_a_gpus_message_gives_what_was_asked_for_and_what_was_free():
    from trainer.config import load_config
    from trainer.memory import memory_advice, out_of_memory

    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.10 GiB of which 1.50 GiB is free. Including non-PyTorch memory, this process "
        "has 77.58 GiB memory in use."
    )
    assert out_of_memory(error) and not out_of_memory(RuntimeError("CUDA error: an illegal memory access"))
    fragmented = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity "
        "of 79.10 GiB of which 300.00 MiB is free. Of the allocated memory 60.00 GiB is "
        "allocated by PyTorch, and 17.50 GiB is reserved by PyTorch but unallocated."
    )
    assert memory_advice(fragmented, load_config()).endswith(
        "; 17.50 GiB was reserved but unallocated (fragmented): PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may "
        "be enough"
    )
    assert "fragmented" not in memory_advice(
        torch.OutOfMemoryError(str(fragmented).replace("17.50 GiB", "20.00 MiB")), load_config()
    )
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert memory_advice(cublas, load_config()).startswith("out of GPU memory in the run: lower the batch sizes")
    assert memory_advice(error, load_config(overrides=["parallel.backend=fsdp2"])) == (
        "out of GPU memory in the run (2.00 GiB asked for, 1.50 GiB of 79.10 GiB free): lower the batch sizes "
        "(algorithm.micro_batch_size, eval.batch_size)"
    )
