"""ucp: universal checkpoints (Zarr v3 over fsspec) that reshard to any parallel layout.

The names below are imported on first use (PEP 562), so that `import ucp.cli` (the `ucp` command) does not pay for
torch and zarr before it knows which command it runs: `ucp --help` and an argument error answer at once.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from .version import __version__ as __version__

# name -> the module that defines it
_EXPORTS = {
    "CheckpointReader": "engine.checkpoint",
    "SaveOptions": "engine.checkpoint",
    "load": "engine.checkpoint",
    "open_checkpoint": "engine.checkpoint",
    "save": "engine.checkpoint",
    "ChunkingPolicy": "base.chunking",
    "register_bfloat16_with_zarr": "base.dtypes",
    "BucketNotFoundError": "errors",
    "CheckpointNotFoundError": "errors",
    "FormatError": "errors",
    "IntegrityError": "errors",
    "LayoutError": "errors",
    "NonExclusiveStoreError": "errors",
    "NotAFileError": "errors",
    "ObjectMissingError": "errors",
    "PeerLostError": "errors",
    "ReadOnlyStorageError": "errors",
    "StateError": "errors",
    "StepExistsError": "errors",
    "StepRemovedError": "errors",
    "StorageAuthError": "errors",
    "StorageError": "errors",
    "StorageUnreachableError": "errors",
    "UcpError": "errors",
    "UnsupportedVersionError": "errors",
    "WriterProcessError": "errors",
    "CheckpointManager": "manager",
    "restore_training_state": "training_state",
    "training_state": "training_state",
}

if TYPE_CHECKING:
    from .base.chunking import ChunkingPolicy
    from .base.dtypes import register_bfloat16_with_zarr
    from .engine.checkpoint import CheckpointReader, SaveOptions, load, open_checkpoint, save
    from .errors import (
        BucketNotFoundError,
        CheckpointNotFoundError,
        FormatError,
        IntegrityError,
        LayoutError,
        NonExclusiveStoreError,
        NotAFileError,
        ObjectMissingError,
        PeerLostError,
        ReadOnlyStorageError,
        StateError,
        StepExistsError,
        StepRemovedError,
        StorageAuthError,
        StorageError,
        StorageUnreachableError,
        UcpError,
        UnsupportedVersionError,
        WriterProcessError,
    )
    from .manager import CheckpointManager
    from .training_state import restore_training_state, training_state


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ucp' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # (the next access is a plain lookup)
    return value


class _Package(types.ModuleType):
    """The package, whose exported names win over its submodules of the same name: importing the submodule
    `ucp.training_state` sets the package's attribute `training_state` to it (the import system does so after every
    submodule import), and `ucp.training_state(...)` must stay the function, as when the exports were eager."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{_EXPORTS.get(name)}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "BucketNotFoundError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "ChunkingPolicy",
    "FormatError",
    "IntegrityError",
    "LayoutError",
    "NonExclusiveStoreError",
    "NotAFileError",
    "ObjectMissingError",
    "PeerLostError",
    "ReadOnlyStorageError",
    "SaveOptions",
    "StateError",
    "StepExistsError",
    "StepRemovedError",
    "StorageAuthError",
    "StorageError",
    "StorageUnreachableError",
    "UcpError",
    "UnsupportedVersionError",
    "WriterProcessError",
    "load",
    "open_checkpoint",
    "register_bfloat16_with_zarr",
    "restore_training_state",
    "save",
    "training_state",
]
