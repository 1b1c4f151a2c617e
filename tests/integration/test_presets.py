"""Every shipped config (configs/**/*.yaml, presets added later included) builds, samples and runs a job.

Each YAML is loaded through ``load_config`` with overrides that swap in a tiny model of the same adapter
(``tests/tiny_models``: ``tiny_config``, built once per test run) and a tiny dataset in the config's data
format (``tests/tiny_data.py``: ``tiny_dataset``); the rest of the file (algorithm, sampler, LoRA, dtype,
rewards) is used as written. The adapter, algorithm and task are built with the functions the job uses,
its trainable weights must be ones its backend can update (float32 unless DeepSpeed keeps master copies),
and one prompt group (up to ``MAX_GROUP`` samples) is sampled with the config's sampler settings and the
task's image inputs. A config that names an unregistered algorithm, model or dataset fails here. A second
test runs each config's whole job (``Trainer.fit``) at toy size and resumes it from a checkpoint, requiring
the straight run's numbers (the algorithm configs' and repeated settings' in the slow tier); a third runs the
job of every algorithm config with every registered adapter. The presets' headers, data paths and test
splits are test_preset_headers.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch
import yaml
from once_per_run import once_per_run
from tiny_data import tiny_dataset
from tiny_models import tiny, tiny_config, tiny_ip_adapter

from reward_server.inprocess import InProcessRewardClient
from reward_server.scorers.brightness import BrightnessScorer
from trainer.algorithms import build_algorithm
from trainer.algorithms.sft import SFT
from trainer.config import load_config
from trainer.data import build_task, build_tasks
from trainer.distributed import SingleProcess
from trainer.distributed.backend import refuse_low_precision_updates
from trainer.logging import RunLogger
from trainer.models import MODELS, build_adapter
from trainer.rollout import rollout
from trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("**/*.yaml"))
PRESETS = [p for p in CONFIGS if p.parent.name == "presets"]
ALGORITHM_CONFIGS = sorted(p.stem for p in (REPO / "configs" / "algorithms").glob("*.yaml"))
MAX_GROUP = 4
"""Samples of the one prompt group drawn per config (fewer than large groups: the batch size is not what
differs between configs, the sampler, guidance and image inputs are)."""
KEPT_MODEL_FIELDS = ("name", "dtype", "lora", "gradient_checkpointing", "ip_adapter")
"""Model fields taken from the file; the others come from the tiny model's config where it sets them."""


def _id(path: Path) -> str:
    return str(path.relative_to(REPO / "configs"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[pytest.TempPathFactory, Path, dict]:
    """(the factory, this worker's root, adapter name -> tiny config): each tiny model is built on first use, once
    per test run however many pytest-xdist workers use it (tests/once_per_run.py)."""
    return tmp_path_factory, tmp_path_factory.mktemp("preset-models"), {}


def _model_overrides(model: dict, tiny_models) -> list[str]:
    """The tiny model's path and sizes; with an IP-Adapter, a tiny image encoder and fresh IP weights."""
    factory, root, configs = tiny_models
    name = model["name"]
    if name not in configs:
        path = once_per_run(factory, f"preset-model-{name}", lambda folder: tiny_config(name, folder).path)
        configs[name] = tiny_config(name, Path(path).parent)
    tiny = configs[name]
    defaults = type(tiny)()
    overrides = [
        f"model.{f.name}={getattr(tiny, f.name)}"
        for f in dataclasses.fields(tiny)
        if f.name not in KEPT_MODEL_FIELDS
        and (f.name == "resolution" or getattr(tiny, f.name) != getattr(defaults, f.name))
    ]
    if model.get("ip_adapter"):
        encoder = tiny_ip_adapter(root).image_encoder
        overrides += [f"model.ip_adapter.image_encoder={encoder}", "model.ip_adapter.weights=null"]
    return overrides


def test_configs_are_found():
    assert len(PRESETS) >= 7 and REPO / "configs" / "embedded_digits.yaml" in CONFIGS


def _side(model) -> int:
    """The pixel side of the model's images (a video model's frame height; the tiny models' frames are square)."""
    return model.resolution or getattr(model, "height", 0) or 16


def _tiny_job(path: Path, tiny_models, tmp_path, extra: list[str] | None = None):
    """The config at ``path`` with its model swapped for the tiny one and its data for a tiny dataset of the
    same format (an absolute eval.path too: a placeholder for the user's data), plus ``extra`` overrides."""
    raw = yaml.safe_load(path.read_text())
    model = {"name": "tiny", **raw.get("model", {})}
    overrides = _model_overrides(model, tiny_models) if model["name"] in MODELS else []
    config = load_config(str(path), overrides)  # an unregistered algorithm or model fails here
    side = _side(config.model)
    data_path = tiny_dataset(config.data.name, tmp_path, side, Path(raw.get("data", {}).get("path", "")).suffix)
    if not config.eval.path:
        evaluated = []
    elif Path(config.eval.path).is_absolute():  # a placeholder for the user's test split: the tiny data again
        evaluated = [f"eval.path={data_path}", "eval.allow_overlap=true"]
    else:  # the preset's test split in the repository
        evaluated = [f"eval.path={REPO / config.eval.path}"]
    return load_config(
        str(path), [*overrides, f"data.path={data_path}", f"data.image_size={side}", *evaluated, *(extra or [])]
    )


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_config_builds_and_samples_one_group(path, tiny_models, tmp_path):
    config = _tiny_job(path, tiny_models, tmp_path)
    adapter = build_adapter(config.model, torch.device("cpu"))
    if config.parallel.backend not in ("zero2", "zero3"):  # these keep float32 master weights themselves
        refuse_low_precision_updates(list(adapter.trainable.parameters()), config.parallel.backend)
    algorithm = build_algorithm(config.algorithm)
    task = build_task(config.data)
    tree = config.algorithm.sampler.tree  # a tree's leaves are its group: sampled whole
    group = algorithm.group_size if tree else min(algorithm.group_size, MAX_GROUP)
    items = [0] * group
    inputs = task.inputs(items)
    ro = rollout(
        adapter,
        adapter.denoiser,
        [task.prompts[0]] * group,
        torch.zeros(group, dtype=torch.long),
        algorithm.sampler,
        torch.Generator().manual_seed(0),
        inputs,
    )

    steps = len(ro.sigmas) - 1  # fewer than sampler.num_steps where MixGRPO-Flash compresses those after its window
    assert steps == algorithm.sampler.num_steps or (
        algorithm.sampler.ode_compress < 1 and steps < algorithm.sampler.num_steps
    )
    assert ro.log_probs.shape == (group, steps) and torch.isfinite(ro.log_probs).all()
    one_image = adapter.decode(torch.zeros(1, *adapter.latent_shape)).shape[1:]  # the model's image size
    assert ro.images.shape == (group, *one_image) and torch.isfinite(ro.images).all()
    assert ro.images.min() >= 0 and ro.images.max() <= 1
    if inputs is not None:  # generated at the size of the task's image inputs
        assert all(t.shape[-2:] == one_image[-2:] for t in vars(inputs).values() if t is not None)
    assert len(task.item_metadata(items)) == group


ONE_EPOCH = [
    "train.epochs=1",
    "algorithm.group_size=2",
    "data.prompts_per_epoch=2",
    "train.rollout_chunks=2",
    "reward.batch_size=2",
    "algorithm.micro_batch_size=2",
    "algorithm.sampler.num_steps=4",
    "eval.num_steps=2",
    "eval.samples_per_prompt=1",
    "eval.prompts=1",
    "warmup.batch_size=4",
    "warmup.micro_batch_size=2",
]
"""A whole job at toy size: 2 prompts x 2 samples sampled in 2 chunks of 2 (Qwen-Image's chunks pad their text
to different lengths when a chunk draws only the shorter prompt, as one does here; groups of 2 sample half of
what groups of 4 did, through the same code), 4 sampling steps, micro-batches of 2; warm-up steps of 4 images in
micro-batches of 2 (64 took most of a job's time); one evaluation prompt (its rollouts were a third of a job's
time)."""


def _trainer(config, run_dir: Path) -> tuple[Trainer, list[torch.Tensor], InProcessRewardClient]:
    """The Trainer of ``config`` with the in-process ``brightness`` scorer standing in for its reward servers under
    their scorers' names (a task whose metrics read a scorer, the words task's ``ocr``, finds its scores), the model
    built as ``trainer.build`` builds it; returns it, the trainable weights as built and the client to close."""
    torch.manual_seed(config.train.seed)  # LoRA's initial weights
    adapter = build_adapter(config.model, torch.device("cpu"))
    built = [p.detach().clone() for p in adapter.trainable.parameters()]
    scorer = BrightnessScorer()
    names = list(config.reward.weights) or [scorer.name]
    client = InProcessRewardClient(
        {name: scorer for name in names}, dict.fromkeys(names, 1.0), batch_size=config.reward.batch_size
    )
    task, evaluated = build_tasks(config.data, config.eval)
    trainer = Trainer(
        config,
        adapter,
        build_algorithm(config.algorithm),
        SFT(config.warmup),
        task,
        client,
        SingleProcess(torch.device("cpu")),
        RunLogger(run_dir, False, False),
        eval_task=evaluated,
    )
    return trainer, built, client


def _run(config, run_dir: Path, resume: Path | None = None) -> tuple[Trainer, list[torch.Tensor]]:
    """``Trainer.fit`` of ``config`` (continuing from checkpoint ``resume``) as ``_trainer`` builds it; returns the
    trainer and the trainable weights as built."""
    trainer, built, client = _trainer(config, run_dir)
    try:
        if resume is not None:
            trainer.resume(resume)
        trainer.fit()
    finally:
        client.close()
    return trainer, built


def _records(trainer: Trainer, phase: str) -> list[dict]:
    return [r for r in trainer.logger.history if r["phase"] == phase]


def _check_fit(trainer: Trainer, built: list[torch.Tensor], epochs: int) -> None:
    """A whole job's outcome: its ``epochs`` run, the trainable weights moved and the final metrics finite."""
    (final,) = _records(trainer, "final")
    assert trainer.progress.epochs_done == epochs and math.isfinite(final["reward_mean"])
    moved = [not torch.equal(b, p) for b, p in zip(built, trainer.adapter.trainable.parameters(), strict=True)]
    assert any(moved), "no trainable weight moved"


def _fit(config, tmp_path) -> None:
    """``_run`` of ``config``, checked by ``_check_fit``."""
    _check_fit(*_run(config, tmp_path / "run"), config.train.epochs)


def _rl_epoch(config, tmp_path) -> None:
    """The Trainer's warm-up steps and first RL epoch (``warmup_step``, ``begin_rl``, ``rl_epoch``) without
    ``fit``'s evaluations and checkpoints: the trainable weights must move and the epoch's rewards be finite."""
    trainer, built, client = _trainer(config, tmp_path / "run")
    train = config.train
    try:
        trainer.backend.set_lr(train.warmup_learning_rate)
        for step in range(train.warmup_steps):
            trainer.warmup_step(step)
        trainer.begin_rl()
        trainer.backend.set_lr(train.learning_rate)
        metrics = trainer.rl_epoch(0)
    finally:
        client.close()
    assert math.isfinite(metrics["reward_mean"])
    moved = [not torch.equal(b, p) for b, p in zip(built, trainer.adapter.trainable.parameters(), strict=True)]
    assert any(moved), "no trainable weight moved"


def _one_epoch(config) -> list[str]:
    """``ONE_EPOCH``, one warm-up step where ``config`` warms up (its captions misnamed from it, where they are), an
    SDE window that fits 4 steps where it sets one, and a tree of 4 leaves (a group of 4) where it sets one."""
    extra = list(ONE_EPOCH)
    if config.train.warmup_steps > 0:
        extra.append("train.warmup_steps=1")
        if config.data.misnamed_share:  # the video task's misnamed captions, from the one step
            extra.append("data.misnamed_from=0")
    if config.algorithm.sampler.sde_window > 0:
        extra += ["algorithm.sampler.sde_window=2", "algorithm.sampler.window_range=[0,2]"]
    if config.algorithm.sampler.tree:
        extra += ["algorithm.group_size=4", "algorithm.sampler.tree=[2,2]", "algorithm.sampler.tree_steps=[0,1]"]
    return extra


def _settings(path: Path) -> str:
    """The config's settings other than its model's name, path and sizes (the tiny model's replace them: only
    ``KEPT_MODEL_FIELDS`` stay), its data (eval.path too) and its rewards."""
    raw = yaml.safe_load(path.read_text())
    model = {k: v for k, v in raw.get("model", {}).items() if k in KEPT_MODEL_FIELDS and k != "name"}
    evaluation = {k: v for k, v in raw.get("eval", {}).items() if k != "path"}
    return repr(sorted({**raw, "model": model, "data": None, "eval": evaluation, "reward": None}.items()))


def _whole_jobs() -> list:
    """Every config; in the slow tier, the algorithm configs' jobs (the tiny model's: test_algorithms.py trains
    and resumes every algorithm exactly on it in the default tier) and a preset whose settings repeat an earlier
    one's but for its model, data and rewards (four Qwen-Image variants repeat FLUX.2 Klein inpainting's, ~200 s
    on 2 AVX2 cores, and one SD3 preset another's). Each adapter's job on its data format, its half-precision
    suite and every preset's build stay in the default tier (test_every_adapter_runs_a_job_of_every_algorithm,
    the conformance suite, test_config_builds_and_samples_one_group)."""
    seen: set[str] = set()
    jobs = []
    for path in CONFIGS:
        settings = _settings(path)
        repeated = settings in seen
        seen.add(settings)
        slow = repeated or path.parent.name == "algorithms"
        jobs.append(pytest.param(path, marks=pytest.mark.slow) if slow else path)
    return jobs


WHOLE_JOBS = _whole_jobs()


@pytest.mark.parametrize("path", WHOLE_JOBS, ids=_id)
def test_config_runs_a_whole_job_and_resumes_exactly(path, tiny_models, tmp_path, capsys):
    """``Trainer.fit`` of every shipped config on its tiny model: one warm-up step where the config warms up,
    the evaluation before, two RL epochs of the config's algorithm with its sampler, a checkpoint after each,
    the evaluation after. Resumed from the first checkpoint, the second epoch and the final evaluation repeat
    the straight run's exactly (whatever state its model, algorithm and reference keep: LoRA, IP-Adapter
    snapshots, critics, EMA), and the resume finds no setting changed."""
    two = [
        *_one_epoch(_tiny_job(path, tiny_models, tmp_path)),
        "train.epochs=2",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=0",
        "eval.every=0",
    ]
    straight, built = _run(_tiny_job(path, tiny_models, tmp_path, two), tmp_path / "straight")
    _check_fit(straight, built, 2)
    first = next(p for p in straight.checkpoints.directory.iterdir() if p.name.endswith("-000001"))
    capsys.readouterr()
    resumed, _ = _run(_tiny_job(path, tiny_models, tmp_path, two), tmp_path / "resumed", resume=first)
    out = capsys.readouterr().out
    assert "resumed from" in out and "warning" not in out
    for phase in ("rl", "final"):
        want, got = _records(straight, phase)[-1], _records(resumed, phase)[-1]
        assert want["step"] == got["step"] == 2
        timings = {k for k in want if k.endswith(("_s", "per_s")) or k == "time"}
        assert {k: v for k, v in got.items() if k not in timings} == {
            k: v for k, v in want.items() if k not in timings
        }, phase


@pytest.mark.parametrize("preset", ["flux_fill_grpo_ocr", "sd15_inpaint_dpo"])
def test_images_of_another_size_than_the_model_generates_are_refused_before_training(preset, tiny_models, tmp_path):
    """An inpainting job whose dataset gives images of another size than ``model.resolution``: the job stops as
    the trainer is built, and the message names the setting to change."""
    path = REPO / "configs" / "presets" / f"{preset}.yaml"
    side = _tiny_job(path, tiny_models, tmp_path).model.resolution
    config = _tiny_job(path, tiny_models, tmp_path, [f"data.image_size={2 * side}"])
    with pytest.raises(
        ValueError, match=rf"is \({2 * side}, {2 * side}\) pixels; .* set data.image_size to model.resolution"
    ):
        _run(config, tmp_path / "run")


def _adapter_algorithm_pairs() -> list:
    """Every (adapter, algorithm config, whole job) triple. The default tier runs each adapter other than the tiny
    model with one algorithm (each algorithm once among them, while there are as many adapters), as a whole job;
    the other pairs are in the slow tier, the tiny model's too (its job of every algorithm config is
    test_config_runs_a_whole_job_and_resumes_exactly's: configs/algorithms name no model), as one RL epoch without
    the job's evaluations and checkpoints (each adapter's are its default pair's)."""
    others = [name for name in sorted(MODELS) if name != "tiny"]
    default = {(name, ALGORITHM_CONFIGS[i % len(ALGORITHM_CONFIGS)]) for i, name in enumerate(others)}
    return [
        pytest.param(name, algorithm, whole, marks=() if whole else pytest.mark.slow, id=f"{name}-{algorithm}")
        for name, algorithm in itertools.product(sorted(MODELS), ALGORITHM_CONFIGS)
        for whole in [(name, algorithm) in default]
    ]


@pytest.mark.parametrize(("name", "algorithm", "whole"), _adapter_algorithm_pairs())
def test_every_adapter_runs_a_job_of_every_algorithm(name, algorithm, whole, tiny_models, tmp_path):
    """Each algorithm's config (configs/algorithms) with each registered adapter's tiny model, float32 and
    fully fine-tuned, on the data format the model takes: the trainer and the algorithms never ask which model
    they run. A warm-up step where the data has images to learn from (a prompt file has none). The epoch samples
    in one chunk (a fifth less time): chunked rollouts are each algorithm's in the whole-job test above and each
    adapter's in the conformance suite. ``whole``: the whole job (``Trainer.fit``), else its warm-up step and RL
    epoch alone (``_rl_epoch``)."""
    path = REPO / "configs" / "algorithms" / f"{algorithm}.yaml"
    data = tiny(name).data
    model = [f"model.name={name}", *_model_overrides({"name": name}, tiny_models), "model.dtype=float32"]
    config = load_config(str(path), model)
    side = _side(config.model)
    task = [f"data.name={data}", f"data.path={tiny_dataset(data, tmp_path, side)}", f"data.image_size={side}"]
    if tiny(name).inputs:  # the file's images the model takes (image to video: its first frame, no mask)
        task.append(f"data.image_inputs=[{','.join(tiny(name).inputs)}]")
    video = MODELS[name].load().modality == "video"  # the data's images are its first frames, not clips to learn
    overrides = [*model, *task, *_one_epoch(config), "train.rollout_chunks=1"] + (
        ["train.warmup_steps=0"] if data == "prompt_file" or video else []
    )
    if not whole:  # one group, one noise draw where the algorithm averages several: the same steps, fewer samples
        overrides += ["data.prompts_per_epoch=1"] + (
            ["algorithm.noise_draws=1"] if hasattr(config.algorithm, "noise_draws") else []
        )
    config = load_config(str(path), overrides)
    run = _fit if whole else _rl_epoch
    if hasattr(config.algorithm, "scorer"):  # refl, draft, drtune: a differentiable reward any data's images have
        config = load_config(str(path), [*overrides, "reward.weights={brightness: 1.0}", "algorithm.scorer=brightness"])
        if MODELS[name].load().sampler_kind != "flow":
            with pytest.raises(ValueError, match="needs a flow model"):
                run(config, tmp_path)
            return
    sampler = config.algorithm.sampler
    if MODELS[name].load().sampler_kind != "flow" and (sampler.ode_order, sampler.ode_compress) != (1, 1):
        with pytest.raises(ValueError, match="need a flow model"):  # MixGRPO-Flash's steps are flow steps
            run(config, tmp_path)
        return
    run(config, tmp_path)


def test_a_step_kind_the_model_has_no_math_for_is_refused_as_the_trainer_is_built(tiny_models, tmp_path):
    """The DDIM step on a flow model: refused before the warm-up and the first evaluation run (the first rollout
    used to find out, hours into a job)."""
    config = load_config(overrides=[*_model_overrides({"name": "tiny"}, tiny_models), "algorithm.sampler.kind=ddim"])
    adapter = build_adapter(config.model, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"sampler\.kind='ddim' is not one of"):
        Trainer(
            config,
            adapter,
            build_algorithm(config.algorithm),
            SFT(config.warmup),
            build_task(config.data),
            None,
            SingleProcess(torch.device("cpu")),
            RunLogger(tmp_path, False, False),
        )
    # a DDIM eta above 1 (a negative variance: NaN rollouts) likewise
    config = load_config(
        overrides=[
            "model.name=sd15_inpaint",
            *_model_overrides({"name": "sd15_inpaint"}, tiny_models),
            "algorithm.sampler.noise_level=1.5",
        ]
    )
    adapter = build_adapter(config.model, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"algorithm\.sampler\.noise_level"):
        Trainer(
            config,
            adapter,
            build_algorithm(config.algorithm),
            SFT(config.warmup),
            None,
            None,
            SingleProcess(torch.device("cpu")),
            RunLogger(tmp_path, False, False),
        )


def test_a_resume_with_other_settings_names_them(tiny_models, tmp_path, capsys):
    """A checkpoint resumed with another learning rate and group size: the warning names both (with the old and
    new values), and not what a resume may change without changing the computation (more epochs, paths)."""
    path = REPO / "configs" / "embedded_digits.yaml"
    one = [*_one_epoch(_tiny_job(path, tiny_models, tmp_path)), "train.checkpoint_every=1"]
    first, _ = _run(_tiny_job(path, tiny_models, tmp_path, one), tmp_path / "first")
    (checkpoint,) = first.checkpoints.directory.iterdir()
    capsys.readouterr()
    _run(
        _tiny_job(
            path, tiny_models, tmp_path, [*one, "train.epochs=2", "train.learning_rate=1e-3", "algorithm.group_size=4"]
        ),
        tmp_path / "second",
        resume=checkpoint,
    )
    out = capsys.readouterr().out
    (warning,) = [line for line in out.splitlines() if line.startswith("warning: resuming")]
    assert "algorithm.group_size: 2 -> 4" in warning and "train.learning_rate: 0.0003 -> 0.001" in warning
    assert "train.epochs" not in warning and "logging" not in warning
