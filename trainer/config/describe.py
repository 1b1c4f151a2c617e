"""What ``--show-config`` prints: the resolved config as YAML with each field's description above it as a
comment (the docstring under the field in its dataclass), so the output documents every setting and still
loads back as a ``--config`` file.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
from typing import Any

import yaml

WIDTH = 110


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal right under the field), over ``cls``'s dataclass bases
    too (a subclass's own wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body[:-1], body[1:], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def described_yaml(config: Any, raw: dict) -> str:
    """``raw`` (``saved_dict(config)``: what is printed) as YAML, each field of the dataclass ``config`` preceded
    by its description; a section without a field docstring is described by its class's first line."""
    lines: list[str] = []
    _section(config, raw, "", lines)
    return "\n".join(lines) + "\n"


def _section(obj: Any, raw: dict, indent: str, lines: list[str]) -> None:
    docs = field_docs(type(obj))
    for field in dataclasses.fields(obj):
        if field.name not in raw:
            continue
        value, shown = getattr(obj, field.name), raw[field.name]
        doc = docs.get(field.name)
        if doc is None and dataclasses.is_dataclass(value):
            doc = (inspect.getdoc(type(value)) or "").split("\n\n")[0]
        if doc:
            lines.extend(
                textwrap.wrap(
                    " ".join(doc.split()),
                    max(40, WIDTH - len(indent)),
                    initial_indent=f"{indent}# ",
                    subsequent_indent=f"{indent}# ",
                )
            )
        if dataclasses.is_dataclass(value) and isinstance(shown, dict):
            lines.append(f"{indent}{field.name}:")
            _section(value, shown, indent + "  ", lines)
        else:
            lines.append(f"{indent}{field.name}: {_flow(shown)}")


def _flow(value: Any) -> str:
    """One value as one line of YAML (flow style for lists and mappings)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False).strip()
    return text.removesuffix("\n...").strip()
