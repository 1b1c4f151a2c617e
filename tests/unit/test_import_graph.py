"""No import cycle in trainer/, reward_server/, shared/ or scoring/, the layers kept apart (the trainer imports no
reward_server module; scoring/, which both use, imports neither), and model families composed, not derived.

Every module's imports are parsed with ``ast`` (nothing is imported). An edge A -> B is an import in A that
names module B: ``import B``, ``from B import x``, or ``from P import B`` where B is a submodule of P;
relative imports are resolved against A's package. An import of a package does not count as importing its
parent packages' other modules.

Module-level imports (at the top, under ``if TYPE_CHECKING:``, in try blocks and class bodies) must form no
cycle at all. Imports inside functions are deferred (they run once both modules are initialised) and count in
a second check, which allows only the cycles of ``DEFERRED_ALLOWED``. Each failure names one cycle per
strongly connected group of modules.

A model family is one file (``trainer.models.MODELS`` names its adapter class): no module under trainer/models/
imports another family's file (shared parts live in non-model modules: conditioning, packing, latents, ...), and no
adapter class derives from another's (a variant is registry data, not a subclass).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "reward_server", "shared", "scoring")


def modules() -> dict[str, Path]:
    """Module name -> file, for every .py file of ``PACKAGES`` (a package by its ``__init__.py``)."""
    found = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            parts = list(file.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = file
    return found


def imports(name: str, file: Path, known: set[str], deferred: bool = False) -> set[str]:
    """The modules of ``known`` that module ``name`` (at ``file``) imports at module level, and with
    ``deferred`` inside its functions too."""
    is_package = file.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    edges = set()
    pending: list[ast.AST] = [ast.parse(file.read_text(), str(file))]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            edges.add(source)
            edges.update(f"{source}.{alias.name}" for alias in node.names)
        if deferred or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return {target for target in edges if target in known and target != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per strongly connected component of more
    than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(set(component))
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module (by name) of ``component`` (breadth-first)."""
    start = min(component)
    parent = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError("a strongly connected component has a cycle")


DEFERRED_ALLOWED: tuple[str, ...] = ()
"""Packages whose deferred (function-level) import cycles are allowed: none today."""


def graph(deferred: bool) -> dict[str, set[str]]:
    found = modules()
    assert {"trainer.trainer", "trainer.models.base", "reward_server", "shared.protocol"} <= set(found)
    return {name: imports(name, file, set(found), deferred) for name, file in found.items()}


def test_module_level_imports_form_no_cycle():
    edges = graph(deferred=False)
    assert "trainer.models.base" in edges["trainer.trainer"]  # the parse sees imports
    loops = cycles(edges)
    assert not loops, "import cycles:\n" + "\n".join(" -> ".join(loop) for loop in loops)


def test_deferred_imports_form_no_cycle_but_the_allowed_ones():
    loops = [
        loop
        for loop in cycles(graph(deferred=True))
        if not any(all(m == p or m.startswith(p + ".") for m in loop) for p in DEFERRED_ALLOWED)
    ]
    assert not loops, "import cycles through deferred imports:\n" + "\n".join(" -> ".join(loop) for loop in loops)


def test_layers_import_only_what_they_may():
    """The trainer reaches scorers only through scoring/ (gradients cannot cross HTTP, but the server's code stays
    out of the trainer); scoring/ imports neither the trainer nor the server."""
    edges = graph(deferred=True)
    assert "scoring.digit" in edges["reward_server.scorers.digit"]  # the parse sees the shared scorer's users
    crossing = sorted(
        f"{name} -> {target}"
        for name, targets in edges.items()
        for target in targets
        if (name.startswith("trainer") and target.startswith("reward_server"))
        or (name.startswith("scoring") and target.split(".")[0] in ("trainer", "reward_server"))
    )
    assert not crossing, "imports across layers:\n" + "\n".join(crossing)


def test_cycles_are_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert sorted(cycles(graph)) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def family_modules() -> set[str]:
    """The modules of the registered adapters (one per model family)."""
    from trainer.models import MODELS

    return {spec.adapter.partition(":")[0] for spec in MODELS.values()}


def test_no_model_module_imports_another_family_file():
    found = modules()
    families = family_modules()
    assert {"trainer.models.flux", "trainer.models.qwen_image", "trainer.models.sd3"} <= families
    edges = graph(deferred=True)
    crossing = sorted(
        f"{name} -> {target}"
        for name in found
        if name.startswith("trainer.models.")
        for target in edges[name] & families
        if target != name
    )
    assert not crossing, "model modules importing another family's file:\n" + "\n".join(crossing)


def test_no_adapter_class_derives_from_another_models_adapter():
    from trainer.models import MODELS

    adapters = {spec.load() for spec in MODELS.values()}
    derived = sorted(
        f"{cls.__name__} derives from {other.__name__}"
        for cls in adapters
        for other in adapters
        if other is not cls and issubclass(cls, other)
    )
    assert not derived, "\n".join(derived)
    assert all(cls.__bases__ == (object,) for cls in adapters), [
        c.__name__ for c in adapters if c.__bases__ != (object,)
    ]
