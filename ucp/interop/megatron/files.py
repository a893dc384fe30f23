"""Megatron's torch.save files (rank files, distrib_optim.pt, torch_dist's common.pt) read safely and lazily.

Files are untrusted input: they are unpickled with torch's weights-only unpickler and an allowlist of the few
non-tensor types Megatron stores (its args' Namespace, TE's extra state, NumPy's RNG state, a few Megatron enums,
rebuilt as `ForeignEnum` so that loading never imports Megatron). The tensors that grow with the model stay meta
tensors, read from the file only when asked for (`torch_file.TorchFile.read`), so that no file is ever wholly in
memory.
"""

from __future__ import annotations

import argparse
import enum
import io
import pickle
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InteropError
from ..torch_file import TorchFile


@dataclass(frozen=True)
class ForeignEnum:
    """An enum member from Megatron's args (e.g. AttnBackend.auto), kept by qualified name and value so that
    loading never imports Megatron."""

    qualname: str
    value: Any


def _foreign_enum(qualname: str) -> Callable[[Any], ForeignEnum]:
    def make(value: Any) -> ForeignEnum:
        return ForeignEnum(qualname, value)

    return make


_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnMaskType",
)


def _allowlist() -> list[Any]:
    """The only globals a rank file may name: argparse.Namespace (args), BytesIO (TE extra state), NumPy's
    array reconstruction (the NumPy RNG state) and a few Megatron enums, rebuilt as ForeignEnum."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    allowed: list[Any] = [
        argparse.Namespace,
        io.BytesIO,
        (_reconstruct, "numpy.core.multiarray._reconstruct"),
        _reconstruct,
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        type(np.dtype(np.float64)),
    ]
    allowed += [(_foreign_enum(q), q) for q in _ENUMS]
    return allowed


def is_model_chunk(key: Any) -> bool:
    """A model chunk's entry of a rank file: "model", or "model0", "model1", ... with virtual pipelining."""
    return isinstance(key, str) and (key == "model" or re.fullmatch(r"model\d+", key) is not None)


def _per_element(path: tuple[Any, ...], t: torch.Tensor) -> bool:
    """Whether a tensor at `path` of a rank file is per-element state (weights, optimizer states, master weights),
    whose size grows with the model; everything else (0-d steps, grad scaler, RNG states) is small."""
    return is_model_chunk(path[0]) or (path[0] == "optimizer" and t.dim() > 0 and "grad_scaler" not in path)


def _resolve(
    tree: Any, file: TorchFile, lazy: Callable[[tuple[Any, ...], torch.Tensor], bool], path: tuple[Any, ...] = ()
) -> Any:
    """`tree` with every meta tensor that `lazy` does not keep read from `file`."""
    if isinstance(tree, torch.Tensor):
        return file.read(tree) if tree.device.type == "meta" and not lazy(path, tree) else tree
    if isinstance(tree, dict):
        return type(tree)((k, _resolve(v, file, lazy, (*path, k))) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and type(tree) in (list, tuple):
        return type(tree)(_resolve(v, file, lazy, (*path, i)) for i, v in enumerate(tree))
    return tree


def open_torch_file(
    path: Path, lazy: Callable[[tuple[Any, ...], torch.Tensor], bool] = _per_element
) -> tuple[Any, TorchFile]:
    """Unpickle a torch.save file of Megatron's with weights_only=True (nothing outside the allowlist is executed).
    The tensors `lazy` picks (by default the per-element ones) stay meta tensors, read on demand with
    `TorchFile.read`; the rest is read now."""
    try:
        with torch.serialization.safe_globals(_allowlist()):
            file = TorchFile(path)
        data = _resolve(file.obj, file, lazy) if isinstance(file.obj, (dict, list)) else file.obj
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        unsupported = next((line for line in first if "Unsupported global" in line), first[0] if first else "")
        raise InteropError(
            f"{path}: refused to unpickle a type outside the allowlist ({unsupported.strip()})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise InteropError(f"{path} is not a readable torch checkpoint: {e}") from None
    return data, file


def open_rank_file(path: Path) -> tuple[dict[str, Any], TorchFile]:
    """One rank file (`open_torch_file`), checked to hold a model state dict."""
    data, file = open_torch_file(path)
    if not isinstance(data, dict) or not any(is_model_chunk(k) for k in data):
        raise InteropError(
            f"{path} holds no 'model' state dict (keys: {sorted(data) if isinstance(data, dict) else type(data).__name__})"
        )
    return data, file


def load_rank_file(path: Path) -> dict[str, Any]:
    """One rank file read whole, like torch.load(weights_only=True) with the allowlist."""
    data, file = open_rank_file(path)
    return _resolve(data, file, lambda _path, _t: False)


def real_enum(e: ForeignEnum) -> Any:
    """Give Megatron its enum back when it is importable (already imported); else the plain value."""
    module, _, name = e.qualname.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    return cls(e.value) if isinstance(cls, type) and issubclass(cls, enum.Enum) else e.value
