"""The main job end to end through real reward-server processes: one process, and torchrun with DDP."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from servers import free_port

from trainer.export import export_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], tmp_path: Path, timeout: int, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_outputs(
    run: subprocess.CompletedProcess, run_dir: Path, epochs: int, phases: tuple[str, ...] = ("warmup", "rl")
) -> list[dict]:
    """What a single-process job leaves: every epoch scored with no failed request, the sample grids, the
    reward curve, the config, TensorBoard events of each phase it ran, the final weights and the progress lines."""
    records = _records(run_dir)
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) == epochs and all(r["failed_share"] == 0.0 for r in rl)
    for name in ("samples_before.png", "samples_after.png", "reward_curve.png", "config.yaml"):
        assert (run_dir / name).is_file(), name
    assert all(list((run_dir / "tensorboard" / axis).glob("events.out.tfevents.*")) for axis in phases)
    assert (run_dir / "final" / "diffusion_pytorch_model.safetensors").is_file()
    assert f"epoch {epochs:3d}  reward" in run.stdout and "digit_accuracy" in run.stdout
    return records


def test_the_job_writes_its_outputs(tmp_path):
    """The README's job at toy size (its two reward replicas started by the job itself, the tiny model built by the
    job as on a first run): every output is there, and no third-party notice (transformers' torchvision fallback,
    DeepSpeed's accelerator, loading bars) nor progress bar in the output (not a terminal). Its paths are relative
    to the folder it starts in, and generate, export and a resume find them from another. That it learns is
    test_shortened_job_raises_the_reward's (slow) and test_adapter_learning's. The model is the default one, built
    in .cache/rewardflow/ of the folder the job starts in."""
    run = _run(
        [
            sys.executable,
            str(REPO / "trainer" / "main.py"),
            "logging.output_dir=.",
            "logging.run_name=toy",
            "train.warmup_steps=4",
            "train.epochs=2",
            "data.prompts_per_epoch=2",
            "algorithm.group_size=4",
            "eval.every=0",
            "eval.samples_per_prompt=1",
            "eval.num_steps=2",
            "eval.alarm_scorers=[brightness]",
        ],
        tmp_path,
        timeout=600,
        cwd=tmp_path,
    )
    records = _check_outputs(run, tmp_path / "toy", epochs=2)
    # the alarm scorer is served by the job's own replicas and scored on the evaluation's images; best/ is there
    assert all(0 < r["alarm/brightness"] < 1 for r in records if r["phase"] == "eval")
    assert (tmp_path / "toy" / "best" / "trainable.safetensors").is_file() and "best: " in run.stdout
    for notice in (
        "requires torchvision",
        "Setting accelerator",
        "Loading weights",
        "Writing model shards",
        "%|",
    ):  # the last: our progress bars (logging.progress) show on a terminal, not in a log
        assert notice not in run.stdout + run.stderr, notice

    # python -m trainer.generate: final/ with the evaluation's prompts and noise draws samples_after.png again
    from PIL import Image

    from trainer.generate import main as generate

    assert generate(["--weights", str(tmp_path / "toy" / "final"), "--out", str(tmp_path / "grid.png")]) == 0
    assert (tmp_path / "grid.png").read_bytes() == (tmp_path / "toy" / "samples_after.png").read_bytes()
    assert (
        generate(
            [
                "--weights",
                str(tmp_path / "toy" / "final"),
                "--prompts",
                "a handwritten digit 3",
                "a handwritten digit 8",
                "--samples",
                "3",
                "--out",
                str(tmp_path / "two.png"),
            ]
        )
        == 0
    )
    assert Image.open(tmp_path / "two.png").size == ((3 * 17 + 1) * 4, (2 * 17 + 1) * 4)  # 2 rows of 3 16-px images
    assert generate(["--weights", str(tmp_path / "toy"), "--out", str(tmp_path / "no.png")]) == 2
    # best/ (a checkpoint's layout) draws the grid of the evaluation that chose it
    best_grid = "samples_before.png" if "best: before RL" in run.stdout else "samples_after.png"
    assert generate(["--weights", str(tmp_path / "toy" / "best"), "--out", str(tmp_path / "best.png")]) == 0
    assert (tmp_path / "best.png").read_bytes() == (tmp_path / "toy" / best_grid).read_bytes(), best_grid
    # python -m trainer.export, as its own process: the diffusers model, and no third-party notice either
    export = _run(
        [
            sys.executable,
            "-m",
            "trainer.export",
            "--checkpoint",
            str(tmp_path / "toy" / "best"),
            "--ema",
            "--out",
            str(tmp_path / "exported"),
        ],
        tmp_path,
        timeout=300,
    )
    assert (tmp_path / "exported" / "diffusion_pytorch_model.safetensors").is_file()
    for notice in ("requires torchvision", "Loading weights", "%|"):
        assert notice not in export.stdout + export.stderr, notice
    # --resume from another folder continues on the run's own model (no new tiny one built there), unchanged; the
    # default model, removed meanwhile, is built again where the run's config.yaml (absolute) says it was
    model = tmp_path / ".cache" / "rewardflow" / "tiny-sd3-digits"
    assert (model / "transformer" / "config.json").is_file()
    shutil.rmtree(model)
    (tmp_path / "elsewhere").mkdir()
    resumed = _run(
        [
            sys.executable,
            str(REPO / "trainer" / "main.py"),
            "--resume",
            "auto",
            f"logging.output_dir={tmp_path}",
            "logging.run_name=toy",
            "train.epochs=3",
        ],
        tmp_path,
        timeout=300,
        cwd=tmp_path / "elsewhere",
    )
    assert "resumed from" in resumed.stdout and "epoch   3" in resumed.stdout and "warning" not in resumed.stdout
    assert not any((tmp_path / "elsewhere").iterdir()) and (model / "transformer" / "config.json").is_file()


def test_without_a_terminal_the_job_prints_a_progress_line_at_a_steady_interval(tmp_path, tiny_model_dir):
    """Output to a file (nohup, SLURM): the only line in 23 minutes of a warm-up was the run directory. Here with
    stdout and stderr piped and an interval of 0.1 s: progress lines of the warm-up (steps done of all, the loss,
    the rate, the time left) and of RL (what the epoch under way is at), and no bar."""
    run = _run(
        [
            sys.executable,
            "trainer/main.py",
            f"model.path={tiny_model_dir}",
            f"logging.output_dir={tmp_path}",
            "logging.run_name=piped",
            "logging.tensorboard=false",
            "logging.progress_every_s=0.1",
            "train.warmup_steps=6",
            "train.epochs=2",
            "data.prompts_per_epoch=2",
            "algorithm.group_size=4",
            "eval.every=0",
            "eval.samples_per_prompt=1",
            "eval.num_steps=2",
            "reward.replicas=1",
        ],
        tmp_path,
        timeout=600,
    )
    lines = run.stdout.splitlines()
    warmup = [line for line in lines if line.startswith("[progress] warm-up (SFT): ")]
    assert warmup and re.fullmatch(
        r"\[progress\] warm-up \(SFT\): [1-5]/6 steps \(\d+%\), [0-9.]+ (steps/s|s/step), "
        r"ETA \d+(m\d\ds|s), sft_loss [0-9.e-]+",
        warmup[0],
    ), warmup
    rl = [line for line in lines if line.startswith("[progress] RL: ")]
    # a line may also come after the last epoch, while the final evaluation runs
    assert rl and all(
        re.search(r"[01]/2 epochs .*; epoch [12] for \d+s: ", line)
        or re.search(r"2/2 epochs \(100%\).*; then: evaluating", line)
        for line in rl
    ), rl
    assert re.search(r"[01]/2 epochs .*; epoch [12] for \d+s: ", rl[0]), rl
    assert lines.index(warmup[0]) < lines.index(rl[0]) and "%|" not in run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the shared warm-up (~2 min alone on 2 cores) and 8 epochs, far more when shared
def test_shortened_job_raises_the_reward(tmp_path, tiny_model_dir, warmed_tiny_checkpoint):
    """GRPO from the warmed-up model (the default warm-up, shared with other slow runs) against two digit-reward
    replicas the job starts itself: the evaluation reward (fixed prompts and noise) after RL beats the warmed-up
    model's. Warm-up and RL in one job are test_the_job_writes_its_outputs'."""
    run = _run(
        [
            sys.executable,
            "trainer/main.py",
            f"model.path={tiny_model_dir}",
            f"logging.output_dir={tmp_path}",
            "logging.run_name=short",
            "logging.progress=false",
            f"train.init_from={warmed_tiny_checkpoint}",
            "train.epochs=8",
            "eval.every=0",
            "eval.samples_per_prompt=5",
        ],
        tmp_path,
        timeout=1400,
    )
    assert "no warm-up" in run.stdout
    records = _check_outputs(run, tmp_path / "short", epochs=8, phases=("rl",))
    evals = [r for r in records if r["phase"] == "eval"]
    before, after = evals[0], evals[-1]
    assert after["reward_mean"] > before["reward_mean"] + 0.05, (before, after)


def test_torchrun_ddp_two_processes(tmp_path, tiny_model_dir):
    """The same entry point under torchrun: gloo DDP, rank 0 starts the reward pool, groups span ranks,
    and both ranks end with identical weights. The evaluation of 7 prompts (4 per rank, the last padded) in
    forwards of 3 prompts gathers them in the order one process samples them."""
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "trainer/main.py",
            f"model.path={tiny_model_dir}",
            f"logging.output_dir={tmp_path}",
            "logging.run_name=ddp",
            "logging.progress=false",
            "train.warmup_steps=4",
            "train.epochs=2",
            "data.prompts_per_epoch=3",
            "algorithm.group_size=4",
            "eval.samples_per_prompt=1",
            "eval.num_steps=2",
            "eval.prompts=7",
            "eval.batch_size=3",
        ],
        tmp_path,
        timeout=600,
    )
    records = _records(tmp_path / "ddp")
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) == 2 and all(0 <= r["reward_mean"] <= 1 for r in rl)
    (final,) = [r for r in records if r["phase"] == "final"]
    assert final["weights_rank_spread"] == 0.0
    # final/ holds the weights the final evaluation sampled with: the EMA (it held the raw weights before)
    checkpoint = max((tmp_path / "ddp" / "checkpoints").glob("step-*"))
    export_checkpoint(checkpoint, tmp_path / "ema", ema=True)
    exported = load_file(tmp_path / "ema" / "diffusion_pytorch_model.safetensors")
    written = load_file(tmp_path / "ddp" / "final" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == written.keys()
    for name, tensor in written.items():
        torch.testing.assert_close(tensor, exported[name], rtol=0, atol=1e-6)
    # One process sampling final/ one prompt at a time draws the ranks' grid again, row for row (up to a rounded
    # pixel value: batched kernels round off differently); a prompt out of place would be another digit.
    import numpy as np
    from PIL import Image

    from trainer.generate import main as generate

    assert generate(["--weights", str(tmp_path / "ddp" / "final"), "--out", str(tmp_path / "one.png")]) == 0
    one, ranks = (
        np.asarray(Image.open(p), dtype=np.int16)
        for p in (tmp_path / "one.png", tmp_path / "ddp" / "samples_after.png")
    )
    assert one.shape == ranks.shape == ((7 * 17 + 1) * 4, (17 + 1) * 4)  # 7 rows of one 16-px grey image
    assert np.abs(one - ranks).max() <= 1


@pytest.mark.slow  # two processes of a whole job, started as two machines (~40 s on 2 cores)
def test_two_machines_through_the_multinode_launch_script(tmp_path, tiny_model_dir):
    """deploy/launch_multinode.sh run as two machines of one process each (c10d rendezvous on loopback), with no
    reward.urls: each machine's first process starts its own reward replicas on its loopback (another machine's
    127.0.0.1 is not reachable), groups span the machines, and both end with identical weights."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "NNODES": "2",
        "NPROC_PER_NODE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RDZV_ID": f"test-{os.getpid()}",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    args = [
        f"model.path={tiny_model_dir}",
        f"logging.output_dir={tmp_path}",
        "logging.run_name=two",
        "logging.progress=false",
        "train.warmup_steps=2",
        "train.epochs=2",
        "data.prompts_per_epoch=2",
        "algorithm.group_size=2",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "reward.replicas=1",
    ]
    machines = [
        subprocess.Popen(
            ["bash", "deploy/launch_multinode.sh", *args],
            cwd=REPO,
            env={**env, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    try:
        outputs = [machine.communicate(timeout=600)[0] for machine in machines]
    finally:
        for machine in machines:
            machine.kill()
    for machine, output in zip(machines, outputs, strict=True):
        assert machine.returncode == 0, output[-4000:]
    run_dir = tmp_path / "two"
    for node in range(2):
        assert (run_dir / "reward_replicas" / f"node-{node}" / "replica-0.log").is_file(), node
    records = _records(run_dir)
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) == 2 and all(r["failed_share"] == 0.0 for r in rl)
    (final,) = [r for r in records if r["phase"] == "final"]
    assert final["weights_rank_spread"] == 0.0


def test_refuses_a_world_size_that_splits_groups(tmp_path, tiny_model_dir):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "trainer/main.py",
            f"model.path={tiny_model_dir}",
            f"logging.output_dir={tmp_path}",
            "train.warmup_steps=0",
            "data.prompts_per_epoch=3",
            "algorithm.group_size=3",
            "reward.urls=[http://127.0.0.1:9]",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode != 0  # each rank exits 2; torchrun reports the failure
    assert "error: data.prompts_per_epoch x algorithm.group_size = 3 x 3 = 9" in out.stderr
    # torchrun's failure summary names that cause for each rank (their error files), not a link to its docs
    summary = out.stderr[out.stderr.index("Root Cause") :]
    assert "traceback : error: data.prompts_per_epoch x algorithm.group_size = 3 x 3 = 9" in summary, summary
    assert "To enable traceback see" not in out.stderr, out.stderr[-3000:]
