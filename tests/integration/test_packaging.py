"""A non-editable install (``pip install .``) ships the data files the code reads at run time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_ships_the_deepspeed_templates_and_zero_reads_them_from_the_install(tmp_path):
    """parallel.backend=zero2/zero3 read their templates from <checkout>/deploy/deepspeed, which an installed
    package does not have: the install failed with "DeepSpeed config ... not found"."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("trainer", "reward_server", "shared"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("rewardflow-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "installed")
    assert {
        "trainer/distributed/deepspeed_configs/zero2.json",
        "trainer/distributed/deepspeed_configs/zero3.json",
        "reward_server/static/debug.html",
    } <= names

    installed = str(tmp_path / "installed")
    reads = (
        "from trainer.distributed import zero\n"
        "import torch, json\n"
        f"assert zero.__file__.startswith({installed!r}), zero.__file__\n"
        "for stage in (2, 3):\n"
        "    config = zero.deepspeed_config(stage, '', max_grad_norm=1.0, param_dtype=torch.bfloat16,\n"
        "                                   reduce_dtype=torch.float32, cpu_offload=False)\n"
        "    print(json.dumps(config['zero_optimization']['stage']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", reads],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": installed},
    )
    assert run.returncode == 0, run.stderr
    assert [json.loads(line) for line in run.stdout.split()] == [2, 3]


def test_deploy_deepspeed_shows_the_packaged_templates():
    """Users looking in deploy/deepspeed find the templates the trainer uses (links, not copies to keep in step)."""
    packaged = REPO / "trainer" / "distributed" / "deepspeed_configs"
    for stage in (2, 3):
        linked = REPO / "deploy" / "deepspeed" / f"zero{stage}.json"
        assert linked.resolve() == (packaged / f"zero{stage}.json").resolve()
