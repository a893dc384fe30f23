"""The state tree: a nested dict of tensors and JSON values <-> a JSON tree plus a flat map of atoms.

Node kinds (docs/FORMAT.md): {"dict": {key: node}}, {"list": [node]}, {"atom": path}, {"value": json} and
{"float": "nan" | "inf" | "-inf"} (strict JSON has no non-finite numbers). A subtree that holds only
plain JSON is stored as one {"value": ...} node. Tuples come back as lists.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..base import dtypes
from ..errors import FormatError, StateError
from .manifest import MAX_ATOM_PATH_BYTES, MAX_KEY_BYTES, MAX_TREE_DEPTH, RESERVED_NAMES, is_utf8

# A key that is plainly fine (most): ASCII with no control character, '/' or '\\', of a file name's length.
_PLAIN_KEY = re.compile(rf"[\x20-\x2e\x30-\x5b\x5d-\x7e]{{1,{MAX_KEY_BYTES}}}")


def check_key(key: object, where: str | Callable[[], str]) -> str:
    """A state key becomes a Zarr node name: refuse anything that could escape or collide. (`where` names its place
    in an error: a callable is called only then.)"""
    if type(key) is str and _PLAIN_KEY.fullmatch(key) and key not in _SPECIAL and not key.startswith("__"):
        return key  # (most keys: checked at once)
    where = where if isinstance(where, str) else where()
    if not isinstance(key, str):
        raise StateError(f"{where}: keys must be strings, got {type(key).__name__} {key!r}")
    if key in ("", ".", "..") or "/" in key or "\\" in key:
        raise StateError(
            f"{where}: key {key!r} would escape the checkpoint root or name no node (no '/', '\\', '.', '..' or '')"
        )
    if key.startswith("__") or key in RESERVED_NAMES or any(ord(ch) < 32 for ch in key):
        raise StateError(
            f"{where}: key {key!r} is reserved (names starting with '__', {sorted(RESERVED_NAMES)}, control characters)"
        )
    if not is_utf8(key):  # (a lone surrogate: the key names a file or object, and none is named by one)
        raise StateError(
            f"{where}: key {key!r} is not Unicode text (it holds a lone surrogate): no object can be named by it"
        )
    if len(key.encode()) > MAX_KEY_BYTES:
        raise StateError(
            f"{where}: key {key[:40]!r}... is longer than {MAX_KEY_BYTES} bytes (it names a file or object)"
        )
    return key


_SPECIAL = RESERVED_NAMES | {".", ".."}


def _plain(value: Any, depth: int = 0) -> bool:
    """True if `value` is JSON that strict JSON can hold (finite numbers, str keys, not too deeply nested)."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if depth >= MAX_TREE_DEPTH:
        raise StateError(f"a value in the state is nested more than {MAX_TREE_DEPTH} levels deep")
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _copied(value: Any) -> Any:
    """A copy of a plain value (`_plain`): what the caller changes after a save began is not what it saves (an
    async save writes the tree in the background, after training went on)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copied(v) for v in value]
    return value  # (None, bool, int, float, str: immutable)


def flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split a state into its JSON tree (its plain values copied) and its tensors, keyed by atom path ('a/b/c')."""
    if not isinstance(state, dict):
        raise StateError(f"a state must be a dict, got {type(state).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    return _encode(state, [], tensors), tensors


def _encode(value: Any, path: list[str], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`value`'s node, its tensors added to `tensors` (a function of the module, as `_decode`)."""

    def where() -> str:  # (what to call this place in an error; made only then)
        return "state[" + "][".join(repr(p) for p in path) + "]" if path else "state"

    if len(path) >= MAX_TREE_DEPTH:
        raise StateError(f"{where()[:200]}...: the state is nested more than {MAX_TREE_DEPTH} levels deep")
    if isinstance(value, torch.Tensor):
        if not path:
            raise StateError("a tensor needs a key: the state itself must be a dict")
        atom = "/".join(path)
        if len(atom) > MAX_ATOM_PATH_BYTES // 4 and len(atom.encode(errors="surrogatepass")) > MAX_ATOM_PATH_BYTES:
            raise StateError(f"{where()[:200]}: the atom path is longer than {MAX_ATOM_PATH_BYTES} bytes")
        dense = value.layout == torch.strided and value.device.type != "meta"
        tensors[atom] = value if dense else dtypes.check_dense(value, where())
        return {"atom": atom}
    if isinstance(value, np.generic) and isinstance(value.item(), (bool, int, float)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, dict):
        if path and _plain(value, len(path)):
            return {"value": _copied(value)}
        return {"dict": {check_key(k, where): _encode(v, [*path, k], tensors) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        if _plain(value, len(path)):
            return {"value": _copied(value)}
        return {"list": [_encode(v, [*path, str(i)], tensors) for i, v in enumerate(value)]}
    if _plain(value):
        return {"value": value}
    raise StateError(
        f"{where()}: values of type {type(value).__module__}.{type(value).__qualname__} cannot be saved; "
        "leaves must be torch tensors or JSON values (None, bool, int, float, str, lists and dicts of them)"
    )


def unflatten(tree: dict[str, Any], tensors: dict[str, torch.Tensor], *, checked: bool = False) -> dict[str, Any]:
    """Rebuild the state from its tree and loaded tensors (the tree checked here, unless the caller `checked` it with
    `check_root` and `tree_atoms`)."""
    if not checked:
        check_root(tree)
        tree_atoms(tree)
    return _decode(tree, tensors)


def _decode(node: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    # (a function of the module, not a closure: a closure that calls itself is a reference cycle, which would keep
    # `tensors`, every tensor of the load, alive after the caller dropped them, until the cyclic GC ran)
    ((kind, body),) = node.items()
    if kind == "value":
        # (a copy: the tree is the reader's, which a later load of the same reader decodes again; the caller's changes
        # to what it loaded, an optimizer's param groups say, must not become what that load returns)
        return _copied(body)
    if kind == "atom":
        return tensors[body]
    if kind == "dict":
        return {k: _decode(v, tensors) for k, v in body.items()}
    if kind == "list":
        return [_decode(v, tensors) for v in body]
    return float(body)  # "float"


@dataclass
class Matched:
    """A caller's state matched against a saved tree (`match`): its tensor at each atom path, and the other values
    the load sets in it (container, key, saved value), once the tensors are filled."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    values: list[tuple[Any, Any, Any]] = field(default_factory=list)

    def set_values(self) -> None:
        for container, key, value in self.values:
            container[key] = value


def match(tree: dict[str, Any], into: Any) -> Matched:
    """Where a load into the caller's state `into` puts each saved atom and value: `into` must have the structure
    saved (the same keys at every level, lists of the same lengths, a tensor wherever an atom is; a tuple where a list
    was saved), else a StateError naming the first key that differs. Nothing of `into` is changed here. JSON values
    are set where the caller holds a dict or list (a tuple keeps its own); a dict saved whole as one JSON value is
    replaced whole."""
    check_root(tree)
    tree_atoms(tree)  # (checked without recursing: the walk may recurse)
    if not isinstance(into, dict):
        raise StateError(f"cannot load into a {_kind(into)}: a state is a dict")
    out = Matched()
    _walk(tree, into, "state", None, None, out)
    return out


def _walk(node: dict[str, Any], dest: Any, where: str, parent: Any, key: Any, out: Matched) -> None:
    """Match `node` against `dest` into `out` (a function of the module, as `_decode`)."""
    ((kind, body),) = node.items()
    if kind == "atom":
        if not isinstance(dest, torch.Tensor):
            raise StateError(f"cannot load into {where}: the checkpoint holds a tensor there, not a {_kind(dest)}")
        out.tensors[body] = dest
    elif kind == "dict":
        if not isinstance(dest, dict):
            raise StateError(f"cannot load into {where}: the checkpoint holds a dict there, not a {_kind(dest)}")
        missing = [k for k in body if k not in dest]
        extra = [k for k in dest if k not in body]
        if missing or extra:
            what = f"lacks the key {missing[0]!r}" if missing else f"has a key {extra[0]!r} the checkpoint lacks"
            raise StateError(f"cannot load into {where}: it {what}")
        for k, child in body.items():
            _walk(child, dest[k], f"{where}[{k!r}]", dest, k, out)
    elif kind == "list":
        if not isinstance(dest, (list, tuple)) or len(dest) != len(body):
            raise StateError(
                f"cannot load into {where}: the checkpoint holds a list of {len(body)} there, not a "
                f"{_kind(dest)}{f' of {len(dest)}' if isinstance(dest, (list, tuple)) else ''}"
            )
        for i, child in enumerate(body):
            _walk(child, dest[i], f"{where}[{i}]", dest, i, out)
    else:  # a JSON value (or a non-finite float)
        if isinstance(dest, torch.Tensor):
            raise StateError(f"cannot load into {where}: the checkpoint holds a value there, not a tensor")
        if not isinstance(parent, tuple):  # (a copy of the reader's tree, as `_decode` makes)
            out.values.append((parent, key, _copied(body) if kind == "value" else float(body)))


def _kind(value: object) -> str:
    return "tensor" if isinstance(value, torch.Tensor) else type(value).__name__


_BODY_TYPES = {"dict": dict, "list": list, "atom": str}


def check_root(tree: Any) -> None:
    if not (isinstance(tree, dict) and len(tree) == 1 and isinstance(tree.get("dict"), dict)):
        raise FormatError("the state tree's root is not a dict node")


def tree_atoms(tree: Any) -> list[str]:
    """Atom paths referenced by a (sub)tree, in tree order; a FormatError for any malformed node, an atom named
    twice, or nesting deeper than the format allows (checked without recursion, so that `unflatten` can recurse safely afterwards)."""
    out: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise FormatError(f"the state tree is nested more than {MAX_TREE_DEPTH} levels deep")
        if not isinstance(node, dict) or len(node) != 1:
            raise FormatError(f"state tree node {node!r:.100} is malformed")
        ((kind, body),) = node.items()
        if kind in _BODY_TYPES and not isinstance(body, _BODY_TYPES[kind]):
            raise FormatError(f"state tree node {kind!r} holds a {type(body).__name__}")
        if kind == "atom":
            if body in seen:  # (every key of a saved state is an atom of its own: two would share one tensor)
                raise FormatError(f"the state tree names atom {body!r:.200} twice")
            seen.add(body)
            out.append(body)
        elif kind == "dict":
            stack += [(v, depth + 1) for v in reversed(body.values())]
        elif kind == "list":
            stack += [(v, depth + 1) for v in reversed(body)]
        elif kind == "float" and body not in ("nan", "inf", "-inf"):
            raise FormatError(f"state tree float node {body!r:.40} is not nan, inf or -inf")
        elif kind not in ("value", "float"):
            raise FormatError(f"state tree node kind {kind!r:.40} is unknown")
    return out
