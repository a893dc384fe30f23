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

from .errors import DestinationExistsError, InteropError


def local_output(dst: str | os.PathLike) -> Path:
    """DST as the local directory these outputs are (files that other tools read from a local disk: safetensors,
    DCP, Megatron's rank files, a vLLM model directory); `file://` taken off. The URL of another store is refused:
    such a path was written to a local directory named after its scheme (`s3:`) and reported as written there.
    A path made from such a URL (`Path("s3://b/x")` is `s3:/b/x`) is known by its first part, a known scheme."""
    text = os.fspath(dst)
    scheme, sep, rest = text.partition("://")
    if not sep:
        first = Path(text).parts[0] if Path(text).parts else ""
        scheme = first[:-1] if first.endswith(":") and _is_protocol(first[:-1]) else ""
        rest = text[len(first) :]
    if scheme == "file":
        return Path(rest)
    if scheme:
        raise InteropError(
            f"destination {text}: this output is a directory of files on a local disk; give a local directory, "
            f"then copy it to {scheme}:// (ucp writes its own checkpoints to any URL, not other formats' files)"
        )
    return Path(text)


def _is_protocol(name: str) -> bool:
    import fsspec

    return name in fsspec.available_protocols()


def check_destination(dst: str | os.PathLike) -> Path:
    """DST must be a local directory (`local_output`), absent or empty."""
    path = local_output(dst)
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
    tmp = final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:  # (a parent that is a file, or where nothing may be made)
        raise InteropError(f"cannot make {final}: {e.strerror or e} ({e.filename or final.parent})") from None
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
