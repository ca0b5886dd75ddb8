"""The package's import graph (built with ast from every module's source): no circles, and no import against the layer
order docs/architecture.md writes down.

Every `import` / `from ... import` counts, at module level and inside functions (a lazy import is still a
dependency); only imports under `if TYPE_CHECKING:` are left out (they never run). `from package import name` counts
as an import of the submodule when `name` is one, else of the package. A parent package's __init__ that runs first
is not an edge (Python runs it, the code does not ask for it).
"""

import ast
from pathlib import Path

import pytest

from helpers import REPO
PACKAGE = "fastremover"

# Lowest first. A module may import its own layer and those below it. The most specific (longest) prefix decides,
# so a module's own entry overrides its package's. docs/architecture.md ("Layers") is the same table in words.
LAYERS = [
    ("foundations", ["fastremover", "fastremover.__init__", "fastremover.errors", "fastremover.log",
                     "fastremover.lru", "fastremover.timing", "fastremover.env", "fastremover.extras",
                     "fastremover.outputs", "fastremover.cache"]),
    ("per request", ["fastremover.options", "fastremover.masks", "fastremover.windows", "fastremover.media",
                     "fastremover.stream"]),
    ("contracts", ["fastremover.engine.interfaces"]),
    ("eager models", ["fastremover.models", "fastremover.schedulers"]),
    ("kernels", ["fastremover.fast.kernels", "fastremover.fast.nvfp4"]),
    ("ops", ["fastremover.ops"]),
    ("spec", ["fastremover.config"]),
    ("fast paths", ["fastremover.fast", "fastremover.engine.vae", "fastremover.engine.tiling",
                    "fastremover.parallel.context", "fastremover.parallel.ulysses", "fastremover.parallel.transport",
                    "fastremover.parallel.vae"]),
    ("engine", ["fastremover.engine"]),
    ("pipeline", ["fastremover.pipeline", "fastremover.classic", "fastremover.worker"]),
    ("front ends", ["fastremover.cli", "fastremover.__main__", "fastremover.info", "fastremover.batch",
                    "fastremover.serve", "fastremover.bench", "fastremover.h3", "fastremover.masktools",
                    "fastremover.parallel"]),
]


def modules(root: Path = REPO) -> dict[str, Path]:
    """{dotted name: file} of every module of the package (a package by its own name)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """{imported package module: line} of one module's source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == PACKAGE and target != name:
                found.setdefault(target, node.lineno)
    return found


def graph(root: Path = REPO) -> dict[str, dict[str, int]]:
    mods = modules(root)
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected component of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path_in(sorted(component), edges))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def _path_in(component: list[str], edges) -> list[str]:
    """A shortest cycle through the component's first module (breadth first inside the component)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return component


def layer_of(name: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = i, len(prefix)
    if best is None:
        raise KeyError(name)
    return best


def against_the_layers(edges: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for name, targets in sorted(edges.items()):
        for target, line in sorted(targets.items()):
            if target in edges and layer_of(target) > layer_of(name):
                out.append(f"{name}:{line} ({LAYERS[layer_of(name)][0]}) imports {target} "
                           f"({LAYERS[layer_of(target)][0]})")
    return out


def test_every_module_has_a_layer():
    missing = []
    for name in modules():
        try:
            layer_of(name)
        except KeyError:
            missing.append(name)
    assert not missing, f"modules without a layer (add them to LAYERS and docs/architecture.md): {missing}"


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_import_against_the_layer_order():
    bad = against_the_layers(graph())
    assert not bad, "imports against the layer order (docs/architecture.md, Layers):\n" + "\n".join(bad)


def test_the_doc_names_the_same_layers():
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Layers"):text.index("\n## ", text.index("## Layers") + 1)]
    positions = [section.find(f" {name} ") for name, _ in LAYERS]
    assert -1 not in positions, [name for (name, _), p in zip(LAYERS, positions) if p == -1]
    assert positions == sorted(positions), "the doc lists the layers in another order"


# -- the checker itself, on a package written for the test -------------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_finds_a_circle_through_a_function_level_import(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from fastremover import b\n",
        "b.py": "def f():\n    from fastremover.a import x\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fastremover import a\n",
    })
    edges = graph(root)
    assert edges["fastremover.c"] == {}  # TYPE_CHECKING only
    assert cycles(edges) == [["fastremover.a", "fastremover.b", "fastremover.a"]]


def test_finds_an_import_against_the_layers(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "errors.py": "from fastremover.cli import main\n", "cli.py": ""})
    bad = against_the_layers(graph(root))
    assert len(bad) == 1 and bad[0].startswith("fastremover.errors:1 (foundations) imports fastremover.cli")


@pytest.mark.parametrize("name, layer", [("fastremover.engine.interfaces", "contracts"),
                                         ("fastremover.engine.build", "engine"),
                                         ("fastremover.fast.kernels.quant", "kernels"),
                                         ("fastremover.parallel.launch", "front ends")])
def test_the_most_specific_prefix_decides(name, layer):
    assert LAYERS[layer_of(name)][0] == layer
