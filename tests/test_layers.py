"""The layers of docs/design.md, checked on the import graph of `flows`, `streamrl` and
`storage`: no import circle, no arrow back up the layers, no Prefect below `flows`.

Every import counts: at module level, inside a function, under `TYPE_CHECKING`. A module's
layer is the layer of the longest dotted prefix in `LAYERS` that names it, with one rule on
top: the configuration section (`streamrl.<package>.config`) of a component above the
configuration layer belongs to that layer, where `streamrl.config.run.RunConfig` joins the
sections, and may also import its own package (the strategy objects of what it configures,
what differs per variant lives with the variant); the circle check still covers those
arrows.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A module may import modules of its own layer and of the layers below.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("storage", "storage.fs", "storage.seaweedfs"),
    ("storage.control",),
    ("storage.weights",),
    ("storage.checkpoints",),
    ("storage.stream",),
    ("streamrl.config.base", "streamrl.config.merge"),
    ("streamrl.isolation", "streamrl.algorithms", "streamrl.models", "streamrl.data"),
    ("streamrl.rewards", "streamrl.envs", "streamrl.scorers"),
    ("streamrl.config",),
    (
        "streamrl.placement",
        "streamrl.generator",
        "streamrl.learner",
        "streamrl.evaluation",
        "streamrl.scorers.serve",  # a served scorer's process, a component like a generator
    ),
    ("streamrl.supervision",),
    ("streamrl.runs",),
    ("streamrl.cli", "streamrl.__main__", "streamrl"),
    ("flows",),
)
CONFIGURATION = "streamrl.config"
BELOW_FLOWS_NO = ("prefect",)


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of `packages` under `root`, by dotted name (a package by its own name)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """What module `name` (at `path`) imports: known modules, resolved to the module
    (`from a.b import c` names module `a.b.c` when there is one, else `a.b`), and the top-level
    names of the rest."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_resolved(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else _resolved(base, known))
    found.discard(name)
    return found


def _resolved(target: str, known: Mapping[str, Path]) -> str:
    """The longest known module `target` names, or its top-level name if none."""
    name = target
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or target.partition(".")[0]


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    known = modules(root, packages)
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _prefix(name: str, layers: tuple[tuple[str, ...], ...]) -> tuple[int, str] | None:
    """The layer of the longest prefix in `layers` naming `name`, and that prefix."""
    best: tuple[int, str] | None = None
    for rank, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best[1])
            ):
                best = (rank, prefix)
    return best


def layer(name: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """`name`'s layer; the section of a component above the configuration
    (`<package>.config`) is in the configuration's."""
    found = _prefix(name, layers)
    configuration = _prefix(CONFIGURATION, layers)
    if found is None or configuration is None or not _is_section(name):
        return None if found is None else found[0]
    return min(found[0], configuration[0])


def upward(
    graph: Mapping[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[str]:
    """Each import of a module from a higher layer than its own, as 'a -> b'."""
    found = []
    for name, targets in sorted(graph.items()):
        own = layer(name, layers)
        for target in sorted(targets):
            theirs = layer(target, layers)
            if own is None or theirs is None or theirs <= own:
                continue
            if _is_section(name) and target.startswith(name.rpartition(".")[0] + "."):
                continue  # a section's own package
            found.append(f"{name} -> {target}")
    return found


def _is_section(name: str) -> bool:
    return name.endswith(".config") and name.count(".") == 2


def test_the_layers_name_every_module() -> None:
    graph = import_graph(ROOT, ("flows", "streamrl", "storage"))
    assert [name for name in graph if layer(name) is None] == []


def test_no_import_circles() -> None:
    graph = import_graph(ROOT, ("flows", "streamrl", "storage"))
    assert circles(graph) == []


def test_no_import_goes_up_a_layer() -> None:
    graph = import_graph(ROOT, ("flows", "streamrl", "storage"))
    assert upward(graph) == []


def test_prefect_stays_in_flows() -> None:
    graph = import_graph(ROOT, ("flows", "streamrl", "storage"))
    below = {
        f"{name} -> {target}"
        for name, targets in graph.items()
        if not name.startswith("flows")
        for target in targets
        if target.split(".")[0] in BELOW_FLOWS_NO
    }
    assert below == set()


def _tree(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_finds_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from low.b import B\n",
            "low/b.py": "def f():\n    from . import a\n",
            "low/c.py": "import os\n",
            "high/__init__.py": "",
            "high/d.py": "from low.c import x\n",
            "low/e.py": "from high.d import y\n",
        },
    )  # fmt: skip
    graph = import_graph(tmp_path, ("low", "high"))
    assert graph["low.a"] == {"typing", "low.b"}  # under TYPE_CHECKING too
    assert circles(graph) == [["low.a", "low.b"]]
    assert upward(graph, (("low",), ("high",))) == ["low.e -> high.d"]


@pytest.mark.parametrize(
    ("name", "prefix"),
    [
        ("streamrl.config.base", "streamrl.config.base"),
        ("streamrl.config.run", "streamrl.config"),
        ("streamrl.learner.config", "streamrl.config"),
        ("streamrl.learner.loop", "streamrl.learner"),
        ("storage.stream.reader", "storage.stream"),
        ("storage.fs", "storage"),
    ],
)
def test_a_module_is_in_the_layer_of_its_longest_prefix(name: str, prefix: str) -> None:
    assert layer(name) == next(rank for rank, names in enumerate(LAYERS) if prefix in names)
