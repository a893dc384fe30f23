"""What the docs name exists where they say: a move of modules breaks docs silently, and this finds it.

- every repository path (`ucp/engine/pipeline.py`, `tests/test_packs.py`, `docs/figures/io-s3.png`);
- every dotted name of the library (`ucp.sharding.layout.parse_layout`, `ucp.interop.weights.load_weights`) and every
  module `python -m` starts;
- docs/ARCHITECTURE.md's names relative to `ucp/` (`distributed/sharded_save.plan_sharded_save`), by module alone
  (`codec.ShardIndex`, `coordination.broadcast`) and by class (`SaveSession.begin`, `ReadPlan.objects`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import ucp

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]
DOCS += ["trainer/README.md", "bench_io/README.md"]
GENERATED = {"trainer/data/tiny-corpus/"}  # made on first use, git-ignored
LAYERS = "base|format|storage|protocol|engine|sharding|distributed|interop"

PATH = re.compile(r"(?<![\w./-])((?:ucp|trainer|bench_io|dataloaders|tests|scripts|docs)/[\w/.-]*[\w/])")
DOTTED = re.compile(r"(?<![\w./-])(ucp(?:\.\w+)+)")  # not `attributes.ucp.partition`, a JSON key
RUN_MODULE = re.compile(r"python -m ([\w.]+)")
RELATIVE = re.compile(rf"(?<![\w./-])((?:{LAYERS})(?:/\w+)+)(?:\.py)?((?:\.[A-Za-z_]\w*)*)")
SHORT = re.compile(r"`([a-z_]+)\.([A-Za-z_]\w*)")
METHOD = re.compile(r"\b([A-Z]\w+)\.([a-z_]\w*)")


def _text(doc: str) -> str:
    return (REPO / doc).read_text()


def _optional(error: ModuleNotFoundError) -> bool:
    """Whether an import failed for want of a package of an extra that is not installed here (vLLM for
    ucp.interop.vllm.loader), rather than for a module of ours that does not exist."""
    return bool(error.name) and error.name.split(".")[0] not in ("ucp", "trainer", "bench_io", "dataloaders")


def _ours_or_installed(module: str) -> bool:
    top = module.split(".")[0]
    return top in ("ucp", "trainer", "bench_io", "dataloaders") or (top != "pytest" and _is_module(top))


def _resolve(module: str, attrs: list[str]) -> str | None:
    """None if `module` imports and has `attrs` one inside the other (or needs an extra not installed here), else
    what is missing."""
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as e:
        return None if _optional(e) and importlib.util.find_spec(module) is not None else f"no module {module}"
    for i, attr in enumerate(attrs):
        if not hasattr(obj, attr):
            try:  # a submodule its package does not import
                obj = importlib.import_module(f"{obj.__name__}.{attr}") if isinstance(obj, ModuleType) else None
            except ModuleNotFoundError:
                obj = None
            if obj is None:
                return f"{module} has no {'.'.join(attrs[: i + 1])}"
        else:
            obj = getattr(obj, attr)
    return None


def _dotted(name: str) -> str | None:
    """None if `name` is a module or a name in one, else what is missing."""
    parts = name.split(".")
    end = 1
    while end < len(parts) and _is_module(".".join(parts[: end + 1])):
        end += 1
    return _resolve(".".join(parts[:end]), parts[end:])


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module that is no package
        return False


def _library() -> dict[str, list[ModuleType]]:
    """Every module of ucp by its last name (`codec`: [ucp.protocol.codec])."""
    modules: dict[str, list[ModuleType]] = {}
    for info in pkgutil.walk_packages(ucp.__path__, "ucp."):
        if not info.name.endswith("__main__"):
            try:
                module = importlib.import_module(info.name)
            except ModuleNotFoundError as e:
                if _optional(e):
                    continue
                raise
            modules.setdefault(info.name.rsplit(".", 1)[-1], []).append(module)
    return modules


@pytest.mark.parametrize("doc", DOCS)
def test_paths_exist(doc):
    missing = [p for p in set(PATH.findall(_text(doc))) if p not in GENERATED and not (REPO / p).exists()]
    assert not missing, f"{doc} names paths that do not exist: {sorted(missing)}"


@pytest.mark.parametrize("doc", DOCS)
def test_dotted_names_resolve(doc):
    text = _text(doc)
    # (a module of a package not installed here, such as vLLM's server, is the package's to name)
    names = set(DOTTED.findall(text)) | {m for m in RUN_MODULE.findall(text) if _ours_or_installed(m)}
    problems = {name: problem for name in sorted(names) if (problem := _dotted(name))}
    assert not problems, f"{doc}: {problems}"


def test_architecture_names_exist():
    text = _text("docs/ARCHITECTURE.md")
    modules = _library()
    problems = []
    for path, attrs in set(RELATIVE.findall(text)):
        names = [a for a in attrs.split(".") if a]
        if not (REPO / "ucp" / path).is_dir() and (problem := _resolve("ucp." + path.replace("/", "."), names)):
            problems.append(problem)
    for module, name in set(SHORT.findall(text)):
        if module in modules and all(_resolve(m.__name__, [name]) for m in modules[module]):
            problems.append(f"no module {module} has {name}")
    classes = {n: c for ms in modules.values() for m in ms for n, c in vars(m).items() if inspect.isclass(c)}
    for name, attr in set(METHOD.findall(text)):
        cls = classes.get(name)
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        if cls is not None and not hasattr(cls, attr) and attr not in fields:  # (a dataclass field without default)
            problems.append(f"{name} has no {attr}")
    assert not problems, sorted(problems)
