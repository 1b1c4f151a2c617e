"""Weights & Biases logging, offline as a user without a network runs it: a job logs to W&B what metrics.jsonl
holds, on the same two step axes; a resumed job continues its W&B run; a W&B login that cannot work stops the job
before any model loads."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.main import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _wandb_home(tmp_path, monkeypatch):
    """W&B's settings, cache and credentials in the test's own folder, never the user's."""
    home = tmp_path / "wandb-home"
    for name in ("HOME", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def _records(path: Path) -> list:
    """The messages of an offline run's .wandb file, once its last one (exit) is there: W&B's own process writes
    the file after ``finish`` returns. The file: a 7-byte header, then LevelDB's log format (32 KiB blocks of
    records, each [crc32, length, type] and its bytes; types 2-4 split a message over blocks)."""
    deadline = time.monotonic() + 60
    while not (records := list(_parse(path.read_bytes()))) or records[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, f"{path} has no exit record after 60 s"
        time.sleep(0.1)
    return records


def _parse(data: bytes):
    from wandb.proto.wandb_internal_pb2 import Record

    pos, part = 7, b""
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):
            return  # still being written
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole message, or its last piece
            record = Record()
            record.ParseFromString(part)
            part = b""
            yield record


def _wandb_runs(run_dir: Path) -> list[tuple[dict, list[dict]]]:
    """(config, history rows) of each W&B run segment logged in ``run_dir``, oldest first."""
    runs = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        config, rows = {}, []
        for record in _records(path):
            kind = record.WhichOneof("record_type")
            if kind in ("run", "config"):  # the run's config, then any updates of it
                update = record.run.config.update if kind == "run" else record.config.update
                config.update({item.key: json.loads(item.value_json) for item in update})
            elif kind == "history":  # an image is a few keys under its name: "eval/samples/path", ...
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
        runs.append((config, rows))
    return runs


def _exit_codes(run_dir: Path) -> list[int]:
    return [
        record.exit.exit_code
        for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        for record in _records(path)
        if record.WhichOneof("record_type") == "exit"
    ]


def _job(tmp_path: Path, model_dir: str, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        f"logging.output_dir={tmp_path}",
        "logging.run_name=w",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.wandb=offline",
        "logging.wandb_project=rf-test",
        "train.warmup_steps=2",
        "warmup.batch_size=4",
        "train.checkpoint_every=1",
        "data.prompts_per_epoch=2",
        "algorithm.group_size=2",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "eval.every=1",
        "reward.replicas=1",
        "reward.token=secret-token",
        *extra,
    ]


def test_a_job_logs_its_metrics_to_wandb_and_a_resume_continues_the_run(tmp_path, tiny_model_dir):
    assert main(_job(tmp_path, tiny_model_dir, "train.epochs=1")) == 0
    run_dir = tmp_path / "w"
    run_id = (run_dir / "wandb-run-id").read_text()
    ((config, rows),) = _wandb_runs(run_dir)
    assert config["model"]["name"] == "tiny" and config["train"]["epochs"] == 1
    assert "secret-token" not in json.dumps(config)  # the config as config.yaml saves it

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if r["phase"] in ("warmup", "rl", "eval", "final")]
    assert {r["phase"] for r in logged} == {"warmup", "rl", "eval", "final"}
    for record in logged:  # each record is one W&B row on its axis, with every finite number it holds
        phase, axis = record["phase"], "warmup/step" if record["phase"] == "warmup" else "rl/epoch"
        (row,) = [
            row
            for row in rows
            if row.get(axis) == record["step"]
            and "eval/samples/caption" not in row
            and any(key.startswith(f"{phase}/") and key != axis for key in row)
        ]
        numbers = {
            f"{phase}/{key}": value
            for key, value in record.items()
            if key not in ("phase", "step", "time") and isinstance(value, int | float) and math.isfinite(value)
        }
        assert numbers and {key: row[key] for key in numbers} == numbers
    # the evaluation grids (before and after RL): one image series, each captioned with the prompt of each row
    grids = [row for row in rows if "eval/samples/caption" in row]
    assert [row["rl/epoch"] for row in grids] == [0, 1]
    assert {row["eval/samples/caption"] for row in grids} == {
        "\n".join(f"row {d + 1}: a handwritten digit {d}" for d in range(10))
    }
    # the epoch's rollout samples (2 prompts x 2), each image captioned with its prompt and reward
    (samples,) = [row for row in rows if "rollouts/samples/captions" in row]
    logged = [json.loads(line) for line in (run_dir / "rollouts" / "epoch0001.jsonl").read_text().splitlines()]
    assert samples["rl/epoch"] == 1 and samples["rollouts/samples/format"] == "jpg" and len(logged) == 4
    assert samples["rollouts/samples/captions"] == [f"{r['prompt']} | reward {r['reward']:.3f}" for r in logged]

    assert main(_job(tmp_path, tiny_model_dir, "train.epochs=2", "train.resume=auto")) == 0
    assert (run_dir / "wandb-run-id").read_text() == run_id
    first, second = _wandb_runs(run_dir)
    assert [p.name.endswith(f"-{run_id}") for p in run_dir.glob("wandb/offline-run-*")] == [True, True]
    assert second[0]["train"]["epochs"] == 2
    assert {row["rl/epoch"] for row in second[1] if "rl/reward_mean" in row} == {2}
    assert {row["rl/epoch"] for row in first[1] if "rl/reward_mean" in row} == {1}
    assert _exit_codes(run_dir) == [0, 0]


def test_an_alarm_becomes_a_wandb_alert_and_a_failed_job_a_failed_run(tmp_path, monkeypatch):
    """The reward-hacking alarm reaches W&B as an alert (W&B sends those on to Slack or email) besides its row;
    a job that ends with an exception ends its W&B run with exit code 1. Without logging.wandb_project, the
    project is $WANDB_PROJECT's, as W&B users set it."""
    from trainer.logging import RunLogger
    from trainer.trackers import WandbTracker

    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    with pytest.raises(RuntimeError, match="boom"), WandbTracker(tmp_path, "offline", "", "", {}) as tracker:
        logger = RunLogger(tmp_path, enabled=True, tensorboard=False, trackers=[tracker])
        logger.log(1, "rl", {"reward_mean": 0.5})
        logger.log(2, "alarm", {"metric": "digit_accuracy", "reward_now": 0.9}, alert="reward-hacking alarm at 2")
        logger.close()
        raise RuntimeError("boom")
    ((_, rows),) = _wandb_runs(tmp_path)
    assert [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows] == [
        {"rl/epoch": 1, "rl/reward_mean": 0.5},
        {"rl/epoch": 2, "alarm/reward_now": 0.9},
    ]
    (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    alerts = [r.alert for r in _records(path) if r.WhichOneof("record_type") == "alert"]
    assert [r.run.project for r in _records(path) if r.WhichOneof("record_type") == "run"] == ["from-env"]
    assert [(a.title, a.text, a.level) for a in alerts] == [
        (f"rewardflow alarm: {tmp_path.name}", "reward-hacking alarm at 2", "WARN")
    ]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])["alert"] == "reward-hacking alarm at 2"
    assert _exit_codes(tmp_path) == [1]


_KILL_WANDB_MIDWAY = """
import os, signal, sys, time
from pathlib import Path
from trainer.logging import RunLogger
from trainer.trackers import WandbTracker

def wandb_core_child(proc):
    try:  # a process may end while /proc is read
        ppid = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
        return ppid == str(os.getpid()) and b"wandb-core" in (proc / "cmdline").read_bytes()
    except OSError:
        return False

run_dir = Path(sys.argv[1])
with WandbTracker(run_dir, "offline", "rf-test", "", {}) as tracker:
    logger = RunLogger(run_dir, enabled=True, tensorboard=False, trackers=[tracker])
    logger.log(1, "rl", {"reward_mean": 0.5})
    (core,) = [int(p.name) for p in Path("/proc").glob("[0-9]*") if wandb_core_child(p)]
    os.kill(core, signal.SIGKILL)
    while (Path("/proc") / str(core) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.05)  # a zombie: dead, not yet reaped
    logger.log(2, "rl", {"reward_mean": 0.6})
    logger.log(3, "alarm", {"reward_now": 0.9}, alert="reward-hacking alarm at 3")
    logger.close()
print("the run went on")
"""


def test_wandb_dying_midway_costs_the_run_its_wandb_rows_not_the_run(tmp_path):
    """W&B's service killed mid-run (out of memory, say): W&B raised from every later call, and a log call
    raising would have ended a training run over its dashboard. One warning; every record still in metrics.jsonl.
    In a subprocess with a W&B service of its own (not the one WANDB_SERVICE names, which another test of this
    process started), so that no other test's service is the one killed."""
    env = {name: value for name, value in os.environ.items() if name != "WANDB_SERVICE"}
    run = subprocess.run(
        [sys.executable, "-c", _KILL_WANDB_MIDWAY, str(tmp_path)],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == 0 and "the run went on" in run.stdout, run.stderr[-3000:]
    assert run.stderr.count("warning: W&B logging failed (") == 1, run.stderr[-3000:]
    assert "and is off for the rest of the run; metrics.jsonl holds every record" in run.stderr
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [(r["phase"], r["step"]) for r in map(json.loads, lines)] == [("rl", 1), ("rl", 2), ("alarm", 3)]


def test_a_wandb_login_that_cannot_work_stops_the_job_before_the_model_loads(tmp_path, capsys):
    model = tmp_path / "not-built"  # the tiny model would be built there
    assert (
        main(
            [
                f"model.path={model}",
                "model.build_if_missing=true",
                f"logging.output_dir={tmp_path}",
                "logging.wandb=online",
                "reward.replicas=1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "logging.wandb=online: W&B did not start (No API key configured. Use `wandb login` to log in.): run "
        "`wandb login` or set WANDB_API_KEY, or use logging.wandb=offline" in err
    ), err[-2000:]
    assert not model.exists()
    assert not [p for p in tmp_path.iterdir() if p.name != "wandb-home"]  # no run folder left behind


def test_videos_go_to_wandb_as_videos(tmp_path):
    """A video model's evaluation grid and rollout samples ([N, F, C, H, W]) are W&B videos (animated GIFs: no
    encoder package needed), in an offline run."""
    import torch

    from trainer.logging import RunLogger
    from trainer.trackers import WandbTracker

    videos = torch.rand(2, 3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with WandbTracker(tmp_path, "offline", "rf-test", "", {}) as tracker:
        logger = RunLogger(tmp_path, enabled=True, tensorboard=False, trackers=[tracker])
        logger.image_grid("eval_0001", videos, rows=2, step=1, prompts=["a", "b"])
        logger.rollout_samples(1, videos, ["a", "b"], [0.5, 0.25], {"s": [0.5, 0.25]})
        logger.close()
    ((_, rows),) = _wandb_runs(tmp_path)
    (grid,) = [row for row in rows if "eval/samples/caption" in row]
    assert grid["eval/samples/_type"] == "video-file" and grid["eval/samples/path"].endswith(".gif")
    (samples,) = [row for row in rows if "rollouts/samples/captions" in row]
    assert samples["rollouts/samples/_type"] == "videos" and samples["rollouts/samples/count"] == 2, samples
