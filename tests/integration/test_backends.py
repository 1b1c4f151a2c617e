"""The tiny GRPO job under torchrun (2 gloo processes) with every parallel backend: the same losses, equal
weights on every rank, and kill -9 then ``--resume auto`` reproducing the uninterrupted run.

The four 2-process backends see the same data (the loop's streams depend on rank and step, not on the
backend), so they must agree; they differ only in how float32 gradients are reduced, hence ``TOL``. The
single-process job sees other data (each rank draws its own warm-up batch and noise), so it is compared to
the backends in tests/integration/test_distributed_backends.py, on world-size-invariant batches instead. Runs that
need no fresh process go as series in one torchrun each (tests/job_series.py): one start-up, not one per run.
The slow tier (a job matrix: ~5 min on 2 cores); the default tier runs every backend under torchrun in
tests/integration/test_distributed_backends.py, the tiny job under DDP in test_main_job.py and a kill -9 resume in
test_checkpoint_resume.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from job_series import kill_tree, run_series
from once_per_run import once_per_run
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BACKENDS = ("ddp", "fsdp2", "zero2", "zero3")
KEYS = ("sft_loss", "policy_loss", "grad_norm", "reward_mean", "value_loss")
TOL = 1e-5
"""Relative: DDP all-reduces whole gradients, FSDP2 and ZeRO reduce-scatter them in buckets, so float32
sums may differ in the last bits (observed: 6e-8)."""
ATOL = 1e-7
"""Absolute floor: the on-policy GRPO loss is a mean of zero-mean advantages, so it is 0 up to cancellation
(observed: 7e-9 under FSDP2 against exactly 0 under DDP); a relative bound alone cannot hold there."""


VARIANTS = {
    "fsdp2+fp16-lora": (
        "fsdp2",
        ["model.dtype=float16", "parallel.param_dtype=float16", "model.lora={rank: 4, alpha: 4}"],
    ),
    "fsdp2+critic": ("fsdp2", ["algorithm.name=ppo_critic"]),
}
"""Runs beyond the plain backends, for the checkpoint and kill -9 tests only: FSDP2 computing in fp16 with float32 LoRA
weights over an fp16 base (the loss scale is part of the state a resume must restore), and FSDP2 training PPO's
value network (sharded too: a resume writes each rank's saved shards back into it)."""


def _job(model_dir: str, out: Path, name: str, backend: str, reward_url: str) -> list[str]:
    """trainer/main.py's arguments for the tiny GRPO job of ``backend`` (a plain backend or one of VARIANTS)."""
    backend, extra = VARIANTS.get(backend, (backend, []))
    return [
        *extra,
        f"model.path={model_dir}",
        f"logging.output_dir={out}",
        f"logging.run_name={name}",
        "logging.progress=false",
        "logging.tensorboard=false",
        f"parallel.backend={backend}",
        "train.warmup_steps=4",
        "train.warmup_checkpoint_every=2",
        "train.epochs=2",
        "train.checkpoint_every=1",
        "data.prompts_per_epoch=4",
        "algorithm.group_size=4",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "eval.every=1",
        "train.ema_decay=0.5",
        f"reward.urls=[{reward_url}]",
    ]


def _series(jobs: dict[str, list[str]], workdir: Path) -> dict[str, str]:
    """Run the named jobs one after another in one torchrun (2 processes); each job's stdout by name."""
    series = run_series(list(jobs.values()), workdir, timeout=540)
    assert series.returncode == 0, series.failure()
    return dict(zip(jobs, series.stdout, strict=True))


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _torchrun(job: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "trainer/main.py",
        *job,
    ]


def _records(run_dir: Path, phase: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


@pytest.fixture(scope="module")
def reward_url(tmp_path_factory) -> Iterator[str]:
    """One reward server (digit for the GRPO jobs, brightness for the IP-Adapter's) for every run of this module
    (a job would start its own each time)."""
    from trainer.rewards.launcher import LocalRewardPool

    with LocalRewardPool(["digit", "brightness"], replicas=1, log_dir=tmp_path_factory.mktemp("reward")) as pool:
        yield pool.urls[0]


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory, request, tiny_model_dir, ip_job) -> dict[str, Path]:
    """One uninterrupted run per backend and per ``ip/<backend>`` (the IP-Adapter job), all in one torchrun series
    (DeepSpeed's last), made once per test run (tests/once_per_run.py); run directories by name."""

    def make(out: Path) -> dict[str, str]:
        reward_url = request.getfixturevalue("reward_url")  # started by the worker that runs the jobs only
        jobs = {}
        for group in ("ddp", "fsdp2", *VARIANTS), ("zero2", "zero3"):
            jobs.update({backend: _job(tiny_model_dir, out, backend, backend, reward_url) for backend in group})
            jobs.update({f"ip/{b}": ip_job(out, f"ip-{b}", b, reward_url) for b in group if b in BACKENDS})
        _series(jobs, out)
        return {name: str(out / name.replace("/", "-")) for name in jobs}

    return {name: Path(run_dir) for name, run_dir in once_per_run(tmp_path_factory, "backends", make).items()}


def test_every_backend_gives_the_same_losses_and_equal_weights_on_every_rank(straight_runs):
    reference = straight_runs["ddp"]
    for backend in BACKENDS:
        run_dir = straight_runs[backend]
        for phase in ("warmup", "rl", "eval"):  # evaluations read the EMA weights, swapped into the shards
            expected, got = _records(reference, phase), _records(run_dir, phase)
            assert [r["step"] for r in got] == [r["step"] for r in expected] and got, (backend, phase)
            for a, b in zip(expected, got, strict=True):
                for key in KEYS:
                    if key in a:
                        assert abs(b[key] - a[key]) <= TOL * abs(a[key]) + ATOL, (backend, phase, a["step"], key)
        (final,) = _records(run_dir, "final")
        assert final["weights_rank_spread"] == 0.0, backend
        assert (run_dir / "final" / "diffusion_pytorch_model.safetensors").is_file(), backend
        checkpoint = max((run_dir / "checkpoints").glob("step-*"))
        assert (checkpoint / "trainable.safetensors").is_file()
        for rank in (0, 1):
            files = {p.name for p in (checkpoint / f"rank-{rank:05d}").iterdir()}
            assert "rng.pt" in files and ("optimizer.pt" in files) == backend.startswith("zero"), (backend, files)


def test_fp16_run_checkpoints_its_loss_scale_and_float32_lora(straight_runs):
    """FSDP2 computing in fp16: trained with finite gradient norms through the sharded loss scaler, whose state
    is in the checkpoint's optimizer state next to float32 LoRA weights."""
    run_dir = straight_runs["fsdp2+fp16-lora"]
    rl = _records(run_dir, "rl")
    assert rl and all(0 < r["grad_norm"] < float("inf") for r in rl), rl
    checkpoint = max((run_dir / "checkpoints").glob("step-*"))
    scaler = torch.load(checkpoint / "optimizer.pt", weights_only=True)["scaler"]
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] >= 0, scaler
    weights = load_file(checkpoint / "trainable.safetensors")
    assert weights and all(t.dtype == torch.float32 and bool(torch.isfinite(t).all()) for t in weights.values())


KILLED = ("ddp", "fsdp2")
"""Killed with -9 and continued with ``--resume auto``. VARIANTS continue from their uninterrupted run's first-epoch
checkpoint instead (the same restore of their extra state, without two more torchrun start-ups)."""


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory, request, tiny_model_dir, ip_job, straight_runs) -> dict[str, tuple[Path, str]]:
    """Per backend of KILLED: its run killed with -9 (torchrun and both ranks) once it logged an RL epoch; then in
    one torchrun series, those runs continued with ``--resume auto``, and each of VARIANTS and IP_RESUMED resumed
    into a run of its own from its uninterrupted run's epoch-1 checkpoint; (run directory, its stdout) by name,
    made once per test run."""

    def make(out: Path) -> dict[str, tuple[str, str]]:
        reward_url = request.getfixturevalue("reward_url")
        for backend in KILLED:
            victim = subprocess.Popen(
                _torchrun(_job(tiny_model_dir, out, backend, backend, reward_url)),
                cwd=REPO,
                env=_env(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            metrics = out / backend / "metrics.jsonl"
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if metrics.is_file() and any(
                    r["phase"] == "rl" for r in map(json.loads, metrics.read_text().splitlines())
                ):
                    break
                assert victim.poll() is None, f"{backend}: the run ended before it could be killed"
                time.sleep(0.05)
            killed = kill_tree(victim.pid, signal.SIGKILL)  # torchrun and both ranks (each in a session of its own)
            assert len(killed) == 3, killed
            victim.wait()
        jobs = {
            backend: [*_job(tiny_model_dir, out, backend, backend, reward_url), "--resume", "auto"]
            for backend in KILLED
        }
        for variant in VARIANTS:
            first = next((straight_runs[variant] / "checkpoints").glob("step-*-000001"))
            jobs[variant] = [*_job(tiny_model_dir, out, variant, variant, reward_url), f"train.resume={first}"]
        for backend in IP_RESUMED:
            first = next((straight_runs[f"ip/{backend}"] / "checkpoints").glob("step-*-000001"))
            jobs[f"ip/{backend}"] = ip_job(out, f"ip-{backend}", backend, reward_url, f"train.resume={first}")
        stdout = _series(jobs, out)
        return {name: (str(out / name.replace("/", "-")), stdout[name]) for name in jobs}

    return {
        name: (Path(run_dir), stdout)
        for name, (run_dir, stdout) in once_per_run(tmp_path_factory, "backends-killed", make).items()
    }


@pytest.mark.parametrize("backend", (*KILLED, *VARIANTS))
def test_kill9_or_a_resume_reproduces_the_uninterrupted_run(straight_runs, resumed_runs, backend):
    """Bit-identical metrics on the CPU: KILLED's from the start (the victim's records, then the continuation's);
    VARIANTS' from the epoch after their checkpoint (the resumed run logs only what it ran)."""
    run_dir, stdout = resumed_runs[backend]
    assert "resumed from" in stdout
    for phase in ("warmup", "rl", "final"):
        straight, resumed = _records(straight_runs[backend], phase), _records(run_dir, phase)
        if backend in VARIANTS:  # the resumed run logs what it ran: no warm-up, RL from epoch 2
            straight = [] if phase == "warmup" else [r for r in straight if phase != "rl" or r["step"] > 1]
        assert [r["step"] for r in resumed] == [r["step"] for r in straight], phase
        assert resumed or (backend in VARIANTS and phase == "warmup"), phase
        for a, b in zip(straight, resumed, strict=True):
            for key in (*KEYS, "weights_rank_spread"):
                if key in a:
                    assert a[key] == b[key], (phase, a["step"], key)  # bit-identical on the CPU


IP_RESUMED = ("fsdp2", "zero3")
"""Backends whose IP-Adapter run is resumed after its first epoch: they shard the reference's snapshot."""


@pytest.fixture(scope="module")
def ip_job(tmp_path_factory) -> Callable[..., list[str]]:
    """``ip_job(out, name, backend, reward_url, *extra)``: the arguments of a FLUX job that trains its IP-Adapter
    alone (fresh weights) on a triplet folder, with the KL to the reference on and a learning rate that moves the
    policy away from it within an epoch. Each rank draws its own SDE window among 3 starts (the last one ends
    next to the final step: a window that reached it would train one step fewer on that rank, and FSDP2 would
    hang on the unmatched forward)."""
    import tiny_models as testing
    from tiny_data import tiny_dataset

    root = tmp_path_factory.mktemp("ip-backends")
    model = testing.tiny_config("flux", root)
    encoder = testing.tiny_ip_adapter(root).image_encoder
    data = tiny_dataset("triplet_folder", root, model.resolution)
    common = [
        "model.name=flux",
        f"model.path={model.path}",
        f"model.resolution={model.resolution}",
        f"model.max_sequence_length={model.max_sequence_length}",
        "model.dtype=float32",
        f"model.ip_adapter.image_encoder={encoder}",
        "model.ip_adapter.num_tokens=4",
        "data.name=triplet_folder",
        f"data.path={data}",
        f"data.image_size={model.resolution}",
        "data.image_inputs=[style]",
        "data.prompts_per_epoch=2",
        "algorithm.group_size=4",
        "algorithm.micro_batch_size=2",
        "algorithm.kl_beta=0.04",
        "algorithm.sampler.num_steps=5",
        "algorithm.sampler.sde_window=2",
        "algorithm.sampler.window_range=[0,3]",
        "train.warmup_steps=0",
        "train.epochs=2",
        "train.learning_rate=0.05",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=0",
        "eval.num_steps=2",
        "eval.samples_per_prompt=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        "reward.weights={brightness: 1.0}",
    ]

    def job(out: Path, name: str, backend: str, reward_url: str, *extra: str) -> list[str]:
        return [
            *common,
            f"parallel.backend={backend}",
            f"logging.output_dir={out}",
            f"logging.run_name={name}",
            f"reward.urls=[{reward_url}]",
            *extra,
        ]

    return job


def test_ip_adapter_reference_keeps_its_snapshot_under_every_backend(straight_runs, resumed_runs):
    """The reference of IP-Adapter training is the policy with the IP-Adapter's weights as RL started. Where
    the forward gathers the backend's own shards (FSDP2, ZeRO-3) a view passing those weights to the call cannot
    work (FSDP2 computed with the live weights, a KL of 0 forever; ZeRO-3 failed), so the view writes this rank's
    shards of them into the shards around the call: every backend reports the same KL, 0 in the first epoch and
    > 0 once the policy has moved. Resumed after the first epoch, the sharded backends repeat the second (each
    rank's snapshot shards are in the checkpoint)."""

    def kl(run_dir: Path) -> list[float]:
        return [r["kl"] for r in _records(run_dir, "rl")]

    ddp = kl(straight_runs["ip/ddp"])
    assert ddp[0] == 0.0 and ddp[1] > 1e-3, ddp
    for backend in BACKENDS:
        got = kl(straight_runs[f"ip/{backend}"])
        assert got == pytest.approx(ddp, rel=TOL, abs=ATOL), (backend, got, ddp)
    for backend in IP_RESUMED:
        assert kl(resumed_runs[f"ip/{backend}"][0]) == kl(straight_runs[f"ip/{backend}"])[1:], backend


def test_compiled_blocks_train_under_zero_and_fsdp2(tiny_model_dir, reward_url, tmp_path):
    """model.compile=blocks composes with ZeRO-2 and FSDP2 (ZeRO-3 is refused as the config is read): the
    blocks are compiled before the backend wraps the denoiser (FSDP2's hooks run around the compiled forwards),
    and each run gives the eager DDP run's losses with no fallback to eager. Compiled with aot_eager (the same
    captured forward and backward graphs, torch's kernels): inductor's code generation is not what the
    composition tests, and takes minutes here."""
    compiled = ("zero2", "fsdp2")
    short = ["train.warmup_steps=2", "train.epochs=1", "train.checkpoint_every=0", "eval.every=0"]
    jobs = {"ddp": [*_job(tiny_model_dir, tmp_path, "ddp", "ddp", reward_url), *short]}
    for backend in compiled:
        jobs[backend] = [
            *_job(tiny_model_dir, tmp_path, backend, backend, reward_url),
            *short,
            "model.compile=blocks",
            "model.compile_backend=aot_eager",
        ]
    out = _series(jobs, tmp_path / "series")
    for backend in compiled:
        assert "model.compile=blocks:" in out[backend] and "0 fallbacks to eager" in out[backend], out[backend]
        for phase in ("warmup", "rl"):
            expected, got = _records(tmp_path / "ddp", phase), _records(tmp_path / backend, phase)
            assert [r["step"] for r in got] == [r["step"] for r in expected] and got, (backend, phase)
            for a, b in zip(expected, got, strict=True):
                for key in KEYS:
                    if key in a:
                        assert abs(b[key] - a[key]) <= TOL * abs(a[key]) + ATOL, (backend, phase, key, a[key], b[key])
        (rl,) = _records(tmp_path / backend, "rl")
        assert rl["compile_graphs"] > 0 and rl["compile_fallbacks"] == 0, rl
