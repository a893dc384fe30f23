"""What `ucp inspect` and `ucp verify` report about a committed step."""

from __future__ import annotations

import concurrent.futures as cf
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from . import dtypes
from .checkpoint import CheckpointReader
from .errors import FormatError, IntegrityError
from .format import chunk_indices


def describe(reader: CheckpointReader) -> dict[str, Any]:
    """Step, format version, layout and every atom (name, role, shape, dtype, bytes, chunks), with totals."""
    atoms = [
        {
            "name": m.path,
            "role": m.attributes.get("role", "tensor"),
            "shape": list(m.shape),
            "dtype": m.dtype,
            "bytes": m.nbytes,
            "chunks": math.prod(m.grid),
            "inner_chunks": math.prod(m.grid) * math.prod(m.inner_grid),
        }
        for m in reader.atoms.values()
    ]
    return {
        "url": reader.storage.url,
        "step": reader.step,
        "format_version": reader.manifest.format_version,
        "layout": reader.manifest.layout,
        "created_at": reader.manifest.created_at,
        "committed_at": reader.record.committed_at,
        "writer": reader.manifest.writer,
        "atoms": atoms,
        "totals": {"atoms": len(atoms), "bytes": sum(a["bytes"] for a in atoms), "chunks": sum(a["chunks"] for a in atoms)},
    }


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def format_table(info: dict[str, Any]) -> str:
    lines = [
        f"checkpoint  {info['url']}",
        f"step        {info['step']}",
        f"format      UCP {info['format_version']}  (written by {info['writer'] or 'unknown'}, committed {info['committed_at']})",
        f"layout      {info['layout'] or '-'}",
        "",
    ]
    header = ("atom", "role", "shape", "dtype", "bytes", "chunks")
    rows = [(a["name"], a["role"], "x".join(map(str, a["shape"])) or "scalar", a["dtype"], _human(a["bytes"]), str(a["chunks"])) for a in info["atoms"]]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:{'>' if i >= 4 else '<'}{w}}}" for i, w in enumerate(widths))
    lines += [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    t = info["totals"]
    lines += ["", f"total       {t['atoms']} atoms, {_human(t['bytes'])} ({t['bytes']} bytes), {t['chunks']} chunk objects"]
    return "\n".join(lines)


@dataclass
class VerifyReport:
    step: int
    atoms: int
    chunks: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(reader: CheckpointReader) -> VerifyReport:
    """Re-read every chunk of every atom and check every checksum; collect every problem, not just the first."""
    problems: list[str] = []
    tasks = []
    for meta in reader.atoms.values():
        out = torch.empty(meta.shape, dtype=dtypes.torch_dtype(meta.dtype))
        tasks.append(lambda m=meta: reader.check_atom_metadata(m))
        tasks += [lambda m=meta, i=i, o=out: reader.read_chunk_into(m, i, o) for i in chunk_indices(meta.grid)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        with cf.ThreadPoolExecutor(reader.io_threads) as pool:
            for future in [pool.submit(t) for t in tasks]:
                try:
                    future.result()
                except (IntegrityError, FormatError) as e:
                    problems.append(str(e))
    chunks = sum(math.prod(m.grid) for m in reader.atoms.values())
    return VerifyReport(reader.step, len(reader.atoms), chunks, problems)
