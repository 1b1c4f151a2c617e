"""Config from files and the command line: ``load_config`` merges YAML presets and ``section.key=value``
overrides over the embedded default; ``saved_dict`` is what a run writes back; ``user_error_exit`` is how a
command-line tool reports a user's mistake.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from shared.interrupt import interrupted
from trainer.config.building import (
    admits_none,
    build,
    merge_sections,
    section_class,
    text_choice,
    to_dict,
    unwrap_hint,
)
from trainer.config.fields import ConfigError, Place, hub_id
from trainer.config.schema import Config
from trainer.tool import tell_launcher


def user_error_exit(exc: Exception) -> int:
    """How a command-line tool ends on a user-fixable ValueError (bad paths, shapes, sizes): the message and exit
    status 2, or the traceback (re-raised) when RF_TRACEBACK is set. Call it in the ``except`` block. (The trainer
    reports a run that went wrong, trainer/health.py, the same way and exits 1.)
    An error raised alike on every rank (``every_rank``) is reported by rank 0 alone."""
    if interrupted():  # what a Ctrl-C became in library code: the tool says it was interrupted (shared/interrupt.py)
        raise KeyboardInterrupt from exc
    if os.environ.get("RF_TRACEBACK"):
        raise exc
    tell_launcher(f"error: {exc}")  # torchrun's failure summary shows it, not a link to its docs
    if getattr(exc, "every_rank", False) and os.environ.get("RANK", "0") != "0":
        return 2
    print(f"error: {exc}\n(set RF_TRACEBACK=1 for the traceback)", file=sys.stderr)
    return 2


def apply_override(raw: dict, override: str, cls: type | None = None) -> None:
    """Apply ``a.b.c=value`` to nested dict ``raw`` (of dataclass ``cls``). The value is parsed as YAML (``3``,
    ``true``, ``[1, 2]``), except for a text field (``str``, ``str | None``, a choice of words), which takes it
    as written: YAML would cut ``low quality, #watermark`` at the ``#``, read ``2024-06-01`` as a date and
    ``off`` as false (a quoted value is unquoted, ``null`` is None where the field admits it)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    key, text = override.split("=", 1)
    parts = key.strip().split(".")
    node, section = raw, cls
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None and section is not None and section_class(_hint(section, part), {}) is not None:
            child = node[part] = {}  # an optional section that is off (model.lora): on, from its defaults
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: i + 1])} is not a section")
        section = section_class(_hint(section, part), child) if section is not None else None
        node = child
    node[parts[-1]] = override_value(override, text, _hint(section, parts[-1]))


def _hint(cls: type | None, name: str) -> Any:
    return typing.get_type_hints(cls, include_extras=True).get(name) if dataclasses.is_dataclass(cls) else None


def override_value(override: str, text: str, hint: Any) -> Any:
    """An override's ``text`` as the value of a field typed ``hint`` (see ``apply_override``)."""
    inner = unwrap_hint(hint)[0]
    nullable = admits_none(hint)
    if inner is str or text_choice(inner):
        if nullable and text in ("null", "~"):
            return None
        try:  # 'a quoted value' is unquoted; anything else stays as written
            unquoted = yaml.safe_load(text) if text[:1] in ("'", '"') else None
        except yaml.YAMLError:
            unquoted = None
        return unquoted if isinstance(unquoted, str) else text
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as exc:
        hint = " (quote the whole override for the shell: 'section.key={a: 1, b: 2}')" if "{" in text else ""
        raise ConfigError(f"override {override!r}: value is not valid YAML{hint} ({exc})") from exc
    glued = [key for key, item in value.items() if ":" in str(key) and item is None] if isinstance(value, dict) else []
    if glued:  # YAML reads {digit:1} as the key 'digit:1' with no value
        raise ConfigError(
            f"override {override!r}: YAML needs a space after the colon: "
            f"{{{str(glued[0]).replace(':', ': ', 1)}}}, not {{{glued[0]}}}"
        )
    return value


def load_yaml(path: str) -> dict:
    path = os.path.expanduser(path)  # --config=~/x.yaml: the shell leaves it to us
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        hint = f", such as {Path(path) / 'config.yaml'}" if (Path(path) / "config.yaml").is_file() else ""
        raise ConfigError(f"--config {path} is a directory: pass a YAML file{hint}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML: {exc}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a text file (YAML is UTF-8 text)") from None
    if raw is None:  # an empty or all-comment file: a failed redirect or an unsaved editor, not a job
        raise ConfigError(
            f"--config {path}: the file is empty (no sections); write the sections to change, or "
            "leave --config off to run the embedded job"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections")
    for section, fields in raw.items():
        if fields is not None and not isinstance(fields, dict):
            example = (
                f"{{name: {fields}}}" if f"{section}.name" in _NAMED and isinstance(fields, str) else "{key: value}"
            )
            raise ConfigError(
                f"--config {path}: {section} must be a section of fields ({section}: {example}), got {fields!r}"
            )
    return raw


_NAMED = ("model.name", "algorithm.name")
"""Overrides that pick a section's class: applied before the others, whatever their order on the command line."""


def load_config(paths: str | Sequence[str] | None = None, overrides: Sequence[str] = ()) -> Config:
    """The default config, updated by YAML files in order (a model preset, then an algorithm preset: a later
    file's fields win) and then by ``section.key=value`` overrides, ``model.name`` / ``algorithm.name`` ones
    first. A section naming another class than the one before it (``algorithm: {name: dpo, ...}`` in a file,
    ``algorithm.name=dpo``) starts from that class's defaults; so does a file's named section over the
    embedded job's (whose GRPO sampler window a preset naming grpo must not inherit); otherwise a section
    updates the one before it field by field."""
    raw: dict = to_dict(Config())
    built_in = {"model", "algorithm"}  # sections still the embedded job's
    for path in [paths] if isinstance(paths, str) else paths or ():
        update = load_yaml(path)
        for section in built_in & update.keys():
            if isinstance(update[section], dict) and "name" in update[section]:
                raw[section] = {"name": update[section]["name"]}  # that class's defaults, not the embedded job's
        built_in -= update.keys()
        merge_sections(raw, update, Config)
    names = [o for o in overrides if o.partition("=")[0].strip() in _NAMED]
    for override in names:
        key, _, text = override.partition("=")
        section = key.strip().split(".")[0]
        name = override_value(override, text.strip(), str)
        if not isinstance(raw[section], dict) or raw[section].get("name") != name:  # another class: its defaults
            raw[section] = {"name": name}
    for override in [o for o in overrides if o not in names]:
        apply_override(raw, override, Config)
    return build(Config, _home_expanded(raw), "")


def _home_expanded(node: Any) -> Any:
    """``node`` with every text written ``~`` or ``~/...`` made the home folder's path, as a shell would: a shell
    leaves it as written after ``key=`` (``logging.output_dir=~/runs`` made a folder named ``~``)."""
    if isinstance(node, dict):
        return {key: _home_expanded(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_home_expanded(value) for value in node]
    if isinstance(node, str) and (node == "~" or node.startswith("~/")):
        return os.path.expanduser(node)
    return node


def saved_dict(config: Config, absolute: bool = True) -> dict:
    """``to_dict(config)`` as written to a run's config.yaml and checkpoints, and printed: without the
    bearer token (a secret; the run's command line or $REWARD_SERVER_TOKEN gives it again on a resume), and
    with the files and folders it reads (``LocalPath`` fields) absolute, so that a resume, ``generate`` or
    ``export`` started in another folder finds them (``absolute=False``: as given, for ``--show-config``)."""
    raw = absolute_paths(config, to_dict(config)) if absolute else to_dict(config)
    raw["reward"]["token"] = None
    return raw


def absolute_paths(config: Any, raw: dict) -> dict:
    """``raw`` (``to_dict`` of config dataclass ``config``) with each relative ``LocalPath`` field made absolute,
    in place; a Hub id given for a folder stays as written, for the error that names the fix."""
    if not dataclasses.is_dataclass(config):
        return raw
    hints = typing.get_type_hints(type(config), include_extras=True)
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if any(isinstance(marker, Place) for marker in unwrap_hint(hints[field.name])[1]):
            if isinstance(value, str) and value and not os.path.isabs(value) and not hub_id(value):
                raw[field.name] = os.path.abspath(value)
        elif dataclasses.is_dataclass(value) and isinstance(raw.get(field.name), dict):
            absolute_paths(value, raw[field.name])
    return raw
