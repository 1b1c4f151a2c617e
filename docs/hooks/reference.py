"""MkDocs hook: the pages that are read off the code when the site builds, so they never go stale.

A line ``<!-- generated: config-reference -->`` becomes the configuration reference (every field of every
section, model and algorithm with its type, default and docstring: what ``--show-config`` prints as comments);
``<!-- generated: algorithm NAME -->`` becomes that algorithm's module docstring (its formula and departures)
and its rows of docs/departures.md. An algorithm or model the registry has and its page lacks is a warning,
which ``mkdocs build --strict`` (tests/integration/test_docs_site.py) turns into a failure.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import re
import sys
import types
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.config.describe import _flow, field_docs  # noqa: E402
from trainer.config.fields import Bounds, Place, Selected  # noqa: E402

log = logging.getLogger("mkdocs.plugins.rewardflow")
MARKER = re.compile(r"^<!-- generated: ([a-z-]+)(?: (\w+))? -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:
    name = page.file.src_uri
    if name == "models.md":
        _check_models(markdown)
    if name == "algorithms.md":
        _check_algorithms(markdown)
    return MARKER.sub(lambda match: _generate(match.group(1), match.group(2), name), markdown)


def _generate(kind: str, arg: str | None, page: str) -> str:
    if kind == "config-reference":
        return config_reference()
    if kind == "algorithm" and arg:
        return algorithm_section(arg)
    log.warning("%s: unknown generated block %r", page, kind)
    return ""


def _check_models(markdown: str) -> None:
    from trainer.models import MODELS

    for name in MODELS:
        if f"`{name}`" not in markdown:
            log.warning("models.md does not describe the registered model %r (trainer/models/__init__.py)", name)


def _check_algorithms(markdown: str) -> None:
    from trainer.algorithms import ALGORITHMS

    for name in ALGORITHMS:
        if f"<!-- generated: algorithm {name} -->" not in markdown:
            log.warning("algorithms.md has no '<!-- generated: algorithm %s -->' block", name)


# --- algorithms ---------------------------------------------------------------------------------------------


def algorithm_section(name: str) -> str:
    """The module docstring of ``trainer/algorithms/<name>.py`` as Markdown (formula lines as code blocks),
    then the rows of docs/departures.md that name the algorithm."""
    source = REPO / "trainer" / "algorithms" / f"{name}.py"
    if not source.exists():
        log.warning("algorithms.md names %r, which has no trainer/algorithms/%s.py", name, name)
        return ""
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    return f"{docstring_markdown(doc)}\n\n{departure_rows(name)}\n"


def docstring_markdown(doc: str) -> str:
    """Prose stays prose; each run of indented lines (the formulas) becomes a fenced code block."""
    out: list[str] = []
    in_code = False
    for line in doc.splitlines():
        indented = line.startswith("    ")
        if indented != in_code:
            out.extend(["```text"] if indented else ["```", ""])
            if indented and len(out) > 1:
                out.insert(len(out) - 1, "")
            in_code = indented
        out.append(line[4:] if indented else line)
    if in_code:
        out.append("```")
    return "\n".join(out)


def departure_rows(name: str) -> str:
    """The rows of the Algorithms table of docs/departures.md whose first cell names ``name``."""
    text = (REPO / "docs" / "departures.md").read_text()
    section = text.split("## Algorithms", 1)[-1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header, mine = rows[:2], [row for row in rows[2:] if name in re.findall(r"\w+", row.split("|")[1])]
    if not mine:
        return f"No departure of `{name}` is listed in [Departures](departures.md#algorithms)."
    return "\n".join(["Its rows of [Departures](departures.md#algorithms):", "", *header, *mine])


# --- configuration reference ------------------------------------------------------------------------------------


def config_reference() -> str:
    """Every section of ``Config`` as a table; the model and algorithm sections once for the fields all their
    registered classes share, then each class's own."""
    from trainer.config.schema import Config

    hints = typing.get_type_hints(Config, include_extras=True)
    docs = field_docs(Config)
    nested: dict[type, str] = {}
    parts: list[str] = []
    for field in dataclasses.fields(Config):
        hint = hints[field.name]
        doc = docs.get(field.name) or _class_doc(hint)
        parts.append(f"## `{field.name}`\n\n{doc}\n")
        selected = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Selected)), None)
        if selected is not None:
            parts.append(_embedded_differences(field.name))
            parts.append(_selected_section(field.name, selected, nested))
        else:
            parts.append(_table(hint, field.name, nested))
    parts.append("## Nested settings\n")
    done: set[type] = set()
    while len(done) < len(nested):
        cls = next(c for c in nested if c not in done)
        done.add(cls)
        parts.append(f"### `{cls.__name__}`\n\nUsed as {nested[cls]}. {_class_doc(cls)}\n")
        parts.append(_table(cls, "", nested))
    return "\n".join(parts)


def _selected_section(section: str, selected: Selected, nested: dict[type, str]) -> str:
    classes = {name: cls for name, cls in selected.registry().items()}
    shared = _shared_fields(list(classes.values()))
    first = next(iter(classes.values()))
    parts = [
        f"Chosen by `{section}.name` (default `{selected.default}`): "
        + ", ".join(f"[`{name}`](#{section}-{name})" for name in classes)
        + ". A section naming another "
        "class starts from that class's defaults.\n",
    ]
    if shared:
        parts += [f"### Every {section}\n", _table(first, section, nested, only=shared)]
    for name, cls in classes.items():
        own = [f.name for f in dataclasses.fields(cls) if f.name not in shared and f.name != "name"]
        body = _table(cls, section, nested, only=own) if own else "No settings beyond the shared ones.\n"
        parts.append(f"### `{section}.name: {name}` {{#{section}-{name}}}\n\n`{cls.__name__}`: {_class_doc(cls)}\n")
        parts.append(body)
    return "\n".join(parts)


def _embedded_differences(section: str) -> str:
    """Where the embedded job (``Config()``, no ``--config``) departs from its class's own defaults."""
    from trainer.config.schema import Config

    chosen = getattr(Config(), section)
    changed = [f"`{key}: {_flow(value)}`" for key, value in _changes(chosen, type(chosen)(), section)]
    told = f" with {', '.join(changed)}" if changed else ""
    return f"The embedded job (no `--config`) runs `{section}.name: {chosen.name}`{told}.\n"


def _changes(value, default, prefix: str) -> list[tuple[str, object]]:
    """(dotted key, value) of each field where ``value`` differs from ``default``, into nested settings."""
    if not (dataclasses.is_dataclass(value) and type(value) is type(default)):
        return [] if value == default else [(prefix, list(value) if isinstance(value, tuple) else value)]
    return [
        change
        for f in dataclasses.fields(value)
        for change in _changes(getattr(value, f.name), getattr(default, f.name), f"{prefix}.{f.name}")
    ]


def _shared_fields(classes: list[type]) -> list[str]:
    """The fields every class has with the same default and the same docstring."""

    def signature(cls: type, name: str) -> tuple[str, str]:
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        return _default(field), field_docs(cls).get(name, "")

    names = [f.name for f in dataclasses.fields(classes[0]) if f.name != "name"]
    return [
        n
        for n in names
        if all(
            n in {f.name for f in dataclasses.fields(c)} and signature(c, n) == signature(classes[0], n)
            for c in classes
        )
    ]


def _table(cls: type, prefix: str, nested: dict[type, str], only: list[str] | None = None) -> str:
    hints = typing.get_type_hints(cls, include_extras=True)
    docs = field_docs(cls)
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if only is not None and field.name not in only:
            continue
        key = f"{prefix}.{field.name}" if prefix else field.name
        for inner in _dataclasses_in(hints[field.name]):
            nested.setdefault(inner, f"`{key}`")
        cells = (f"`{key}`", _type(hints[field.name]), _default(field), docs.get(field.name, ""))
        rows.append("| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def _dataclasses_in(hint) -> list[type]:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return [hint]
    args = typing.get_args(hint)[:1] if typing.get_origin(hint) is typing.Annotated else typing.get_args(hint)
    return [c for arg in args for c in _dataclasses_in(arg)]


def _type(hint) -> str:
    """A type as a reader wants it: ``int >= 1``, ``one of a, b``, ``path``, ``LoraSettings or none``."""
    if typing.get_origin(hint) is typing.Annotated:
        base, *meta = typing.get_args(hint)
        bounds = next((m for m in meta if isinstance(m, Bounds)), None)
        if any(isinstance(m, Place) for m in meta):
            return "path" if base is str else f"path ({_type(base)})"
        return f"{_type(base)} {_bounds(bounds)}" if bounds else _type(base)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else _type(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"[{hint.__name__}](#{hint.__name__.lower()})"
    return getattr(hint, "__name__", str(hint))


def _bounds(bounds: Bounds) -> str:
    """``Bounds.describe``, but a large integral end written out whole (a seed's 2**63 - 1, not 9.22e+18)."""
    if isinstance(bounds.low, int) and isinstance(bounds.high, int) and bounds.high >= 10**6:
        return f"in {'(' if bounds.low_open else '['}{bounds.low}, {bounds.high}{')' if bounds.high_open else ']'}"
    return bounds.describe()


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return f"[{type(value).__name__}](#{type(value).__name__.lower()})"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{_flow(value)}`"


def _class_doc(cls) -> str:
    """The first paragraph of a class's docstring ("" for none, not the signature dataclasses put there)."""
    doc = inspect.getdoc(cls) if inspect.isclass(cls) else None
    if not doc or doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(doc.split("\n\n")[0].split())
