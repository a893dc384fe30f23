"""docs/ARCHITECTURE.md's layers hold: no module of ucp imports one of a layer above its own (imports inside
functions count too), the library imports nothing of the trainer's, the benchmarks' or the data loaders', and no
module of ours (library, trainer, benchmarks, data loaders) takes part in an import circle."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UCP = ROOT / "ucp"
PACKAGES = ("ucp", "trainer", "bench_io", "dataloaders")
# Each layer is a folder of ucp (a package whose docstring says what it owns and what it may import); what users
# import directly (the public API, the manager, the CLI, the errors) stays at the top, in the layers it belongs to.
LAYERS = {
    0: {"errors", "version", "zarr_bfloat16", "base"},
    1: {"format"},
    2: {"storage"},
    3: {"protocol"},
    4: {"engine"},
    5: {"sharding"},
    6: {"distributed"},
    7: {"manager", "training_state", "demo", "interop", "cli", "cli_common", "__init__", "__main__"},
}
FOLDERS = {"base", "format", "storage", "protocol", "engine", "sharding", "distributed", "interop"}
LAYER = {name: layer for layer, names in LAYERS.items() for name in names}


def top_module(path: Path) -> str:
    parts = path.relative_to(UCP).with_suffix("").parts
    return parts[0]


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, first component below ucp) of every import of a ucp module in the file."""
    package = path.relative_to(UCP).parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1]) if node.level > 1 else list(package)
                names = (node.module or "").split(".") if node.module else []
                target = [*base, *names]
                if target:
                    out.append((node.lineno, target[0]))
                else:  # `from . import a, b`
                    out += [(node.lineno, alias.name) for alias in node.names]
            elif node.module and node.module.split(".")[0] == "ucp":
                parts = node.module.split(".")
                if len(parts) > 1:
                    out.append((node.lineno, parts[1]))
                else:
                    out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "ucp" and len(parts) > 1:
                    out.append((node.lineno, parts[1]))
    return out


def test_every_module_has_a_layer():
    modules = {top_module(p) for p in UCP.rglob("*.py")}
    assert modules <= set(LAYER), f"modules missing from docs/ARCHITECTURE.md's layers: {sorted(modules - set(LAYER))}"


def test_the_top_holds_what_users_import_and_each_layer_is_a_folder_that_says_what_it_owns():
    top = sorted(p.stem for p in UCP.glob("*.py"))
    assert len(top) <= 12, f"{len(top)} modules directly under ucp/: {top}"
    assert {p.name for p in UCP.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == FOLDERS
    for folder in FOLDERS:
        doc = ast.get_docstring(ast.parse((UCP / folder / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"ucp/{folder}/__init__.py says nothing of what it owns"


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path in sorted(UCP.rglob("*.py")):
        mine = top_module(path)
        for line, name in imported(path):
            if name in LAYER and LAYER[name] > LAYER[mine] and name != mine:
                upward.append(
                    f"{path.relative_to(UCP.parent)}:{line} ({mine}, layer {LAYER[mine]}) imports {name} (layer {LAYER[name]})"
                )
    assert not upward, "\n".join(upward)


def test_the_library_imports_nothing_of_the_trainer_the_benchmarks_or_the_data_loaders():
    outside = []
    for path in sorted(UCP.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            outside += [
                f"{path.relative_to(UCP.parent)}:{node.lineno} {n}"
                for n in names
                if n.split(".")[0] in ("trainer", "dataloaders", "bench_io")
            ]
    # the one exception: `ucp bench` hands its arguments to bench_io's main (a command, not the library)
    assert all(o.startswith("ucp/cli.py:") and o.endswith(" bench_io.__main__") for o in outside), outside


# The storage package's own order: the interfaces know no implementation; S3's specifics and the classification of
# errors come before the stores that use them; `urls` picks a store, and the package re-exports them all.
STORAGE_ORDER = ["base", "s3", "s3_direct", "errors", "local", "fsspec", "urls", "__init__"]


def test_the_storage_package_imports_only_what_comes_before_each_module():
    modules = {p.stem for p in (UCP / "storage").glob("*.py")}
    assert modules == set(STORAGE_ORDER), f"storage modules missing from STORAGE_ORDER: {modules ^ set(STORAGE_ORDER)}"
    later = []
    for name in STORAGE_ORDER:
        path = UCP / "storage" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [node.module] if node.module else [a.name for a in node.names]
                later += [
                    f"ucp/storage/{name}.py:{node.lineno} imports {t}"
                    for t in targets
                    if STORAGE_ORDER.index(t.split(".")[0]) >= STORAGE_ORDER.index(name)
                ]
    assert not later, "\n".join(later)


def module_files(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of ours under `root` (a package by its __init__.py)."""
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line}: every import of the file, at its top, inside functions or under
    TYPE_CHECKING, of a module of ours; `from a import b` is an import of a.b where that is a module, else of a."""
    files = module_files(root)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                name = known(target)
                if name is not None and name != module:
                    edges.setdefault(name, node.lineno)
        graph[module] = edges
    return graph


def circle_through(graph: dict[str, dict[str, int]], start: str) -> list[str] | None:
    """A shortest import path from `start` back to itself, or None (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in graph.get(module, {}):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    return None


def test_the_import_graph_has_no_circles():
    """What two modules share lives below both: an import circle (through imports inside functions or under
    TYPE_CHECKING too) ties modules that a reader, and the import system, must take in one go."""
    graph = import_graph()
    circles, seen = [], set()
    for module in sorted(graph):
        circle = circle_through(graph, module)
        if circle is not None and not set(circle) <= seen:
            seen |= set(circle)
            circles.append(
                " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(circle)) + f" -> {module}"
            )
    assert not circles, "\n".join(circles)


def test_the_circle_check_finds_a_circle(tmp_path):
    """The check above is no formality: two modules that import each other (one inside a function, one for typing
    only) are a circle it names."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "ucp" / "a.py").write_text("def f():\n    from ucp.b import g\n")
    (tmp_path / "ucp" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    graph = import_graph(tmp_path)
    assert circle_through(graph, "ucp.a") == ["ucp.a", "ucp.b", "ucp.a"]
    assert circle_through(graph, "ucp") is None
