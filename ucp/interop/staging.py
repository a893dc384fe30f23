"""Local output directories that appear whole or not at all.

A foreign format (safetensors, Megatron, DCP) has no commit marker of its own, so we write into a hidden
sibling directory and rename it into place only after every file is durable; on failure the sibling is
removed. A rename inside one directory is atomic on POSIX, so DST is never seen half-written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import DestinationExistsError


def check_destination(dst: str | os.PathLike) -> Path:
    """DST must be absent or an empty directory."""
    path = Path(dst)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise DestinationExistsError(f"destination {path} already exists and is not empty; choose a new directory")
    return path


def check_apart(source: str, destination: str) -> None:
    """A conversion's output neither inside its source nor holding it (local paths; URLs are left to their store):
    an export into a committed step's directory would go with the step at its retention, and a source below its
    output would be read while written."""
    if any("://" in p and not p.startswith("file://") for p in (source, destination)):
        return
    src, dst = (Path(p.removeprefix("file://")).resolve() for p in (source, destination))
    if dst != src and dst.is_relative_to(src):
        relation = "lies inside"
    elif dst == src or src.is_relative_to(dst):
        relation = "is or holds"
    else:
        return
    raise DestinationExistsError(f"destination {destination} {relation} the source {source}; write it elsewhere")


def fsync_tree(root: Path) -> None:
    """fsync every file and directory below root (durable before the rename publishes it)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def staged_dir(dst: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary directory next to DST; publish it as DST on success, delete it on any failure."""
    final = check_destination(dst).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if fsync:
            fsync_tree(tmp)
        if final.exists():
            final.rmdir()  # empty (checked above); rename needs it gone
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
