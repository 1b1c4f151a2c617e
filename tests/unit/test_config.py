"""Typed config: defaults, YAML + overrides, and errors that name the field."""

from __future__ import annotations

import ast
import dataclasses
import logging
import math
import re
import typing
from pathlib import Path

import pytest
import yaml

from trainer.algorithms import ALGORITHMS
from trainer.config import Config, ConfigError, load_config, reward_token, saved_dict
from trainer.config.fields import Bounds
from trainer.main import main
from trainer.models import MODELS
from trainer.models.sd3 import SD3Config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_the_embedded_job():
    config = load_config()
    assert config.model.name == "tiny" and config.algorithm.name == "grpo"
    assert config.algorithm.sampler.sde_window == 2 and config.reward.weights == {"digit": 1.0}


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: sd3\n  path: /weights/sd3\n  lora: {rank: 8}\ntrain:\n  epochs: 3\n")
    config = load_config(str(path), ["train.epochs=5", "algorithm.sampler.kind=cps", "reward.urls=[http://h:1]"])
    assert isinstance(config.model, SD3Config) and config.model.path == "/weights/sd3"
    assert config.model.lora.rank == 8 and config.model.lora.alpha == 64
    assert config.train.epochs == 5 and config.algorithm.sampler.kind == "cps"
    assert config.reward.urls == ["http://h:1"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.epoch=3", "unknown config key train.epoch; valid keys here: "),
        ("train.epochs=three", "train.epochs: expected an integer, got 'three'"),
        ("model.name=nope", "model.name='nope' is not registered"),
        ("parallel.backend=mpi", "parallel.backend: 'mpi' is not one of"),
        ("algorithm.group_size=1", "algorithm.group_size must be >= 2"),
        ("algorithm.timestep_fraction=0", "algorithm.timestep_fraction=0.0 must be in (0, 1]"),
        ("train.rollout_chunks=-1", "train.rollout_chunks=-1 must be >= 0"),
        ("train.learning_rate=.nan", "train.learning_rate=nan must be >= 0"),
        ("reward.weights={digit: .inf}", "reward.weights.digit=inf must be a finite number"),
        ("train.adam_betas=[0.9, 1.0]", "train.adam_betas[1]=1.0 must be in [0, 1)"),
        ("algorithm.clip_range=.inf", None),
        (
            "algorithm.sampler.kind=sdee",
            "algorithm.sampler: kind='sdee' is not one of auto, cps, cps_mse, ddim, eta, sde",
        ),
        (
            "algorithm.sampler.window_range=[0, 9]",
            "algorithm.sampler: window_range=(0, 9) does not fit num_steps=10 with sde_window=2",
        ),
        ("train.seed=-1", "train.seed=-1 must be in [0, 9.22337e+18]"),
        ("eval.seed=99999999999999999999", "eval.seed=99999999999999999999 must be in [0, 9.22337e+18]"),
        ("train.epochs=" + "9" * 400, None),  # checked without a float conversion, which overflowed
        ("train", "must look like section.key=value"),
        ("train.epochs.x=1", "train.epochs is not a section"),
        (
            "data.name=nosuch",
            "data.name='nosuch' is not registered; choose one of: digits,",
        ),  # was after the model loaded
        ("reward.weights={}", "reward.weights={} gives no scorer a weight"),
        ("reward.weights={digit: 0}", "reward.weights={'digit': 0.0} gives no scorer a weight"),
        (
            "algorithm.sampler.noise_level=0",
            "noise_level=0 samples every step deterministically: a policy gradient "
            "then has no log-probability to train",
        ),  # was a run that trained nothing
        ("reward.model_dir=/nonexistent", "reward.model_dir='/nonexistent': no such folder"),
        ("logging.run_name=../escape", "logging.run_name='../escape' must be a plain folder name"),  # wrote outside
        ("reward.weights={digit:1}", "YAML needs a space after the colon: {digit: 1}, not {digit:1}"),  # was 'got None'
        (
            "reward.weights={digit:",
            "not valid YAML (quote the whole override for the shell: 'section.key={a: 1, b: 2}')",
        ),
        # each was a message naming the wrong fix: a range [0, -6) of window starts, the server command for port 80
        (
            "algorithm.sampler.sde_window=10",
            "sde_window=10 must be less than num_steps=10 (the last step is never "
            "trained): lower sde_window or raise num_steps",
        ),
        ("reward.urls=[localhost:8000]", "reward: urls: 'localhost:8000' has no scheme: write http://localhost:8000"),
    ],
)
def test_bad_keys_and_values_name_the_field(override, message):
    if message is None:  # in range (an unclipped ratio; a huge epoch count)
        load_config(overrides=[override])
        return
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert message in str(info.value)


def _bounded_fields(cls: type, path: str) -> typing.Iterator[tuple[str, type, Bounds]]:
    """(path, int or float, bounds) of every range-checked field of ``cls``, nested sections included."""
    hints = typing.get_type_hints(cls, include_extras=True)
    for field in dataclasses.fields(cls):
        tp, where = hints[field.name], f"{path}.{field.name}"
        if typing.get_origin(tp) is typing.Annotated:
            base, *meta = typing.get_args(tp)
            yield from ((where, base, m) for m in meta if isinstance(m, Bounds))
        for arg in (tp, *typing.get_args(tp)):  # a section, possibly optional (model.lora, model.ip_adapter)
            if dataclasses.is_dataclass(arg):
                yield from _bounded_fields(arg, where)


def _outside(bounds: Bounds, base: type) -> list:
    """Values just outside ``bounds`` (and NaN for floats)."""
    values = [math.nan] if base is float else []
    if bounds.low is not None:
        values.append(bounds.low if bounds.low_open else bounds.low - 1)
    if bounds.high is not None and bounds.high != math.inf:
        values.append(bounds.high if bounds.high_open else bounds.high + 1)
    if bounds.high is None and base is float:
        values.append(math.inf)
    return values


SECTIONS = (
    [("model", f"model.name={name}", MODELS[name].config_class) for name in sorted(MODELS)]
    + [("algorithm", f"algorithm.name={name}", ALGORITHMS[name].config_class) for name in sorted(ALGORITHMS)]
    + [
        (name, None, cls)
        for name, cls in typing.get_type_hints(Config).items()
        if name not in ("model", "algorithm") and any(_bounded_fields(cls, name))
    ]
)
OPTIONAL_SECTIONS = {"model.lora": "", "model.ip_adapter": ", image_encoder: /enc"}
"""Sections that are None by default, written whole: (path, what else they need)."""


@pytest.mark.parametrize("section, select, cls", SECTIONS, ids=[s[1] or s[0] for s in SECTIONS])
def test_every_out_of_range_value_is_refused_naming_its_field(section, select, cls):
    """Each range-checked field of every section (each registered model's and algorithm's included), set just
    outside its range (or NaN, or infinite), is refused as the config is read, by a message naming it: such
    values otherwise failed deep inside a run (an AssertionError for a chunk count of 0, IndexError for
    eval.samples_per_prompt=0) or ran silently (a negative warm-up learning rate)."""
    fields = list(_bounded_fields(cls, section))
    assert fields, f"{section} has no range-checked field"
    for path, base, bounds in fields:
        leaf = path.rsplit(".", 1)[-1]
        if leaf == "adam_betas" or leaf == "window_range":
            continue  # tuples: covered by the parametrized cases above
        parent = path.rsplit(".", 1)[0]
        for value in _outside(bounds, base):
            written = ".nan" if math.isnan(value) else {math.inf: ".inf"}.get(value, value)
            override = (
                f"{parent}={{{leaf}: {written}{OPTIONAL_SECTIONS[parent]}}}"
                if parent in OPTIONAL_SECTIONS
                else f"{path}={written}"
            )
            with pytest.raises(ConfigError, match=rf"^{re.escape(path)}={re.escape(repr(base(value)))} must be "):
                load_config(overrides=[select, override] if select else [override])


def test_every_shipped_config_file_loads():
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert files, "configs/ should ship presets"
    for path in files:
        assert isinstance(load_config(str(path)), Config), path


def test_imported_class_attributes_resolve_when_read_and_once():
    from collections import OrderedDict

    from trainer.models.common import Imported

    made = []

    class Holder:
        one = Imported("collections:OrderedDict")
        several = Imported(("collections:OrderedDict", "pathlib:Path"))
        named = Imported({"a": "pathlib:Path", "b": lambda: made.append(1) or dict})

    assert made == [] and Holder.one is OrderedDict and Holder().several == (OrderedDict, Path)
    assert Holder.named == {"a": Path, "b": dict} and Holder().named["b"] is dict and made == [1]
    assert MODELS["sd3"].load().pipeline_class.__name__ == "StableDiffusion3Pipeline"


def test_switching_model_by_override_takes_the_new_model_defaults():
    config = load_config(overrides=["model.name=qwen_image", "model.path=/w/qwen"])
    assert config.model.name == "qwen_image" and config.model.path == "/w/qwen"
    assert config.model.dtype == "bfloat16" and config.model.resolution == 1024
    assert config.model.max_sequence_length == 512


def test_the_embedded_preset_is_the_default():
    assert load_config(str(REPO / "configs" / "embedded_digits.yaml")) == load_config()


def test_config_files_merge_in_order_and_the_cli_takes_several(capsys):
    """A model preset, then an algorithm preset (README): a second ``--config`` used to replace the first."""
    model, algorithm = REPO / "configs/presets/sd3_grpo_ocr.yaml", REPO / "configs/algorithms/nft.yaml"
    config = load_config([str(model), str(algorithm)])
    assert config.model.name == "sd3" and config.model == load_config(str(model)).model
    assert config.algorithm.name == "nft" and config.algorithm.noise_draws == 4
    assert main(["--config", str(model), "--config", str(algorithm), "--show-config"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["model"]["name"] == "sd3" and shown["algorithm"]["name"] == "nft"


def test_the_reward_token_comes_from_the_environment_and_is_never_saved(monkeypatch, capsys):
    monkeypatch.delenv("REWARD_SERVER_TOKEN", raising=False)
    assert reward_token(load_config().reward) is None
    monkeypatch.setenv("REWARD_SERVER_TOKEN", "from-shell")
    assert reward_token(load_config().reward) == "from-shell"
    given = load_config(overrides=["reward.token=s3cret"])
    assert reward_token(given.reward) == "s3cret"
    assert saved_dict(given)["reward"]["token"] is None and given.reward.token == "s3cret"
    assert main(["--show-config", "reward.token=s3cret"]) == 0
    shown = capsys.readouterr().out
    assert "s3cret" not in shown and "token: null" in shown


def test_a_section_naming_its_class_starts_from_its_defaults(tmp_path):
    """GRPO presets inherited the embedded job's 2-step SDE window (sd3_grpo_ocr trained 2 of its 10 steps), and a
    DPO preset giving only some sampler fields got SamplerSettings' noise 0.7 instead of DPO's deterministic
    default: a named section now starts from its class, and a partial nested section from the field's default."""
    grpo = tmp_path / "grpo.yaml"
    grpo.write_text("algorithm: {name: grpo, group_size: 4}\n")
    assert load_config(str(grpo)).algorithm.sampler == ALGORITHMS["grpo"].config_class().sampler
    assert load_config().algorithm.sampler.sde_window == 2  # the embedded job keeps its window
    dpo = tmp_path / "dpo.yaml"
    dpo.write_text("algorithm: {name: dpo, sampler: {num_steps: 20}}\n")
    sampler = load_config(str(dpo)).algorithm.sampler
    assert (sampler.num_steps, sampler.noise_level) == (20, 0.0)
    preset = load_config(str(REPO / "configs/presets/sd15_inpaint_dpo.yaml")).algorithm.sampler
    assert preset.noise_level == 0.0  # its header: deterministic DDIM
    ocr = load_config(str(REPO / "configs/presets/sd3_grpo_ocr.yaml")).algorithm
    assert ocr.sampler.sde_window == 0 and ocr.timestep_fraction == 0.99  # every step trainable, as Flow-GRPO


def test_overrides_naming_a_class_apply_first_and_text_fields_take_the_text_as_written():
    assert load_config(overrides=["algorithm.group_size=4", "algorithm.name=dpo"]).algorithm.group_size == 4
    assert load_config(overrides=["model.path=/w/sd3", "model.name=sd3"]).model.path == "/w/sd3"
    assert load_config(overrides=["algorithm.name=grpo"]).algorithm.sampler.sde_window == 2  # the same class: kept
    config = load_config(
        overrides=[
            "model.name=sd3",
            "model.negative_prompt=low quality, #watermark",
            "logging.run_name=2024-06-01",
            "reward.token=null",
            "train.epochs=3",
        ]
    )
    assert config.model.negative_prompt == "low quality, #watermark"  # YAML cut it at the '#'
    assert config.logging.run_name == "2024-06-01"  # YAML read a date, then refused it
    assert config.reward.token is None and config.train.epochs == 3
    assert load_config(overrides=["logging.run_name='01'"]).logging.run_name == "01"


def test_a_later_file_updates_an_optional_section_field_by_field(tmp_path):
    """model.ip_adapter and model.lora default to None, so a second file's partial block replaced the first's."""
    scale = tmp_path / "scale.yaml"
    scale.write_text("model: {ip_adapter: {scale: 0.5}}\n")
    preset = str(REPO / "configs/presets/flux_fill_ip_adapter_grpo.yaml")
    merged = load_config([preset, str(scale)]).model.ip_adapter
    assert merged.scale == 0.5 and merged.image_encoder == load_config(preset).model.ip_adapter.image_encoder


def test_an_empty_yaml_section_changes_nothing_and_null_still_turns_lora_off(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("eval:\n  # nothing changed yet\ntrain:\n  epochs: 3\nmodel:\n  lora:\n")
    config = load_config(str(path))
    assert config.eval == load_config().eval and config.train.epochs == 3
    lora = tmp_path / "lora.yaml"
    lora.write_text("model: {lora: {rank: 4}}\n")
    assert load_config(str(lora)).model.lora.rank == 4 and load_config([str(lora), str(path)]).model.lora is None


def test_a_later_file_naming_the_same_class_updates_it_and_name_overrides_may_be_quoted(tmp_path):
    """A local file naming the preset's model (to give its path) used to reset every other model field: the
    preset's LoRA, bf16 and 512 px silently became a full fine-tune in float32."""
    local = tmp_path / "local.yaml"
    local.write_text("model: {name: sd3, path: /my/sd3}\nalgorithm: {name: grpo, kl_beta: 0.1}\n")
    preset = str(REPO / "configs/presets/sd3_grpo_ocr.yaml")
    merged, alone = load_config([preset, str(local)]), load_config(preset)
    assert merged.model.path == "/my/sd3" and merged.model == dataclasses.replace(alone.model, path="/my/sd3")
    assert merged.algorithm == dataclasses.replace(alone.algorithm, kl_beta=0.1)
    assert load_config(overrides=["algorithm.name='dpo'"]).algorithm.name == "dpo"
    short = tmp_path / "short.yaml"
    short.write_text("algorithm: dpo\n")  # not a section: refused naming the file, not with a traceback
    with pytest.raises(ConfigError, match=r"algorithm must be a section of fields \(algorithm: \{name: dpo\}\)"):
        load_config(str(short), ["algorithm.name=grpo"])
    config = load_config(overrides=["model.name=sd3", "model.negative_prompt='low' and 'blurry'", "model.lora.rank=8"])
    assert config.model.negative_prompt == "'low' and 'blurry'"
    assert config.model.lora.rank == 8  # LoRA was off: its section starts from its defaults


def test_the_config_package_loads_its_names_on_first_use():
    """The algorithm, model and rollout configs import ``trainer.config.fields`` and the schema imports them, so
    the package's ``__init__`` and ``fields`` import no trainer module as they load (that would be a cycle), and
    every public name still resolves from ``trainer.config``."""
    import trainer.config

    for module in ("__init__", "fields"):
        tree = ast.parse((REPO / "trainer" / "config" / f"{module}.py").read_text())
        eager = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
        assert not [ast.unparse(n) for n in eager if "trainer" in ast.unparse(n)], module
    assert all(getattr(trainer.config, name) is not None for name in trainer.config.__all__)
    with pytest.raises(AttributeError):
        trainer.config.configuration  # noqa: B018


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("train.epoch=3", "did you mean train.epochs?"),
        ("trian.epochs=3", "did you mean train?"),
        ("algorithm.sampler.numsteps=4", "did you mean algorithm.sampler.num_steps?"),
        ("algorithm.name=gpro", "did you mean grpo?"),
        ("algorithm.name=GRPO", "did you mean grpo?"),
        ("model.name=SD3", "did you mean sd3?"),
        ("data.name=Digits", "did you mean digits?"),
    ],
)
def test_a_misspelt_key_or_name_gets_the_nearest_valid_one(override, suggestion):
    with pytest.raises(ConfigError, match=re.escape(suggestion)):
        load_config(overrides=[override])
    with pytest.raises(ConfigError) as far:
        load_config(overrides=["train.zzzzz=3"])
    assert "did you mean" not in str(far.value)


def test_show_config_describes_every_field_and_loads_back(tmp_path, capsys):
    """Each field's docstring is printed above it as a YAML comment; the output is still a --config file."""
    from trainer.config.describe import field_docs
    from trainer.config.schema import TrainConfig

    assert main(["--show-config", "model.lora={rank: 4}", "train.epochs=7"]) == 0
    shown = capsys.readouterr().out
    assert "  # RL epochs (rollout, reward, update); 0 runs only the warm-up.\n  epochs: 7\n" in shown
    assert "    # Adapter rank: capacity of the update" in shown  # a nested optional section's own fields
    assert "# How the trainer reaches the reward pool.\nreward:\n" in shown  # a section by its class docstring
    described = [line for line in shown.splitlines() if not line.lstrip().startswith("#")]
    commented = shown.splitlines()
    assert all(commented[commented.index(line) - 1].lstrip().startswith("#") for line in described)
    (tmp_path / "shown.yaml").write_text(shown)
    assert load_config(str(tmp_path / "shown.yaml")) == load_config(
        overrides=["model.lora={rank: 4}", "train.epochs=7"]
    )
    assert set(field_docs(TrainConfig)) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_a_config_path_that_is_a_folder_or_a_section_that_is_a_value_is_one_line_naming_the_file(tmp_path):
    """A run folder given as --config was an IsADirectoryError traceback; ``train: 5`` in a file was blamed on
    the command line's override (``train is not a section``)."""
    (tmp_path / "config.yaml").write_text("train: {epochs: 3}\n")
    with pytest.raises(
        ConfigError, match=f"^--config {tmp_path} is a directory: pass a YAML file, such as {tmp_path / 'config.yaml'}$"
    ):
        load_config(str(tmp_path))
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(bytes(range(256)))  # was a UnicodeDecodeError traceback
    with pytest.raises(ConfigError, match=f"^--config {binary}: not a text file \\(YAML is UTF-8 text\\)$"):
        load_config(str(binary))
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("train: 5\n")
    with pytest.raises(
        ConfigError,
        match=rf"^--config {scalar}: train must be a section of fields \(train: "
        r"\{key: value\}\), got 5$",
    ):
        load_config(str(scalar), ["train.warmup_steps=2"])


def test_reward_model_dir_is_for_the_jobs_own_replicas(tmp_path):
    with pytest.raises(ConfigError, match="is for the job's own replicas, but reward.urls names servers"):
        load_config(overrides=[f"reward.model_dir={tmp_path}", "reward.urls=[http://127.0.0.1:9]"])


def test_early_stop_without_evaluations_during_rl_is_refused():
    """It did nothing, silently: the evaluations it counts never ran."""
    with pytest.raises(ConfigError, match="train.early_stop=2 counts evaluations, but eval.every=0 runs none"):
        load_config(overrides=["train.early_stop=2", "eval.every=0"])


def test_a_single_step_rollout_under_a_policy_gradient_is_refused_as_the_config_is_read():
    """It was found after the warm-up: the last step, the only one, is never trained."""
    for name in ("grpo", "ppo"):
        with pytest.raises(ConfigError, match="algorithm.sampler.num_steps=1 leaves no trainable denoising step"):
            load_config(
                overrides=[f"algorithm.name={name}", "algorithm.sampler.num_steps=1", "algorithm.sampler.sde_window=0"]
            )
    load_config(overrides=["algorithm.sampler.num_steps=2", "algorithm.sampler.sde_window=0"])


def test_a_word_yaml_reads_as_a_boolean_is_shown_as_written(tmp_path):
    """``model.compile=yes`` was refused as ``True``: an override of a choice of words takes the word as written,
    and a file's unquoted ``off`` is refused saying how YAML read it."""
    with pytest.raises(ConfigError, match=r"model.compile: 'yes' is not one of 'none', 'blocks', 'full'"):
        load_config(overrides=["model.compile=yes"])
    assert load_config(overrides=["logging.wandb=none"]).logging.wandb == "none"
    path = tmp_path / "run.yaml"
    path.write_text("logging:\n  wandb: off\n")
    with pytest.raises(
        ConfigError,
        match=r"logging.wandb: False \(YAML reads an unquoted yes, no, on or off as a "
        r"boolean\) is not one of 'none', 'online', 'offline'",
    ):
        load_config(str(path))


def test_a_path_written_with_a_tilde_is_the_home_folders(tmp_path, monkeypatch):
    """A shell leaves ~ as written after key= (and in --config=~/x.yaml): logging.output_dir=~/runs made a folder
    named ~ in the checkout, data.path=~/p.txt was "no such file"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run.yaml").write_text("train: {epochs: 3}\n")
    config = load_config(
        "~/run.yaml", ["logging.output_dir=~/runs", "data.name=prompt_file", "data.path=~", "logging.run_name=a~b"]
    )
    assert config.train.epochs == 3 and config.logging.output_dir == f"{tmp_path}/runs"
    assert config.data.path == str(tmp_path) and config.logging.run_name == "a~b"  # only a leading ~ is the home


def test_the_tools_read_a_tilde_in_their_path_options(tmp_path, monkeypatch):
    from trainer.tool import user_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_path("~/best") == tmp_path / "best" and user_path("runs/~x") == Path("runs/~x")


@pytest.mark.parametrize("text", ["", "# model: {name: sd3}\n"])
def test_an_empty_config_file_is_refused_rather_than_running_the_embedded_job(tmp_path, text):
    """An empty file (a failed ``>`` redirect, an unsaved editor) used to run the embedded tiny job silently."""
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="mine.yaml: the file is empty .*leave --config off"):
        load_config(str(path))


def test_a_renamed_key_of_an_old_config_is_read_as_its_new_name_with_a_warning(tmp_path, caplog):
    """eval.guard_scorers became eval.alarm_scorers, and its metrics guard/<scorer> alarm/<scorer> (2026-12)."""
    old = tmp_path / "old.yaml"
    old.write_text("eval:\n  guard_scorers: [aesthetic]\ntrain:\n  select_by: guard/aesthetic\n")
    with caplog.at_level(logging.WARNING):
        config = load_config([str(old)])
        assert load_config(overrides=["eval.guard_scorers=[brightness]"]).eval.alarm_scorers == ["brightness"]
    assert config.eval.alarm_scorers == ["aesthetic"] and config.train.select_by == "alarm/aesthetic"
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert warnings[:2] == [
        "warning: train.select_by=guard/aesthetic is deprecated and read as alarm/aesthetic: rename it so",
        "warning: eval.guard_scorers is deprecated and read as eval.alarm_scorers: rename it so",
    ]
    with pytest.raises(ConfigError, match=r"^eval.guard_scorers is the old name of eval.alarm_scorers: give only "):
        load_config([str(old)], ["eval.alarm_scorers=[brightness]"])
    assert "guard_scorers" not in yaml.safe_load(yaml.safe_dump(saved_dict(config)))["eval"]  # saved: the new name
