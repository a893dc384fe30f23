"""ucp: universal checkpoints (Zarr v3 over fsspec) that reshard to any parallel layout."""

__version__ = "0.1.0"

from .checkpoint import CheckpointReader, SaveOptions, load, open_checkpoint, save  # noqa: E402
from .chunking import ChunkingPolicy  # noqa: E402
from .dtypes import register_bfloat16_with_zarr  # noqa: E402
from .manager import CheckpointManager  # noqa: E402
from .training_state import restore_training_state, training_state  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointNotFoundError,
    FormatError,
    IntegrityError,
    LayoutError,
    StateError,
    StepExistsError,
    UcpError,
    UnsupportedVersionError,
)

register_bfloat16_with_zarr()

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
    "UcpError",
    "UnsupportedVersionError",
    "load",
    "open_checkpoint",
    "restore_training_state",
    "save",
    "training_state",
]
