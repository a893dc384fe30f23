"""ucp: universal checkpoints (Zarr v3 over fsspec) that reshard to any parallel layout."""

__version__ = "0.1.0"

from .checkpoint import CheckpointReader, SaveOptions, load, open_checkpoint, save
from .chunking import ChunkingPolicy
from .dtypes import register_bfloat16_with_zarr
from .errors import (
    CheckpointNotFoundError,
    FormatError,
    IntegrityError,
    LayoutError,
    StateError,
    StepExistsError,
    StepRemovedError,
    StorageError,
    UcpError,
    UnsupportedVersionError,
    WriterProcessError,
)
from .manager import CheckpointManager
from .training_state import restore_training_state, training_state

__all__ = [
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "ChunkingPolicy",
    "FormatError",
    "IntegrityError",
    "LayoutError",
    "SaveOptions",
    "StateError",
    "StepExistsError",
    "StepRemovedError",
    "StorageError",
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
