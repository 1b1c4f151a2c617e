"""What a job checks and sets up before it builds anything: the device, the run directory (never another run's),
the checkpoint paths it is given; and the run's files: checkpoint permissions, metrics kept on a resume."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
import yaml

from trainer.build import resolve_device
from trainer.checkpoint import Checkpoints, Progress
from trainer.config import load_config
from trainer.distributed import SingleProcess
from trainer.launch import hold_run_dir
from trainer.logging import RunLogger
from trainer.preflight import require_checkpoint
from trainer.run import _launch_local_pool, reused_run_dir

REPO = Path(__file__).resolve().parents[2]


def test_devices_name_this_ranks_gpu_unless_an_index_is_given():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name, index in (("cuda", 3), ("cuda:1", 1)):  # process 3 of its machine
        if index < count:
            assert resolve_device(name, 3) == torch.device("cuda", index)
        else:  # torch.cuda.set_device would fail with an AttributeError or "invalid device ordinal"
            with pytest.raises(
                ValueError,
                match=rf"train.device='{name}' needs GPU {index}, but this process sees "
                rf"{count} GPU\(s\).*use train.device=auto or cpu",
            ):
                resolve_device(name, 3)
    assert resolve_device("cpu", 3) == torch.device("cpu")
    expected = torch.device("cuda", 2) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto", 2) == expected
    with pytest.raises(ValueError, match=r"train.device='gpu' is not a device: use auto, cpu, cuda or cuda:N"):
        resolve_device("gpu", 0)


def _fake_checkpoint(path: Path) -> Path:
    """A checkpoint's files, each readable, of no model."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    for name in ("progress.json", "backend.json", "config.json"):
        (path / name).write_text("{}")
    save_file({}, path / "trainable.safetensors")
    torch.save({}, path / "optimizer.pt")
    return path


def test_a_path_that_is_not_a_checkpoint_is_refused_naming_the_one_meant(tmp_path):
    require_checkpoint(_fake_checkpoint(tmp_path / "run" / "checkpoints" / "step-000004-000002"), "train.resume")
    with pytest.raises(
        ValueError,
        match=r"train.init_from='.*nowhere': no such directory; pass a "
        r"<run>/checkpoints/step-\* directory$",
    ):  # was "not a complete checkpoint"
        require_checkpoint(tmp_path / "nowhere", "train.init_from")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ValueError,
        match=r"train.init_from='.*empty' is not a complete checkpoint .*: pass a "
        r"<run>/checkpoints/step-\* directory$",
    ):
        require_checkpoint(tmp_path / "empty", "train.init_from")
    with pytest.raises(
        ValueError,
        match=r"is a run directory: pass one of its checkpoints, e.g. .*step-000004-000002"
        r", or train.resume=auto",
    ):
        require_checkpoint(tmp_path / "run", "train.resume")


def test_a_run_directory_holding_another_run_is_refused_and_default_names_do_not_collide(tmp_path, monkeypatch):
    assert reused_run_dir(tmp_path / "fresh") is None
    (tmp_path / "old").mkdir()
    assert reused_run_dir(tmp_path / "old") is None  # made, nothing written yet
    (tmp_path / "old" / "metrics.jsonl").write_text("")
    assert "continue it with train.resume=auto" in reused_run_dir(tmp_path / "old")

    from trainer import run

    monkeypatch.setattr(time, "strftime", lambda fmt: "20261122-120000")
    assert run.new_run_name(tmp_path) == "20261122-120000"
    (tmp_path / "20261122-120000").mkdir()
    (tmp_path / "20261122-120000-2").mkdir()
    assert run.new_run_name(tmp_path) == "20261122-120000-3"


def test_main_refuses_another_runs_directory_and_a_wrong_resume_path_before_building(tmp_path, capsys):
    """Both used to fail late: a second fresh run under the same logging.run_name replaced its own
    checkpoints by the first run's ones (equal names) and mixed the two runs' metrics; a run directory given
    as train.resume failed with a FileNotFoundError traceback after the model and reward servers started."""
    from trainer.main import main

    (tmp_path / "same").mkdir()
    (tmp_path / "same" / "metrics.jsonl").write_text('{"phase": "rl", "step": 1}\n')
    model = tmp_path / "not-built"  # the tiny model would be built there
    base = [f"logging.output_dir={tmp_path}", f"model.path={model}", "model.build_if_missing=true"]
    for extra, message in (
        ("logging.run_name=same", "already holds a run (metrics.jsonl)"),
        (f"train.resume={tmp_path / 'same'}", "is not a complete checkpoint"),
        ("data.name=prompt_file", "data.path"),
    ):  # checked after the model loaded, before
        assert main([*base, extra]) == 2
        assert message in capsys.readouterr().err
    assert not model.exists()
    assert (tmp_path / "same" / "metrics.jsonl").read_text() == '{"phase": "rl", "step": 1}\n'


def test_a_resume_under_another_model_or_algorithm_is_refused_before_anything_loads(tmp_path, capsys):
    """It failed once the model had loaded, with "the checkpoint holds 0 auxiliary optimizers, this run has 1"."""
    from trainer.main import main

    checkpoint = _fake_checkpoint(tmp_path / "older" / "checkpoints" / "step-000004-000002")
    (checkpoint / "config.json").write_text(json.dumps({"model": {"name": "tiny"}, "algorithm": {"name": "dpo"}}))
    model = tmp_path / "not-built"
    base = [f"logging.output_dir={tmp_path}", f"model.path={model}", "model.build_if_missing=true", "reward.replicas=1"]
    for resume in ([f"train.resume={checkpoint}"], ["--resume", "auto", "logging.run_name=older"]):
        assert main([*base, *resume]) == 2
        assert (
            f"error: train.resume: {checkpoint} was written by a run of algorithm.name=dpo, and this one has "
            f"algorithm.name=grpo: resume with algorithm.name=dpo, or start a new run from its weights with "
            f"train.init_from={checkpoint}"
        ) in capsys.readouterr().err
    assert not model.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["older"]


def test_checkpoint_directories_get_the_users_usual_mode(tmp_path):
    """``tempfile.mkdtemp`` makes directories 0700; renamed as they were, other users and containers under
    another uid could not read (export, init from) a checkpoint."""
    net = torch.nn.Linear(2, 2)
    backend = SingleProcess(torch.device("cpu"))
    backend.prepare(net, list(net.parameters()), lambda params: torch.optim.SGD(params, lr=0.1))
    old = os.umask(0o022)
    try:
        path = Checkpoints(tmp_path, keep=0, is_main=True).save(
            Progress(1, 0), SimpleNamespace(denoiser=net), backend, {}, {}
        )
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o755


def _records(logger: RunLogger) -> list[tuple[str, int]]:
    lines = (logger.run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["phase"], r["step"]) for r in map(json.loads, lines)]


def test_a_resume_keeps_the_records_written_before_its_checkpoint(tmp_path):
    """The evaluation before RL and warm-up checkpoint records are all at step 0; kept by step, a resume from
    a warm-up checkpoint kept the later ones too, and the redone evaluation was then logged twice."""
    logger = RunLogger(tmp_path, enabled=True, tensorboard=False)
    logger.log(0, "warmup", {})
    logger.log(1, "warmup", {})
    logger.log(0, "checkpoint", {"warmup_steps_done": 2})
    logger.log(2, "warmup", {})
    logger.log(3, "warmup", {})
    logger.log(0, "checkpoint", {"warmup_steps_done": 4})
    logger.log(0, "eval", {})
    logger.log(1, "rl", {})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"phase": "rl", "st')  # a line cut off by a kill
    logger = RunLogger(tmp_path, enabled=True, tensorboard=False)
    logger.truncate(2, 0)
    assert _records(logger) == [("warmup", 0), ("warmup", 1), ("checkpoint", 0)]
    logger.log(2, "warmup", {})
    logger.close()
    assert _records(logger)[-1] == ("warmup", 2)
    assert not list(tmp_path.glob("*.tmp"))


def _scalars(run_dir: Path, axis: str, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard" / axis))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_resume_hides_the_redone_steps_in_tensorboard(tmp_path):
    """Events of steps after the checkpoint were kept, so a resumed run showed two points for each redone
    step (warm-up steps and RL epochs are separate runs, each purged from its own first redone step)."""
    logger = RunLogger(tmp_path, enabled=True, tensorboard=True)
    for step in range(4):
        logger.log(step, "warmup", {"loss": 1.0})
    for epoch in (1, 2, 3):
        logger.log(epoch, "rl", {"reward_mean": 0.1 * epoch})
        if epoch == 2:
            logger.log(2, "checkpoint", {"warmup_steps_done": 4})
    logger.close()
    # A writer's file is named by the second, then a process-wide count as text: two writers of one process in one
    # second sort "...9" after "...10", and the reader would take the resumed one for the first. A resumed process
    # writes in a later second than the one it resumes.
    time.sleep(1 - time.time() % 1)
    logger = RunLogger(tmp_path, enabled=True, tensorboard=True)
    logger.truncate(4, 2)
    logger.log(3, "rl", {"reward_mean": 0.9})
    logger.close()
    assert _scalars(tmp_path, "rl", "rl/reward_mean") == [
        (1, pytest.approx(0.1)),
        (2, pytest.approx(0.2)),
        (3, pytest.approx(0.9)),
    ]
    assert [step for step, _ in _scalars(tmp_path, "warmup", "warmup/loss")] == [0, 1, 2, 3]


def test_the_jobs_own_reward_servers_expect_the_token_its_client_sends(tmp_path, monkeypatch):
    """A REWARD_SERVER_TOKEN exported for other servers reached the job's own replicas through the environment,
    while the client sent reward.token (None): every request was a 401."""
    monkeypatch.setenv("REWARD_SERVER_TOKEN", "from-shell")
    config = load_config(overrides=["reward.token=from-config", "reward.replicas=1", "reward.weights={brightness: 1}"])
    with contextlib.ExitStack() as stack:
        pool = _launch_local_pool(config, tmp_path, stack)
        pool.wait_ready()
        (url,) = pool.urls
        status = {
            token: httpx.get(f"{url}/info", headers={"Authorization": f"Bearer {token}"}, trust_env=False).status_code
            for token in ("from-config", "from-shell")
        }
    assert status == {"from-config": 200, "from-shell": 401}


def test_the_reward_replicas_load_while_the_model_loads(tmp_path, monkeypatch):
    """The job launches its replicas before it builds the model, so that a slow model load and slow scorer loads
    overlap: here the model load waits until a replica has loaded its scorer (the replicas used to be launched
    after the model was built, and this wait could only time out)."""
    import trainer.build
    from trainer.main import main

    build_adapter, waited = trainer.build.build_adapter, []

    def after_a_replica_loaded(config, device):
        logs = tmp_path / "outputs" / "run" / "reward_replicas"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            "Application startup complete" in log.read_text() for log in logs.glob("replica-*.log")
        ):
            time.sleep(0.05)
        waited.append(time.monotonic() < deadline)
        return build_adapter(config, device)

    monkeypatch.setattr(trainer.build, "build_adapter", after_a_replica_loaded)
    assert (
        main(
            [
                f"model.path={tmp_path / 'tiny'}",
                "model.build_if_missing=true",
                f"logging.output_dir={tmp_path / 'outputs'}",
                "logging.run_name=run",
                "logging.progress=false",
                "logging.tensorboard=false",
                "reward.replicas=1",
                "train.warmup_steps=0",
                "train.epochs=1",
                "data.prompts_per_epoch=1",
                "algorithm.group_size=2",
                "algorithm.sampler.num_steps=4",
                "algorithm.sampler.window_range=[0,2]",
                "eval.samples_per_prompt=1",
                "eval.num_steps=1",
            ]
        )
        == 0
    )
    assert waited == [True]


@pytest.fixture(scope="module")
def brightness_server(tmp_path_factory):
    """A real reward server process serving brightness alone, with a bearer token."""
    from trainer.rewards.launcher import LocalRewardPool

    env = {**os.environ, "REWARD_SERVER_TOKEN": "tok"}
    with LocalRewardPool(["brightness"], replicas=1, log_dir=tmp_path_factory.mktemp("server"), env=env) as pool:
        yield pool.urls[0]


def _fails_fast(tmp_path, capsys, *overrides: str) -> str:
    """main's one error line for a run refused before anything is built: no model, no run folder, in seconds."""
    from trainer.main import main

    model, output = tmp_path / "not-built", tmp_path / "outputs"
    start = time.monotonic()
    assert main([f"model.path={model}", "model.build_if_missing=true", f"logging.output_dir={output}", *overrides]) == 2
    assert time.monotonic() - start < 10
    assert not model.exists() and not output.exists()
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 2  # + RF_TRACEBACK hint
    return err.splitlines()[0]


def test_unreachable_or_unsuitable_reward_servers_are_refused_before_anything_is_built(
    tmp_path, capsys, monkeypatch, brightness_server
):
    """Each used to show after the warm-up (or 116 s in) as a 35-line traceback ending in RewardUnavailableError."""
    from servers import free_port

    port = free_port()
    line = _fails_fast(tmp_path, capsys, f"reward.urls=[http://127.0.0.1:{port}]")
    assert f"reward server http://127.0.0.1:{port} is unreachable" in line
    assert f"`rewardflow-reward-server --scorers digit --host 127.0.0.1 --port {port}`" in line

    monkeypatch.setenv("REWARD_SERVER_TOKEN", "tok")
    line = _fails_fast(
        tmp_path, capsys, f"reward.urls=[{brightness_server}]", "reward.weights={digit: 1, brightness: 1}"
    )
    assert f"reward server {brightness_server} does not serve digit (it serves brightness): restart it with " in line
    assert f"--scorers brightness,digit --host 127.0.0.1 --port {brightness_server.rsplit(':', 1)[1]}`" in line

    monkeypatch.delenv("REWARD_SERVER_TOKEN")
    line = _fails_fast(tmp_path, capsys, f"reward.urls=[{brightness_server}]", "reward.weights={brightness: 1}")
    assert "refused the bearer token (HTTP 401" in line and "export REWARD_SERVER_TOKEN=" in line

    line = _fails_fast(tmp_path, capsys, "reward.weights={digt: 1}")  # the job's own servers would not start
    assert "reward.weights names scorer 'digt', which no reward server has (did you mean 'digit'?)" in line

    # Alarm scorers too: a server without one used to fail after the warm-up, a local pool with a 35-line traceback.
    monkeypatch.setenv("REWARD_SERVER_TOKEN", "tok")
    line = _fails_fast(
        tmp_path,
        capsys,
        f"reward.urls=[{brightness_server}]",
        "reward.weights={brightness: 1}",
        "eval.alarm_scorers=[colorfulness]",
    )
    assert f"reward server {brightness_server} does not serve colorfulness (it serves brightness)" in line
    assert line.endswith("or take colorfulness out of eval.alarm_scorers")
    line = _fails_fast(tmp_path, capsys, "eval.alarm_scorers=[aesthetik]")
    assert "eval.alarm_scorers names scorer 'aesthetik', which no reward server has (did you mean 'aesthetic'?)" in line


def test_requests_beyond_a_servers_limits_are_refused_before_anything_is_built(
    tmp_path, capsys, monkeypatch, brightness_server
):
    """Each was an HTTP 413 at the first scoring, after the warm-up: the server's /info says its limits first."""
    monkeypatch.setenv("REWARD_SERVER_TOKEN", "tok")
    served = [f"reward.urls=[{brightness_server}]", "reward.weights={brightness: 1}"]
    line = _fails_fast(tmp_path, capsys, *served, "reward.batch_size=300")
    assert line == (
        f"error: reward.batch_size=300 makes requests of 300 items, more than reward server "
        f"{brightness_server} takes in one (HTTP 413): set reward.batch_size=256 or less, or restart the "
        "server with --max-items 300"
    )
    line = _fails_fast(tmp_path, capsys, *served, "model.resolution=2048")  # 32 raw images: 402653184 bytes
    assert line.endswith(
        "takes in one (HTTP 413): set reward.batch_size=21 or less, or restart the server with "
        "--max-body-bytes 402653184"
    )
    line = _fails_fast(tmp_path, capsys, *served, "model.resolution=8192")
    assert line.endswith(
        f"is above the largest image side reward server {brightness_server} takes (4096): restart "
        "it with --max-image-side 8192"
    )
    from shared.protocol import Limits
    from trainer.rewards.preflight import Requests

    limits = Limits(max_items=256, max_image_side=4096, max_body_bytes=256 * 2**20, max_pixels_per_request=2**27)
    assert Requests(32, 2048).beyond("u", limits) is not None
    assert Requests(32, 2048, "png").beyond("u", limits) is None  # compressed: its size is not known before
    assert (
        Requests(33, 2048, "png")
        .beyond("u", limits)
        .endswith("set reward.batch_size=32 or less, or restart the server with --max-pixels-per-request 138412032")
    )
    assert Requests(32).beyond("u", limits) is None  # the model's own side: checked once it is known


def test_requests_beyond_the_jobs_own_replicas_limits_are_refused_before_the_warm_up(tmp_path, capsys, tiny_model_dir):
    from trainer.main import main

    assert (
        main(
            [
                f"model.path={tiny_model_dir}",
                f"logging.output_dir={tmp_path}",
                "reward.replicas=1",
                "reward.batch_size=300",
                "train.warmup_steps=1",
            ]
        )
        == 2
    )
    out, err = capsys.readouterr()
    line = next(line for line in err.splitlines() if line.startswith("error: "))
    assert line.startswith(
        "error: reward.batch_size=300 makes requests of 300 items, more than reward server http://127.0.0.1:"
    ) and line.endswith("set reward.batch_size=256 or less"), err
    assert "warm-up" not in out and list(tmp_path.iterdir()) == []


def test_a_prompt_file_with_the_default_warm_up_is_refused_before_any_model_loads(tmp_path, capsys) -> None:
    """Prompts alone have no target images: this used to fail at the first warm-up step, after the model, the
    reward replicas and the run directory were made."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    line = _fails_fast(
        tmp_path, capsys, "data.name=prompt_file", f"data.path={prompts}", "reward.weights={brightness: 1}"
    )
    assert line == (
        "error: data.name=prompt_file has prompts but no target images for the supervised warm-up: set "
        "train.warmup_steps=0 (or start from trained weights: train.init_from)"
    )


SHORT = [
    "train.warmup_steps=0",
    "train.epochs=0",
    "eval.samples_per_prompt=1",
    "eval.num_steps=1",
    "reward.replicas=1",
    "logging.progress=false",
    "logging.tensorboard=false",
]
"""A job that ends as soon as it has started: no warm-up, no RL, one cheap evaluation."""


def test_a_mistyped_tiny_model_path_is_refused_not_built(tmp_path, capsys) -> None:
    """``model.path=/some/typo`` with the default tiny model built a random model there and trained on it (a later
    ``model.name=sd3`` run then loaded it as SD3): only the default folder, or ``model.build_if_missing``, builds."""
    from trainer.main import main

    typo, output = tmp_path / "modles" / "tiny", tmp_path / "outputs"
    assert main([f"model.path={typo}", f"logging.output_dir={output}", *SHORT]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert line == (
        f"error: model.path='{typo}': no such folder: fix the path, leave model.path unset for the default "
        "tiny model (.cache/rewardflow/tiny-sd3-digits), or set model.build_if_missing=true to build a new "
        "random tiny model there"
    )
    assert not (tmp_path / "modles").exists() and not output.exists()
    assert main([f"model.path={typo}", "model.build_if_missing=true", f"logging.output_dir={output}", *SHORT]) == 0
    assert (typo / "transformer" / "config.json").is_file()


def test_every_missing_piece_is_reported_at_once_before_anything_loads(tmp_path) -> None:
    """A preset as shipped took three runs of 8-25 s to learn three problems (no reward server, then the data file,
    then the model folder): the pre-flight names each, with its fix, in one error block, before the model loads."""
    from servers import free_port

    port = free_port()
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "name": "sd3",
                    "path": str(tmp_path / "sd3.5-medium"),
                    "text_embeddings": str(tmp_path / "emb"),
                },
                "data": {"name": "prompt_file", "path": "no/such/prompts.txt"},
                "eval": {"path": str(tmp_path / "test.txt")},
                "train": {"warmup_steps": 0},
                "reward": {"urls": [f"http://127.0.0.1:{port}"], "weights": {"ocr": 1.0}},
                "logging": {"output_dir": str(tmp_path / "outputs")},
            }
        )
    )
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "trainer/main.py", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    took = time.monotonic() - start
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    assert lines[0] == "error: this run cannot start; 5 things to fix first:", run.stderr
    assert lines[1].startswith(f"  - reward server http://127.0.0.1:{port} is unreachable") and lines[1].endswith(
        f"start it with `rewardflow-reward-server --scorers ocr --host 127.0.0.1 --port {port}`, or leave "
        "reward.urls empty and the job starts its own"
    )
    assert lines[2] == (
        "  - data.path='no/such/prompts.txt': no such file (a .txt with one prompt per line or a "
        f".jsonl, looked for at {REPO / 'no/such/prompts.txt'}): set data.path to it"
    )
    assert lines[3].startswith(f"  - eval.path='{tmp_path / 'test.txt'}': no such file") and "set eval.path" in lines[3]
    assert lines[4] == (
        f"  - model.path='{tmp_path / 'sd3.5-medium'}' is not a diffusers StableDiffusion3Pipeline "
        "directory (no such folder); point model.path at a local copy of the weights"
    )
    assert lines[5] == (
        f"  - model.text_embeddings='{tmp_path / 'emb'}': no such folder; write the store there with "
        "python -m trainer.precompute --config CONFIG.yaml --out DIR"
    )
    assert lines[6:] == ["(set RF_TRACEBACK=1 for the traceback)"] and run.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"] and took < 60


def test_an_output_dir_or_a_model_path_that_is_a_file_is_one_line(tmp_path, capsys) -> None:
    """Both were NotADirectoryError tracebacks, the model path's after 30 s (and a .building-* folder beside it)."""
    from trainer.main import main

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    line = _fails_fast(tmp_path, capsys, f"logging.output_dir={a_file / 'runs'}")
    assert line == f"error: logging.output_dir='{a_file / 'runs'}': {a_file} is a file, not a folder"
    assert main([f"model.path={a_file}", f"logging.output_dir={tmp_path / 'outputs'}", "reward.replicas=1"]) == 2
    assert (
        f"error: model.path='{a_file}' is a file: name the model's folder (a diffusers pipeline's, with "
        "model_index.json)"
    ) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # no .building-*, no run left behind


def test_an_output_dir_that_cannot_be_made_is_one_line(tmp_path, capsys) -> None:
    """It was three chained FileNotFoundError tracebacks from the run directory's mkdir."""
    line = _fails_fast(tmp_path, capsys, "logging.output_dir=/proc/rewardflow-runs")
    assert line.startswith("error: logging.output_dir='/proc/rewardflow-runs': cannot make /proc/rewardflow-runs/")
    assert line.endswith("choose a folder this user can write")


def test_supervised_images_of_another_size_than_the_model_are_refused_before_training(
    tmp_path, capsys, tiny_model_dir
) -> None:
    """It came at the first warm-up step, after the run had started, and left its run folder behind."""
    from trainer.main import main

    output = tmp_path / "outputs"
    assert (
        main(
            [f"model.path={tiny_model_dir}", f"logging.output_dir={output}", "model.resolution=32", "reward.replicas=1"]
        )
        == 2
    )
    err = capsys.readouterr().err  # after the model's loading bars
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith("error: supervised images of (16, 16) pixels encode to latents") and "Traceback" not in err
    assert line.endswith("set data.image_size to the model's resolution")
    assert not output.exists()


def test_image_inputs_a_model_does_not_take_are_refused_naming_them_before_the_warm_up(
    tmp_path, capsys, tiny_model_dir
) -> None:
    """Inpainting rows for the text-to-image tiny model: the warm-up's shape check said to set data.image_size."""
    from tiny_data import tiny_dataset

    from trainer.main import main

    output = tmp_path / "outputs"
    data = tiny_dataset("inpaint_jsonl", tmp_path)
    assert (
        main(
            [
                f"model.path={tiny_model_dir}",
                f"logging.output_dir={output}",
                "data.name=inpaint_jsonl",
                f"data.path={data}",
                "reward.replicas=1",
            ]
        )
        == 2
    )
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert line == (
        "error: the tiny adapter takes no ImageInputs.image, .mask (it is a text-to-image model): train it "
        "on a data.name without images, or set model.name to a model that takes them"
    )
    assert not output.exists()


def test_a_reward_replica_that_cannot_start_ends_the_job_with_its_reason_not_a_traceback(tmp_path, capsys) -> None:
    """aesthetic needs model files, which a job's own replicas are not given: a 33-line traceback before."""
    from trainer.main import main

    assert (
        main(
            [
                f"model.path={tmp_path / 'tiny'}",
                "model.build_if_missing=true",
                f"logging.output_dir={tmp_path / 'outputs'}",
                "reward.weights={aesthetic: 1}",
                "reward.replicas=1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "\nerror: a scorer of reward.weights or eval.alarm_scorers needs model files: set reward.model_dir to the "
        "folder that holds them (the replicas' --model-dir). reward replica 0 (http://127.0.0.1:"
    ) in f"\n{err}"
    assert "aesthetic needs --model-dir" in err and 'trainer/main.py", line' not in err  # the replica's log, no more


@pytest.mark.slow
def test_the_jobs_own_replicas_score_with_model_files_from_reward_model_dir(tmp_path, tiny_aesthetic_model_dir):
    from trainer.main import main

    assert (
        main(
            [
                f"model.path={tmp_path / 'tiny'}",
                "model.build_if_missing=true",
                f"logging.output_dir={tmp_path / 'outputs'}",
                "logging.run_name=r",
                "logging.progress=false",
                "logging.tensorboard=false",
                "reward.weights={aesthetic: 1}",
                f"reward.model_dir={tiny_aesthetic_model_dir}",
                "reward.replicas=1",
                "train.warmup_steps=0",
                "train.epochs=1",
                "data.prompts_per_epoch=1",
                "algorithm.group_size=2",
                "algorithm.sampler.num_steps=4",
                "algorithm.sampler.window_range=[0,2]",
                "eval.samples_per_prompt=1",
                "eval.num_steps=1",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "outputs" / "r" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert rl and all(math.isfinite(r["reward/aesthetic"]) and r["failed_share"] == 0 for r in rl)


def test_a_task_whose_metrics_read_a_scorer_the_run_does_not_use_is_refused_before_building(
    tmp_path, capsys, monkeypatch, brightness_server
):
    """The text task's metrics are read off ``ocr`` scores: without it they were NaN, with no word why."""
    monkeypatch.setenv("REWARD_SERVER_TOKEN", "tok")
    line = _fails_fast(
        tmp_path, capsys, f"reward.urls=[{brightness_server}]", "reward.weights={brightness: 1}", "data.name=words"
    )
    assert line == (
        "error: the words task's metrics read the ocr scorer: add it to reward.weights or eval.alarm_scorers"
    )


def test_a_run_refused_before_training_leaves_no_run_folder(
    tmp_path, capsys, monkeypatch, brightness_server, tiny_model_dir
):
    """Six typos made six empty run folders: a run that fails after its folder was made (here: a sampler step the
    model has no math for, found once the model is loaded) removes it."""
    from trainer.main import main

    monkeypatch.setenv("REWARD_SERVER_TOKEN", "tok")
    output = tmp_path / "outputs"
    assert (
        main(
            [
                f"model.path={tiny_model_dir}",
                f"logging.output_dir={output}",
                f"reward.urls=[{brightness_server}]",
                "reward.weights={brightness: 1}",
                "algorithm.sampler.kind=ddim",
            ]
        )
        == 2
    )
    assert "ddim" in capsys.readouterr().err
    assert not output.exists()
    (output / "older").mkdir(parents=True)
    assert (
        main(
            [
                f"model.path={tiny_model_dir}",
                f"logging.output_dir={output}",
                "data.name=prompt_file",
                f"data.path={tmp_path / 'missing.txt'}",
                f"reward.urls=[{brightness_server}]",
                "reward.weights={brightness: 1}",
            ]
        )
        == 2
    )
    assert [p.name for p in output.iterdir()] == ["older"]


def test_a_ctrl_c_swallowed_while_the_run_is_set_up_ends_it_before_training(
    tmp_path, capsys, monkeypatch, brightness_server, tiny_model_dir
):
    """Library code that swallowed a Ctrl-C (test_ctrl_c.py): the run stops where training would begin and
    leaves nothing, its folder removed as for a typo."""
    import shared.interrupt
    from trainer.main import main

    monkeypatch.setenv("REWARD_SERVER_TOKEN", "tok")
    monkeypatch.setattr(shared.interrupt, "_asked", True)
    output = tmp_path / "outputs"
    assert (
        main(
            [
                f"model.path={tiny_model_dir}",
                f"logging.output_dir={output}",
                f"reward.urls=[{brightness_server}]",
                "reward.weights={brightness: 1}",
                "train.warmup_steps=1",
            ]
        )
        == 130
    )
    assert "interrupted before training started: nothing to continue" in capsys.readouterr().out
    assert not output.exists()


def test_resume_auto_without_a_run_name_takes_the_newest_unfinished_run(tmp_path):
    from trainer.run import choose_run_dir

    config = load_config(overrides=["train.resume=auto", f"logging.output_dir={tmp_path}"])
    assert "no unfinished run in" in choose_run_dir(config, tmp_path)[1]
    for i, name in enumerate(("old", "finished", "newest", "no-checkpoint")):
        if name != "no-checkpoint":
            checkpoint = _fake_checkpoint(tmp_path / name / "checkpoints" / "step-000004-000002")
            os.utime(checkpoint, (1000 + i, 1000 + i))
    (tmp_path / "no-checkpoint").mkdir()
    (tmp_path / "finished" / "final").mkdir()
    assert choose_run_dir(config, tmp_path) == ("newest", None)
    named = load_config(overrides=["train.resume=auto", "logging.run_name=old"])
    assert choose_run_dir(named, tmp_path) == ("old", None)


def test_resume_auto_of_a_run_without_checkpoints_starts_it_and_names_the_runs_the_name_may_be_a_slip_for(tmp_path):
    """A mistyped logging.run_name with --resume auto starts a run of its own (a SLURM job's first allocation must
    start one): its line now names the close names that have checkpoints."""
    from trainer.launch import fresh_start

    _fake_checkpoint(tmp_path / "sweep-lr3e-4" / "checkpoints" / "step-000004-000002")
    (tmp_path / "sweep-lr3e-5").mkdir()  # no checkpoint: nothing to continue there
    (tmp_path / "sweep-lr3e4").mkdir()  # the run being started
    assert fresh_start(tmp_path, "sweep-lr3e4") == (
        f"train.resume=auto: run sweep-lr3e4 has no complete checkpoint in {tmp_path}; starting it fresh (unfinished "
        "runs of a close name with checkpoints: sweep-lr3e-4; to continue one, stop this and pass its logging.run_name)"
    )
    assert fresh_start(tmp_path, "other") == (
        f"train.resume=auto: run other has no complete checkpoint in {tmp_path}; starting it fresh"
    )


def test_a_finished_run_is_never_offered_as_the_run_to_continue(tmp_path, capsys, tiny_model_dir):
    """--resume auto under a new name offered a finished run of a similar name as the one to continue, and a fresh
    run under a finished run's name was told to continue it: a finished run (final/) has nothing to continue."""
    from trainer.main import main

    output = tmp_path / "outputs"
    for name in ("sweep-lr3e-4", "sweep-lr3e-5"):  # the first finished, the second stopped with a checkpoint
        _fake_checkpoint(output / name / "checkpoints" / "step-000004-000002")
        (output / name / "metrics.jsonl").write_text("")
    (output / "sweep-lr3e-4" / "final").mkdir()
    base = [f"model.path={tiny_model_dir}", f"logging.output_dir={output}", *SHORT]
    assert main([*base, "--resume", "auto", "logging.run_name=sweep-lr3e4"]) == 0
    (said,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train.resume=auto: ")]
    assert said.endswith(
        "starting it fresh (unfinished runs of a close name with checkpoints: sweep-lr3e-5; to "
        "continue one, stop this and pass its logging.run_name)"
    ), said
    assert main([*base, "logging.run_name=sweep-lr3e-4"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: {output / 'sweep-lr3e-4'} already holds a finished run "
        "(checkpoints, metrics.jsonl, final): start this one under another "
        "logging.run_name\n"
    )
    assert main([*base, "logging.run_name=sweep-lr3e-5"]) == 2  # an unfinished one: continuing it is the offer
    assert "continue it with train.resume=auto" in capsys.readouterr().err


def test_an_interrupted_run_says_where_it_stopped_and_how_to_continue(tmp_path, monkeypatch):
    from trainer.launch import resume_command, stopped_at

    config = load_config(overrides=["train.warmup_steps=10", "train.epochs=4"])
    assert stopped_at(Progress(3, 0), config, None) == (
        "stopped in the warm-up, 3 of 10 steps done; no checkpoint was written yet, so continuing starts the run over"
    )
    checkpoint = tmp_path / "step-000010-000002"
    checkpoint.mkdir()
    Progress(10, 2, True).save(checkpoint)
    assert stopped_at(Progress(10, 3, True), config, checkpoint) == (
        f"stopped in RL epoch 4 of 4; continuing starts from the newest checkpoint, {checkpoint} (warm-up steps 10, "
        "RL epochs 2)"
    )
    assert stopped_at(Progress(10, 0, False), config, checkpoint).startswith("stopped in the evaluation before RL")
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert resume_command(["a b.yaml"], ["train.epochs=4", "logging.run_name=old", "train.resume=x"], "run-1") == (
        "python trainer/main.py --config 'a b.yaml' --resume auto train.epochs=4 logging.run_name=run-1"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command([], [], "r").startswith("torchrun --nproc_per_node=2 trainer/main.py --resume auto")


def test_a_text_embedding_store_lacking_the_runs_prompts_is_refused_naming_how_many(
    tmp_path, capsys, tiny_model_dir
) -> None:
    """The early image-size check used to encode a warm-up prompt first, so a store made for another dataset failed
    there, on that one prompt (``load``'s error), instead of in the check that counts what the store lacks."""
    from trainer import precompute
    from trainer.main import main

    (tmp_path / "one.txt").write_text("a handwritten digit 3\n")
    store, output = tmp_path / "text", tmp_path / "outputs"
    assert (
        precompute.main(
            [
                "--config",
                "configs/embedded_digits.yaml",
                "--out",
                str(store),
                f"model.path={tiny_model_dir}",
                "data.name=prompt_file",
                f"data.path={tmp_path / 'one.txt'}",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                f"model.path={tiny_model_dir}",
                f"model.text_embeddings={store}",
                f"logging.output_dir={output}",
                "reward.replicas=1",
            ]
        )
        == 2
    )
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert line.startswith(
        f"error: model.text_embeddings={str(store)!r} lacks 9 of the prompts this run encodes"
    )  # the other digits
    assert not output.exists()


def test_a_run_directory_in_use_by_another_process_is_refused(tmp_path, capsys, tiny_model_dir) -> None:
    """A resume while the run still trains (found by an audit: the resume's truncation of metrics.jsonl dropped
    the running one's later epochs, and its checkpoint writes crashed on the other's). Held by a process of its
    own here, as the running trainer holds it; the lock goes with that process, so a killed run resumes."""
    from trainer.main import main

    run = tmp_path / "outputs" / "busy"
    run.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; "
            "from trainer.launch import hold_run_dir; lock, _ = hold_run_dir(Path(sys.argv[1])); "
            "print('held', flush=True); sys.stdin.read()",
            str(run),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        args = [
            f"model.path={tiny_model_dir}",
            f"logging.output_dir={tmp_path / 'outputs'}",
            "logging.run_name=busy",
            "--resume",
            "auto",
            "reward.replicas=1",
        ]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {run} is in use by process {holder.pid} on ") and "Traceback" not in err
        assert "continue with --resume auto" in err.splitlines()[0] and not (run / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    lock, refusal = hold_run_dir(run)  # the holder is gone: free again
    assert refusal is None and lock is not None
    lock.close()
