"""Plain dicts <-> typed config dataclasses: ``build`` checks every key and value against the annotations
(errors name the field), ``to_dict`` is its inverse, ``merge_sections`` updates a raw dict section by section.

Sections typed ``Selected`` (``model``, ``algorithm``) take their class from their ``name`` key; numeric fields
typed with ``Bounds`` are range-checked as they are read, so a zero batch size or a NaN learning rate is refused
with the field's name rather than failing deep inside a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from trainer.config.fields import Bounds, ConfigError, Selected, did_you_mean


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def unwrap_hint(hint: Any) -> tuple[Any, tuple]:
    """(the type inside ``Annotated`` and ``X | None``, the Annotated metadata)."""
    meta: tuple = ()
    if typing.get_origin(hint) is typing.Annotated:
        hint, meta = typing.get_args(hint)[0], typing.get_args(hint)[1:]
    if typing.get_origin(hint) in (Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            hint = options[0]
    return hint, meta


def admits_none(hint: Any) -> bool:
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return typing.get_origin(hint) in (Union, types.UnionType) and type(None) in typing.get_args(hint)


def text_choice(tp: Any) -> bool:
    """Whether ``tp`` is a ``Literal`` of strings (``model.compile``), whose words YAML may read as booleans."""
    return typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp))


def selected_field(hint: Any) -> Selected | None:
    """The ``Selected`` marker of a field whose class is chosen by name, if it has one."""
    return next((m for m in unwrap_hint(hint)[1] if isinstance(m, Selected)), None)


def mapping_field(hint: Any) -> bool:
    """Whether a field holds a mapping as one value (``reward.weights``), not a nested section."""
    return typing.get_origin(unwrap_hint(hint)[0]) is dict


def section_class(hint: Any, raw: Mapping) -> type | None:
    """The dataclass a nested section of type ``hint`` builds, given its raw mapping (None: not a section)."""
    selected = selected_field(hint)
    if selected is not None:
        return selected.registry().get(raw.get("name", selected.default))
    inner = unwrap_hint(hint)[0]
    return inner if dataclasses.is_dataclass(inner) else None


def build(cls: type, raw: Any, path: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking every key and value against the annotations. A
    nested section given in part (``sampler: {num_steps: 20}``) is completed from that field's own default
    (DPO's deterministic sampler, say), not from the nested class's defaults."""
    if dataclasses.is_dataclass(raw) and isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping of {cls.__name__} fields, got {raw!r}")
    if hasattr(cls, "migrate"):  # a class reads its retired keys itself (renamed fields)
        raw = cls.migrate(raw)
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        close = difflib.get_close_matches(str(unknown[0]), fields, n=1, cutoff=0.6)
        raise ConfigError(
            f"unknown config key {where}{unknown[0]!s}; valid keys here: {', '.join(sorted(fields))}"
            + (f"; did you mean {where}{close[0]}?" if close else "")
        )
    kwargs = {}
    for name, value in raw.items():
        value = _over_default(fields[name], hints[name], value)
        kwargs[name] = convert(hints[name], value, f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc) if str(exc).startswith(path or "config") else f"{path or 'config'}: {exc}") from exc


def _over_default(field: dataclasses.Field, hint: Any, value: Any) -> Any:
    """``value`` merged over the field's default where that is a section (a dataclass) and ``value`` a mapping;
    a section chosen by name (``Selected``) starts from its class's defaults instead."""
    if (
        not isinstance(value, Mapping)
        or field.default_factory is dataclasses.MISSING
        or selected_field(hint) is not None
    ):
        return value
    default = field.default_factory()
    if not dataclasses.is_dataclass(default):
        return value
    merged = to_dict(default)
    merge_sections(merged, value, type(default))
    return merged


def merge_sections(base: dict, update: Mapping, cls: type | None) -> None:
    """Update ``base`` (the raw dict of dataclass ``cls``) with ``update`` in place: nested sections merge field
    by field (optional ones such as ``model.lora`` too), a section naming another class than the old one's
    (``algorithm: {name: dpo, ...}``) replaces it, so that it starts from that class's defaults, and any other
    value, mapping-typed fields such as ``reward.weights`` included, replaces the old one."""
    hints = typing.get_type_hints(cls, include_extras=True) if cls is not None else {}
    for key, value in update.items():
        hint = hints.get(key)
        if value is None and isinstance(base.get(key), dict) and not admits_none(hint):
            continue  # a YAML section left empty (``eval:`` with only comments under it): no changes
        if isinstance(value, Mapping) and isinstance(base.get(key), dict) and not mapping_field(hint):
            if selected_field(hint) is not None and value.get("name", base[key].get("name")) != base[key].get("name"):
                base[key] = dict(value)
            else:
                merge_sections(base[key], value, section_class(hint, base[key]))
        else:
            base[key] = value


def convert(tp: Any, value: Any, path: str) -> Any:
    """Check and convert one value against type ``tp``: one helper per kind of annotation."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _convert_annotated(typing.get_args(tp), value, path)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(typing.get_args(tp), value, path)
    if origin is Literal:
        return _convert_literal(typing.get_args(tp), value, path)
    if origin in (list, tuple):
        return _convert_sequence(origin, typing.get_args(tp), value, path)
    if origin is dict:
        return _convert_dict(typing.get_args(tp), value, path)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if tp in (bool, float, int, str):
        return _convert_scalar(tp, value, path)
    raise AssertionError(f"unsupported config annotation {tp!r} at {path}")


def _convert_annotated(args: tuple, value: Any, path: str) -> Any:
    """``Annotated[T, ...]``: a section chosen by name (``Selected``), else ``T`` checked against its ``Bounds``."""
    meta = [m for m in args[1:] if isinstance(m, Selected)]
    if meta:
        return build_selected(meta[0], value, path)
    value = convert(args[0], value, path)
    for bounds in (m for m in args[1:] if isinstance(m, Bounds)):
        if not bounds.admits(value):
            raise ConfigError(f"{path}={value!r} must be {bounds.describe()}")
    return value


def _convert_union(args: tuple, value: Any, path: str) -> Any:
    """``A | B | None``: the first option the value converts to; the error names them all when none does."""
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    errors = []
    for option in options:
        try:
            return convert(option, value, path)
        except ConfigError as exc:
            errors.append(str(exc))
    raise ConfigError(
        errors[0]
        if len(errors) == 1
        else f"{path}: {value!r} matches none of {', '.join(_type_name(o) for o in options)}"
    )


def _convert_literal(args: tuple, value: Any, path: str) -> Any:
    """``Literal[...]``: one of its values (a YAML boolean where a word was meant is named as such)."""
    if value not in args:
        read_as = " (YAML reads an unquoted yes, no, on or off as a boolean)" if isinstance(value, bool) else ""
        raise ConfigError(f"{path}: {value!r}{read_as} is not one of {', '.join(repr(a) for a in args)}")
    return value


def _convert_sequence(origin: type, args: tuple, value: Any, path: str) -> Any:
    """``list[T]``, ``tuple[T, ...]`` or a fixed ``tuple[A, B]``, item by item."""
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{path}: expected a list, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    item = args[0] if args else Any
    out = [convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(out) if origin is tuple else out


def _convert_dict(args: tuple, value: Any, path: str) -> dict:
    """``dict[K, V]``, key by key and value by value."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {value!r}")
    key_t, val_t = args or (Any, Any)
    return {convert(key_t, k, f"{path}"): convert(val_t, v, f"{path}.{k}") for k, v in value.items()}


def _convert_scalar(tp: type, value: Any, path: str) -> Any:
    """``bool``, ``float``, ``int`` or ``str``: no bool passes for a number, a number's string passes for a float."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if isinstance(value, str):
        return value
    raise ConfigError(f"{path}: expected a string, got {value!r}")


def build_selected(selected: Selected, value: Any, path: str) -> Any:
    registry = selected.registry()
    if dataclasses.is_dataclass(value):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected a mapping with a 'name' key, got {value!r}")
    name = value.get("name", selected.default)
    if name not in registry:
        raise ConfigError(
            f"{path}.name={name!r} is not registered; choose one of: {', '.join(sorted(registry))}"
            + did_you_mean(name, registry)
        )
    return build(registry[name], {**value, "name": name}, path)


def to_dict(config: Any) -> Any:
    """A config dataclass as plain data (YAML-safe), the inverse of ``build``."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, list | tuple):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config
