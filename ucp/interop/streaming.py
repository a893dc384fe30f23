"""Conversions that stream within a memory budget: the tensors move in groups, the next group is read while the
current one is written, and nothing ever holds the whole model.

`--memory-budget` bounds the tensor memory of a conversion. Two groups are alive at once (one being read, one
being written), and a group may briefly take twice its size while it is read (a mapped file's pages and the
copy) or cast, so a group holds at most a quarter of the budget. A single tensor larger than that is a group
of its own: the budget can never go below the largest tensor a format stores whole.

`save_atoms` writes a weights (and optimizer state) checkpoint in layout tp1pp1 (every atom whole on one rank,
as `VirtualWorld(1).save` would write it) one group of atoms at a time; the step becomes visible only at its
commit, after every group is durable.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from ..base import dtypes, heap
from ..distributed.sharded_model import AtomKey, ShardedModel, atom_metas
from ..distributed.sharded_save import manifest_for
from ..engine.checkpoint import SaveOptions, chunk_jobs, group_paths
from ..engine.pipeline import ChunkJob, SavePipeline, SavePlan
from ..format.manifest import AtomMeta
from ..protocol.session import SaveSession, remove_unused_root
from ..storage import open_storage

DEFAULT_MEMORY_BUDGET = 4 << 30
DEFAULT_WORKERS = 8

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def group_limit(memory_budget: int) -> int:
    """The most tensor bytes one group may hold (see the module docstring for the factor of four)."""
    return max(1, memory_budget // 4)


def pipelined(loads: Sequence[Callable[[], T]], consume: Callable[[T], None]) -> None:
    """consume(load()) for each load in order, the next load running in a background thread meanwhile: at most
    two results are alive at once (the one consumed and the one being loaded)."""
    if not loads:
        return
    with cf.ThreadPoolExecutor(1, thread_name_prefix="ucp-prefetch") as pool:
        pending = pool.submit(loads[0])
        for i in range(len(loads)):
            current = pending.result()  # drops the previous result
            if i + 1 < len(loads):
                pending = pool.submit(loads[i + 1])
            consume(current)
            del current
            heap.trim()  # (the group's freed buffers: glibc would keep them resident, fragmented, group after group)


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write(
    pipeline: SavePipeline, session: SaveSession, metadata: list[AtomMeta], groups: list[str], chunks: list[ChunkJob]
) -> None:
    """Write array metadata, group metadata and chunk objects: a sync save of part of a step, without commit."""
    pipeline.submit(SavePlan(session, metadata, groups, chunks, commit=False), "sync")


def save_atoms(
    url: str,
    groups: Sequence[Callable[[], dict[AtomKey, torch.Tensor]]],
    *,
    step: int,
    model: ShardedModel,
    dtype_of: Mapping[str | None, torch.dtype],
    extra: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
    workers: int = DEFAULT_WORKERS,
    progress: bool = False,
) -> int:
    """Write step `step` of `url` in layout tp1pp1 from `groups`: callables that each load some of the model's
    atoms ({(atom, optimizer state or None): full tensor}), together every atom of `model` exactly once. Values
    are cast to `dtype_of[state]` (or, for a parameter atom named in `dtype_of`, to its own). A group is read
    while the previous one is written; a failure leaves no committed step (and removes what was written).
    Returns the atom bytes written."""
    if model.layout.world_size != 1:
        raise ValueError(f"save_atoms writes layout tp1pp1, not {model.layout}")
    options = SaveOptions(io_threads=workers)
    metas = atom_metas(model, {s: dtypes.zarr_name(d) for s, d in dtype_of.items()}, options.chunking)
    manifest, extra_chunks = manifest_for(model, metas, extra, step, options.chunking)
    storage = open_storage(url, storage_options, fsync=options.fsync)
    pipeline = SavePipeline(workers)
    written: set[AtomKey] = set()
    bar = progress_bar(sum(m.nbytes for m in metas.values()), "write atoms", progress)

    def write_group(session: SaveSession, tensors: dict[AtomKey, torch.Tensor]) -> None:
        for key, t in tensors.items():
            meta = metas.get(key)
            if meta is None or key in written or tuple(t.shape) != meta.shape:
                raise AssertionError(f"atom {key} is unknown, repeated or misshapen")  # the callers check sources first
        by_path = {metas[k].path: t.to(dtypes.torch_dtype(metas[k].dtype)).contiguous() for k, t in tensors.items()}
        group_metas = [metas[k] for k in tensors]
        _write(pipeline, session, group_metas, [], chunk_jobs(group_metas, by_path))
        written.update(tensors)
        bar.update(sum(m.nbytes for m in group_metas))

    fresh = not storage.root_exists() or not storage.listdir("")
    try:
        with SaveSession.begin(storage, step) as session:  # a failure removes what the attempt wrote
            model_paths = {m.path for m in metas.values()}
            extra_metas = [m for path, m in manifest.atoms.items() if path not in model_paths]
            _write(pipeline, session, extra_metas, group_paths(manifest.atoms.values()), extra_chunks)
            pipelined(groups, functools.partial(write_group, session))
            if written != set(metas):
                raise AssertionError(f"atoms never written: {sorted(set(metas) - written)[:5]}")
            session.finish(manifest)
    except BaseException:
        if fresh:  # (an import into a new destination leaves none behind)
            remove_unused_root(storage)
        raise
    finally:
        pipeline.close()
        bar.close()
    return sum(m.nbytes for m in metas.values())
