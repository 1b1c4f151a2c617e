"""Kill -9 mid-run, resume with --resume auto: the run continues exactly as if never interrupted."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from servers import replicas_of

from trainer.checkpoint import Checkpoints, Progress
from trainer.state import State

REPO = Path(__file__).resolve().parents[2]
KEYS = ("policy_loss", "grad_norm", "reward_mean", "approx_kl", "sft_loss")


def _args(model_dir: str, out: Path, name: str) -> list[str]:
    return [
        sys.executable,
        "trainer/main.py",
        f"model.path={model_dir}",
        f"logging.output_dir={out}",
        f"logging.run_name={name}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "train.warmup_steps=6",
        "train.warmup_checkpoint_every=3",
        "train.epochs=6",
        "train.checkpoint_every=1",
        "data.prompts_per_epoch=4",
        "algorithm.group_size=4",
        "algorithm.kl_beta=0.01",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "eval.every=0",
        "reward.replicas=1",
    ]


def _records(run_dir: Path, phase: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def test_kill9_then_resume_reproduces_the_uninterrupted_losses(tmp_path, tiny_model_dir):
    subprocess.run(
        _args(tiny_model_dir, tmp_path, "straight"), cwd=REPO, env=_env(), check=True, capture_output=True, timeout=600
    )
    kill_after = random.Random(os.getpid()).randint(1, 4)
    victim = subprocess.Popen(
        _args(tiny_model_dir, tmp_path, "killed"),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        done = metrics.read_text().rpartition("\n")[0] if metrics.is_file() else ""  # whole lines: one may be mid-write
        if any(
            json.loads(line)["phase"] == "rl" and json.loads(line)["step"] >= kill_after for line in done.splitlines()
        ):
            break
        assert victim.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    replicas = replicas_of(victim.pid)
    assert replicas, "the run's reward replicas were not found"
    os.killpg(victim.pid, signal.SIGKILL)  # the trainer (its replicas have a session of their own)
    victim.wait()
    deadline = time.monotonic() + 30
    while replicas_of(victim.pid) and time.monotonic() < deadline:  # they see their parent gone and exit
        time.sleep(0.1)
    assert not replicas_of(victim.pid), "reward replicas outlived the killed trainer"

    resumed = subprocess.run(
        _args(tiny_model_dir, tmp_path, "killed") + ["--resume", "auto"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    for phase in ("warmup", "rl"):
        straight, killed = _records(tmp_path / "straight", phase), _records(tmp_path / "killed", phase)
        assert [r["step"] for r in killed] == [r["step"] for r in straight], phase
        for a, b in zip(straight, killed, strict=True):
            for key in KEYS:
                if key in a:
                    assert a[key] == b[key], (phase, a["step"], key)  # bit-identical on the CPU
    final = lambda name: _records(tmp_path / name, "final")[0]  # noqa: E731
    assert final("straight")["reward_mean"] == final("killed")["reward_mean"]


def test_interrupted_writes_are_never_taken_for_checkpoints(tmp_path, tiny_model_dir):
    from trainer.distributed import SingleProcess
    from trainer.models.sd3 import SD3Adapter
    from trainer.models.tiny import TinyConfig

    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    backend = SingleProcess(torch.device("cpu"))
    backend.prepare(adapter.denoiser, adapter.trainable.parameters(), lambda p: torch.optim.AdamW(p, lr=1e-3))
    checkpoints = Checkpoints(tmp_path, keep=2, is_main=True)
    assert checkpoints.latest() is None
    for epoch in (1, 2, 3):
        checkpoints.save(
            Progress(10, epoch, True), adapter, backend, {"ema": State({"w": torch.full((2,), float(epoch))})}, {}
        )
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000010-000002", "step-000010-000003"]  # keep=2
    # A write killed half-way leaves a temporary directory, and a directory with no progress file is not
    # complete either: neither is ever chosen.
    (tmp_path / ".incomplete-abc").mkdir()
    (tmp_path / ".incomplete-abc" / "optimizer.pt").write_bytes(b"partial")
    (tmp_path / "step-000010-000009").mkdir()
    assert checkpoints.latest().name == "step-000010-000003"
    with torch.no_grad():
        before = [p.clone() for p in adapter.trainable.parameters()]
        for p in adapter.trainable.parameters():
            p.add_(1.0)
    progress, states = checkpoints.load(checkpoints.latest(), adapter, backend)
    assert progress == Progress(10, 3, True) and list(states) == ["ema"]
    assert torch.equal(states["ema"]["w"], torch.full((2,), 3.0))
    assert all(torch.equal(a, b) for a, b in zip(before, adapter.trainable.parameters(), strict=True))


def _failing_save(failure: str) -> tuple[dict, dict, str]:
    """(states, config, error) of a save that fails half-way."""
    if failure == "shared-tensors":
        # The safetensors writer refuses tensors that share memory: the save fails after the trainable weights
        # and the optimizer state are written, before the progress file.
        shared = torch.zeros(4)
        return {"ema": State({"a": shared, "b": shared[:2]})}, {}, "share memory"
    # json cannot write a config that holds itself: the save fails after the progress file, so a checkpoint
    # written in place would look complete.
    config = {"train": {}}
    config["train"]["self"] = config
    return {}, config, "Circular reference"


@pytest.mark.parametrize("failure", ["shared-tensors", "unwritable-config"])
def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint_the_latest(tmp_path, tiny_model_dir, failure):
    from trainer.distributed import SingleProcess
    from trainer.models.sd3 import SD3Adapter
    from trainer.models.tiny import TinyConfig

    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    backend = SingleProcess(torch.device("cpu"))
    backend.prepare(adapter.denoiser, adapter.trainable.parameters(), lambda p: torch.optim.AdamW(p, lr=1e-3))
    checkpoints = Checkpoints(tmp_path, keep=0, is_main=True)
    previous = checkpoints.save(Progress(10, 1, True), adapter, backend, {}, {})
    assert checkpoints.latest() == previous
    states, config, error = _failing_save(failure)
    with pytest.raises((RuntimeError, ValueError), match=error):
        checkpoints.save(Progress(10, 2, True), adapter, backend, states, config)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [previous.name]
    assert checkpoints.latest() == previous
    # the next save that succeeds is taken, and clears what the failed one left
    done = checkpoints.save(Progress(10, 2, True), adapter, backend, {}, {})
    assert checkpoints.latest() == done and done.name == "step-000010-000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == [previous.name, done.name]


SHORT = [
    "algorithm.group_size=2",
    "algorithm.sampler.num_steps=4",
    "algorithm.sampler.window_range=[0,2]",
    "data.prompts_per_epoch=4",
    "eval.samples_per_prompt=1",
    "eval.num_steps=2",
    "eval.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "train.warmup_steps=2",
]


def test_a_resume_after_rl_began_never_warms_up_again(tmp_path, tiny_model_dir):
    """A continuation with a longer train.warmup_steps (a bare --resume auto takes the default 600) warned and then
    ran the rest of the warm-up on the RL-trained weights; RL goes on instead."""
    from warm_start import tiny_trainer

    short = SHORT
    first = tiny_trainer(tmp_path, tiny_model_dir, *short, "train.epochs=1")
    first.fit()
    first.logger.close()
    again = tiny_trainer(tmp_path, tiny_model_dir, *short, "train.epochs=2", "train.warmup_steps=4")
    again.resume(first.checkpoints.latest())
    again.fit()
    again.logger.close()
    phases = [
        (r["phase"], r["step"])
        for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
        if r["phase"] in ("warmup", "rl")
    ]
    assert phases == [("warmup", 0), ("warmup", 1), ("rl", 1), ("rl", 2)], phases
    assert again.progress.warmup_steps_done == 2 and again.progress.epochs_done == 2


def test_a_resume_puts_back_best_where_a_kill_cut_its_replacement(tmp_path, tiny_model_dir):
    """best/ is replaced by two renames (old one aside, new one in): a kill between them leaves it only as
    .replaced-best, which the resume renames back, so the run's result is not lost."""
    from warm_start import tiny_trainer

    first = tiny_trainer(tmp_path, tiny_model_dir, *SHORT, "train.epochs=1", "train.checkpoint_every=1")
    first.fit()
    first.logger.close()
    meta = (tmp_path / "best" / "meta.json").read_text()
    (tmp_path / "best").rename(tmp_path / ".replaced-best")  # as a kill after the first rename leaves it
    again = tiny_trainer(tmp_path, tiny_model_dir, *SHORT, "train.epochs=1", "train.checkpoint_every=1")
    again.resume(first.checkpoints.latest())
    again.logger.close()
    assert (tmp_path / "best" / "meta.json").read_text() == meta and not (tmp_path / ".replaced-best").exists()


def _cut(file: Path) -> None:
    """As a disk fault or a copy cut short leaves ``file``: its first half."""
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


@pytest.mark.parametrize(
    "name", ["trainable.safetensors", "optimizer.pt", "progress.json", "rank-00000/rng.pt", "ema.safetensors"]
)
def test_a_damaged_file_is_named_before_anything_is_loaded(tmp_path, tiny_model_dir, name):
    from trainer.checkpoint import damaged
    from trainer.distributed import SingleProcess
    from trainer.models.sd3 import SD3Adapter
    from trainer.models.tiny import TinyConfig

    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    backend = SingleProcess(torch.device("cpu"))
    backend.prepare(adapter.denoiser, adapter.trainable.parameters(), lambda p: torch.optim.AdamW(p, lr=1e-3))
    path = Checkpoints(tmp_path, 0, True).save(
        Progress(3, 0), adapter, backend, {"ema": State({"w": torch.ones(3)})}, {"train": {}}
    )
    assert damaged(path) is None
    _cut(path / name)
    assert damaged(path).startswith(f"{name} cannot be read")
    assert damaged(path, only=("config.json",)) is None  # an export reads only what it names
    (path / name).unlink()
    required = name in ("trainable.safetensors", "optimizer.pt", "progress.json")  # rng.pt: not from a smaller world
    assert damaged(path) == (f"{name} is missing" if required else None)


def test_resume_auto_continues_from_the_newest_checkpoint_that_can_be_loaded(tmp_path, tiny_model_dir, capsys):
    """A newest checkpoint with a file cut short (a disk fault) is set aside, named, and the run continues from the
    one before it; the checkpoint written in its place is a whole one. Before, the resume died in torch.load."""
    from warm_start import tiny_trainer

    first = tiny_trainer(tmp_path, tiny_model_dir, *SHORT, "train.epochs=2", "train.checkpoint_every=1")
    first.fit()
    first.logger.close()
    newest = first.checkpoints.latest()
    _cut(newest / "optimizer.pt")
    again = tiny_trainer(tmp_path, tiny_model_dir, *SHORT, "train.epochs=2", "train.checkpoint_every=1")
    checkpoint = again.checkpoints.newest_loadable(again.backend)
    assert checkpoint.name == "step-000002-000001"
    assert f"checkpoint {newest} cannot be loaded (optimizer.pt cannot be read" in capsys.readouterr().out
    assert [p.name.startswith(f"damaged-{newest.name}-") for p in tmp_path.joinpath("checkpoints").iterdir()].count(
        True
    ) == 1
    again.resume(checkpoint)
    again.fit()
    again.logger.close()
    assert again.progress.epochs_done == 2 and again.checkpoints.latest().name == newest.name
    from trainer.checkpoint import damaged

    assert damaged(again.checkpoints.latest()) is None
    _cut(checkpoint / "trainable.safetensors")
    _cut(again.checkpoints.latest() / "trainable.safetensors")
    with pytest.raises(ValueError, match="no checkpoint in .* can be loaded .*trainable.safetensors cannot be read"):
        again.checkpoints.newest_loadable(again.backend)


def test_a_named_checkpoint_that_cannot_be_loaded_is_refused_naming_the_one_before(tmp_path, tiny_model_dir):
    from trainer.distributed import SingleProcess
    from trainer.export import load_checkpoint
    from trainer.models.sd3 import SD3Adapter
    from trainer.models.tiny import TinyConfig
    from trainer.preflight import require_checkpoint

    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    backend = SingleProcess(torch.device("cpu"))
    backend.prepare(adapter.denoiser, adapter.trainable.parameters(), lambda p: torch.optim.AdamW(p, lr=1e-3))
    checkpoints = Checkpoints(tmp_path, 0, True)
    config = {"model": {"name": "tiny", "path": tiny_model_dir}}
    older = checkpoints.save(Progress(3, 0), adapter, backend, {}, config)
    newer = checkpoints.save(Progress(6, 0), adapter, backend, {}, config)
    _cut(newer / "optimizer.pt")
    require_checkpoint(newer, "train.init_from")  # the weights are whole: a start from them needs no more
    with pytest.raises(ValueError, match=f"optimizer.pt cannot be read.*: pass the checkpoint before it, {older}$"):
        require_checkpoint(newer, "train.resume")
    _cut(newer / "trainable.safetensors")
    with pytest.raises(ValueError, match="train.init_from=.* cannot be loaded, trainable.safetensors cannot be read"):
        require_checkpoint(newer, "train.init_from")
    with pytest.raises(
        ValueError,
        match=f"cannot be loaded, trainable.safetensors cannot be read.*: export the checkpoint before it, {older}$",
    ):
        load_checkpoint(newer)
    load_checkpoint(older)
    _cut(older / "trainable.safetensors")
    with pytest.raises(ValueError, match=f"{older} cannot be loaded, .*: restore it from a copy$"):
        load_checkpoint(older)


def test_a_run_continuing_another_runs_checkpoint_takes_its_best_weights(tmp_path, tiny_model_dir, capsys):
    """It kept the other run's scoreboard state (best: before RL) but had no best/: the closing line named a folder
    and an export command that did not exist, and a roll-back would have had nothing to load."""
    from warm_start import tiny_trainer

    first = tiny_trainer(tmp_path / "first", tiny_model_dir, *SHORT, "train.epochs=1", "train.checkpoint_every=1")
    first.fit()
    first.logger.close()
    meta = (tmp_path / "first" / "best" / "meta.json").read_text()
    again = tiny_trainer(tmp_path / "again", tiny_model_dir, *SHORT, "train.epochs=2", "train.checkpoint_every=1")
    again.resume(first.checkpoints.latest())
    assert (tmp_path / "again" / "best" / "meta.json").read_text() == meta
    assert f"is {tmp_path / 'first' / 'best'}'s, copied here" in capsys.readouterr().out
    again.fit()
    again.logger.close()
    best = json.loads((tmp_path / "again" / "best" / "meta.json").read_text())
    assert best["epoch"] == again.scoreboard.best_epoch  # whichever evaluation won, best/ holds it
