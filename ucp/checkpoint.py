"""Save and load one step: plan the atoms, move the chunks (many in flight), commit, verify on read.

Planning (which atoms, how they are chunked) is separate from storage (how bytes move, `ucp.storage`);
the commit protocol lives in `ucp.commit`, the on-disk documents in `ucp.format`.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch

from . import __version__, codec, commit, dtypes, tree
from .boxes import Box, to_slices
from .chunking import ChunkingPolicy, choose_chunks
from .errors import FormatError, IntegrityError, StepExistsError
from .format import (
    FORMAT_VERSION,
    ZARR_JSON,
    AtomMeta,
    StepManifest,
    chunk_indices,
    dumps,
    loads,
    step_dirname,
)
from .pipeline import ChunkJob, SavePipeline, SavePlan
from .storage import Storage, open_storage
from .workpool import run_tasks

DEFAULT_IO_THREADS = 16  # requests in flight on local files (object stores: Storage.default_io_threads)


@dataclass(frozen=True)
class SaveOptions:
    chunking: ChunkingPolicy = field(default_factory=ChunkingPolicy)
    io_threads: int | None = None  # requests in flight; None: the storage's default (16 local, 64 object stores)
    fsync: bool = True  # local files: fsync every object and new directory before the commit


def io_threads_for(options: SaveOptions, storage: Storage) -> int:
    return options.io_threads or storage.default_io_threads


def default_role(path: str) -> str:
    """The role an atom plays, from the conventional top-level keys (docs/FORMAT.md)."""
    if path.startswith("model/"):
        return "param"
    if path.startswith("optimizer/"):
        return "optimizer_state"
    if path.startswith("rng/"):
        return "rng"
    return "tensor"


def plan_atoms(
    tensors: Mapping[str, torch.Tensor],
    policy: ChunkingPolicy,
    attributes: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[AtomMeta]:
    """Describe every tensor as an atom; raises StateError for unsupported dtypes before anything is written."""
    metas = []
    for path, t in tensors.items():
        name = dtypes.zarr_name(t.dtype)
        chunk_shape, inner = choose_chunks(tuple(t.shape), t.element_size(), policy)
        attrs = {"role": default_role(path), **dict((attributes or {}).get(path, {}))}
        metas.append(AtomMeta(path, tuple(t.shape), name, chunk_shape, inner, attrs))
    return metas


# ------------------------------------------------------------------------------------------------ write


def commit_step(storage: Storage, manifest: StepManifest) -> commit.CommitRecord:
    """Write the step's manifest, make everything durable, then write the commit marker."""
    manifest_bytes = dumps(manifest.to_group_json())
    storage.write(f"{step_dirname(manifest.step)}/{ZARR_JSON}", [manifest_bytes])
    storage.flush()
    nbytes = sum(a.nbytes for a in manifest.atoms.values())
    return commit.write_marker(storage, manifest.step, manifest_bytes, len(manifest.atoms), nbytes)


def ensure_root(storage: Storage) -> None:
    """Make the root a Zarr group that says what it is (written once; identical content if raced)."""
    if not storage.exists(ZARR_JSON):
        doc = {"zarr_format": 3, "node_type": "group", "attributes": {"ucp": {"kind": "root", "format_version": FORMAT_VERSION}}}
        storage.write(ZARR_JSON, [dumps(doc)])


def next_step(storage: Storage) -> int:
    steps = commit.committed_steps(storage)
    return steps[-1] + 1 if steps else 0


def prepare_step(storage: Storage, step: int) -> None:
    """Refuse to overwrite a committed step; clear the leftovers of an interrupted save of the same step."""
    if commit.read_marker(storage, step) is not None:
        raise StepExistsError(f"step {step} is already committed at {storage.url}; committed steps are never overwritten")
    storage.delete(step_dirname(step))


def chunk_jobs(metas: Iterable[AtomMeta], tensors: Mapping[str, torch.Tensor]) -> list[ChunkJob]:
    """Every chunk object of atoms held whole in `tensors` (keyed by atom path)."""
    return [ChunkJob(m, i, _view(tensors[m.path], m.chunk_box(i))) for m in metas for i in chunk_indices(m.grid)]


def _view(tensor: torch.Tensor, box: Box) -> Callable[[], torch.Tensor]:
    return lambda: tensor[to_slices(box)]


def group_paths(metas: Iterable[AtomMeta]) -> list[str]:
    """Every intermediate group (dict level) that holds an atom, parents first."""
    paths = [m.path for m in metas]
    groups = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
    return sorted(groups, key=lambda g: (g.count("/"), g))


def plan_save(
    state: dict[str, Any],
    storage: Storage,
    step: int | None,
    options: SaveOptions,
    *,
    layout: str | None = None,
    atom_attributes: Mapping[str, Mapping[str, Any]] | None = None,
) -> SavePlan:
    """The plan of a single-process save: every atom and chunk, then the commit. Bad states are refused here,
    before anything is written."""
    json_tree, tensors = tree.flatten(state)
    tensors = {p: t.detach() if t.is_cuda else t.detach().contiguous() for p, t in tensors.items()}
    metas = plan_atoms(tensors, options.chunking, atom_attributes)
    step = next_step(storage) if step is None else int(step)
    prepare_step(storage, step)
    ensure_root(storage)
    manifest = StepManifest(
        step=step,
        tree=json_tree,
        atoms={m.path: m for m in metas},
        layout=layout,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        writer=f"ucp {__version__}",
    )
    return SavePlan(storage, step, metas, group_paths(metas), chunk_jobs(metas, tensors), lambda: commit_step(storage, manifest))


def save(
    state: dict[str, Any],
    url: str,
    *,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    layout: str | None = None,
    options: SaveOptions | None = None,
    atom_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    storage: Storage | None = None,
) -> commit.CommitRecord:
    """Save `state` (nested dict of tensors and JSON values) as step `step` of the checkpoint root `url`.

    `step=None` takes the step after the latest committed one (0 for an empty root). The step becomes
    visible only when its commit marker is written, after all its data is durable.
    """
    options = options or SaveOptions()
    storage = storage or open_storage(url, storage_options, fsync=options.fsync)
    plan = plan_save(state, storage, step, options, layout=layout, atom_attributes=atom_attributes)
    pipeline = SavePipeline(io_threads_for(options, storage))
    try:
        record = pipeline.submit(plan, "sync").result()
    finally:
        pipeline.close()
    assert record is not None
    return record


# ------------------------------------------------------------------------------------------------- read


class CheckpointReader:
    """One committed step, opened for reading: its manifest, and verified reads of its atoms."""

    def __init__(self, storage: Storage, step: int | str | None = "latest", *, io_threads: int | None = None):
        self.storage = storage
        self.step, self.record = commit.resolve_step(storage, step)
        self.prefix = step_dirname(self.step)
        where = f"{storage.url}/{self.prefix}/{ZARR_JSON}"
        manifest_bytes = commit.read_manifest_bytes(storage, self.step, self.record)
        self.manifest = StepManifest.from_group_json(loads(manifest_bytes, where), where)
        if self.manifest.step != self.step:
            raise FormatError(f"{where} describes step {self.manifest.step}, not {self.step}")
        missing = set(tree.tree_atoms(self.manifest.tree)) - set(self.manifest.atoms)
        if missing:
            raise FormatError(f"{where}: the state tree names atoms the manifest lacks: {sorted(missing)[:5]}")
        self.io_threads = io_threads or storage.default_io_threads

    @property
    def atoms(self) -> dict[str, AtomMeta]:
        return self.manifest.atoms

    def _atom_key(self, meta: AtomMeta, name: str) -> str:
        return f"{self.prefix}/{meta.path}/{name}"

    def check_atom_metadata(self, meta: AtomMeta) -> None:
        """The atom's zarr.json must exist and agree with the committed manifest (what other Zarr readers see)."""
        try:
            raw = self.storage.read(self._atom_key(meta, ZARR_JSON))
        except FileNotFoundError:
            raise IntegrityError(f"atom {meta.path!r} is missing from step {self.step} (no {meta.path}/{ZARR_JSON})") from None
        meta.check_zarr_json(loads(bytes(raw), f"atom {meta.path!r} {ZARR_JSON}"))

    def read_chunk_into(self, meta: AtomMeta, index: tuple[int, ...], out: torch.Tensor) -> None:
        """Read, verify and decode one stored object into `out` (the full atom's tensor)."""
        key = meta.chunk_key(index)
        where = f"atom {meta.path!r} chunk {key} (step {self.step})"
        codec.read_object(self.storage, self._atom_key(meta, key), meta, index, codec.full_region(out), where)

    def read_atoms(self, paths: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read whole atoms, every chunk verified; many objects in flight.

        Reads are planned from the committed manifest alone (its checksum is in the commit marker), so an atom's
        own zarr.json, which only other Zarr readers need, is not read here: `ucp verify` checks that it agrees."""
        metas = [self.atoms[p] for p in paths]
        out = {m.path: torch.empty(m.shape, dtype=dtypes.torch_dtype(m.dtype)) for m in metas}
        tasks = [functools.partial(self.read_chunk_into, m, i, out[m.path]) for m in metas for i in chunk_indices(m.grid)]
        with cf.ThreadPoolExecutor(self.io_threads) as pool:
            run_tasks(pool, tasks)
        return out

    def load_state(self) -> dict[str, Any]:
        return tree.unflatten(self.manifest.tree, self.read_atoms(tree.tree_atoms(self.manifest.tree)))

    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.atoms.values())

    def chunk_count(self) -> int:
        return sum(math.prod(m.grid) for m in self.atoms.values())


def open_checkpoint(
    url: str, step: int | str | None = "latest", *, storage_options: dict[str, Any] | None = None
) -> CheckpointReader:
    """Open a committed step for reading. `url` is a checkpoint root, or a step directory inside one."""
    root, _, last = url.rstrip("/").rpartition("/")
    from .format import parse_step_dirname

    named = parse_step_dirname(last) if root else None
    if named is not None and step in (None, "latest"):
        url, step = root, named
    return CheckpointReader(open_storage(url, storage_options), step)


def load(url: str, *, step: int | str | None = "latest", storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load a committed step as the nested dict it was saved from (tensors on CPU, bitwise identical)."""
    return open_checkpoint(url, step, storage_options=storage_options).load_state()
