"""The state tree: a nested dict of tensors and JSON values <-> a JSON tree plus a flat map of atoms.

Node kinds (docs/FORMAT.md): {"dict": {key: node}}, {"list": [node]}, {"atom": path}, {"value": json} and
{"float": "nan" | "inf" | "-inf"} (strict JSON has no non-finite numbers). A subtree that holds only
plain JSON is stored as one {"value": ...} node. Tuples come back as lists.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .errors import FormatError, StateError
from .format import RESERVED_NAMES


def check_key(key: object, where: str) -> str:
    """A state key becomes a Zarr node name: refuse anything that could escape or collide."""
    if not isinstance(key, str):
        raise StateError(f"{where}: keys must be strings, got {type(key).__name__} {key!r}")
    if key in ("", ".", "..") or "/" in key or "\\" in key:
        raise StateError(f"{where}: key {key!r} would escape the checkpoint root or name no node (no '/', '\\', '.', '..' or '')")
    if key.startswith("__") or key in RESERVED_NAMES or any(ord(ch) < 32 for ch in key):
        raise StateError(f"{where}: key {key!r} is reserved (names starting with '__', {sorted(RESERVED_NAMES)}, control characters)")
    return key


def _plain(value: Any) -> bool:
    """True if `value` is JSON that strict JSON can hold (finite numbers, str keys)."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split a state into its JSON tree and its tensors, keyed by atom path ('a/b/c')."""
    if not isinstance(state, dict):
        raise StateError(f"a state must be a dict, got {type(state).__name__}")
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, path: list[str]) -> dict[str, Any]:
        where = "state[" + "][".join(repr(p) for p in path) + "]" if path else "state"
        if isinstance(value, torch.Tensor):
            if not path:
                raise StateError("a tensor needs a key: the state itself must be a dict")
            tensors["/".join(path)] = value
            return {"atom": "/".join(path)}
        if isinstance(value, np.generic) and isinstance(value.item(), (bool, int, float)):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, dict):
            if path and _plain(value):
                return {"value": value}
            return {"dict": {check_key(k, where): encode(v, [*path, k]) for k, v in value.items()}}
        if isinstance(value, (list, tuple)):
            if _plain(value):
                return {"value": list(value)}
            return {"list": [encode(v, [*path, str(i)]) for i, v in enumerate(value)]}
        if _plain(value):
            return {"value": value}
        raise StateError(
            f"{where}: values of type {type(value).__module__}.{type(value).__qualname__} cannot be saved; "
            "leaves must be torch tensors or JSON values (None, bool, int, float, str, lists and dicts of them)"
        )

    return encode(state, []), tensors


def unflatten(tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Rebuild the state from its tree and loaded tensors."""

    def decode(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1:
            raise FormatError(f"state tree node {node!r} is malformed")
        ((kind, body),) = node.items()
        if kind == "value":
            return body
        if kind == "atom":
            return tensors[body]
        if kind == "dict":
            return {k: decode(v) for k, v in body.items()}
        if kind == "list":
            return [decode(v) for v in body]
        if kind == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        raise FormatError(f"state tree node kind {kind!r} is unknown")

    state = decode(tree)
    if not isinstance(state, dict):
        raise FormatError("the state tree's root is not a dict")
    return state


def tree_atoms(tree: dict[str, Any]) -> list[str]:
    """Atom paths referenced by a tree, in tree order."""
    out: list[str] = []

    def walk(node: Any) -> None:
        ((kind, body),) = node.items()
        if kind == "atom":
            out.append(body)
        elif kind == "dict":
            for v in body.values():
                walk(v)
        elif kind == "list":
            for v in body:
                walk(v)

    walk(tree)
    return out
