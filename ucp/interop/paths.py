"""The data files a foreign checkpoint's own index names (an HF weight_map, DCP's and torch_dist's `.metadata`):
plain file names beside the index, nothing else, so that a hostile index never has a read follow a path elsewhere."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .errors import InteropError

_PLAIN = re.compile(r"[A-Za-z0-9_.-]+")


def file_beside(index: Path, name: Any, what: str) -> Path:
    """The file `name` in `index`'s directory, where `name` (what `index` says of `what`) is a plain file name: not a
    path, not `.` or `..`; an InteropError naming the index otherwise."""
    if not isinstance(name, str) or not _PLAIN.fullmatch(name) or name in (".", ".."):
        raise InteropError(f"{index}: {what} names the data file {name!r:.80}, not a file beside it")
    return index.parent / name
