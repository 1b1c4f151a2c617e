"""One shape for every registry of names (algorithms, models, scorers, datasets, parallel backends, advantage
estimators and losses): a ``Registry`` maps each user-facing name to an ``Entry``, which builds what it names.
Adding one is a line ``"name": Entry(target, **kwargs)``, or ``@REGISTRY.register("name")`` on a function beside it.
Looking up a name that is not registered raises ``UnknownName``: one line naming the setting and the choices.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class Entry:
    """A registered name's target: an object, or ``"module:attribute"`` imported on first use (a server then pays only
    for the scorers it runs). Calling the entry calls the target with ``kwargs`` before the caller's arguments."""

    def __init__(self, target: str | Callable, /, accepts: tuple[str, ...] | None = None, **kwargs: Any):
        self.target = target
        self.kwargs = kwargs
        self.accepts = accepts
        """The caller's keyword arguments the target takes (None: all; e.g. () for a scorer without weights, which
        is offered ``model_dir=`` like the others)."""

    def load(self) -> Any:
        """The target itself (imported where it is named by a string)."""
        if not isinstance(self.target, str):
            return self.target
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.accepts is not None:
            kwargs = {key: value for key, value in kwargs.items() if key in self.accepts}
        return self.load()(*args, **self.kwargs, **kwargs)

    @property
    def config_class(self) -> type:
        """The target's config dataclass (algorithms' and models' ``config_class``: a config section's fields)."""
        return self.load().config_class

    def __repr__(self) -> str:
        target = self.target if isinstance(self.target, str) else getattr(self.target, "__qualname__", self.target)
        return f"Entry({target!r}{''.join(f', {k}={v!r}' for k, v in self.kwargs.items())})"


class UnknownName(KeyError, ValueError):
    """A name looked up in a registry that has no such entry: a user's mistake (ValueError), and the KeyError of a
    mapping lookup."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(dict[str, Entry]):
    """User-facing name -> ``Entry``, in the order of registration (the order iteration gives; messages sort).
    ``key``: the setting that names an entry (``model.name``), said in the error for a name it lacks."""

    def __init__(self, entries: Mapping[str, Entry] | None = None, key: str = "name"):
        super().__init__(entries or {})
        self.key = key

    def __missing__(self, name: str) -> Entry:
        raise UnknownName(f"{self.key}={name!r} is not registered; choose one of: {', '.join(sorted(self))}")

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers the function or class it decorates under ``name`` and returns it unchanged."""

        def add(target: T) -> T:
            assert name not in self, f"{name!r} is registered twice"
            self[name] = Entry(target)
            return target

        return add
