"""A Megatron checkpoint opened as a source of conversions: its layout, model config and rank files (`MegatronSource`,
`open_megatron` for the torch format; ucp.interop.megatron.dist opens torch_dist as one of layout tp1pp1), and where
its files hold each atom (`PieceIndex`), so that any box of an atom is read from the source tensors that hold it.

A rank file's "model" dict is, name for name, the local state docs/LOCAL_STATE.md specifies (Megatron-Core GPT
naming: fused QKV per query group, gate/up in linear_fc1, padded vocabulary), so the file of (tp t, pp p, ep e)
is the local state of ucp rank (tp=t, dp=e, pp=p) in the layout tp{T}pp{P}ep{E}dp{E}: DP replicas other than the
expert ones are not saved by Megatron, and dp=E is the smallest DP that holds every expert rank. The optimizer's
per-parameter tensors are ucp local optimizer states, taken from the rank file's numbered entries
(optimizer.py) or, for the distributed optimizer, from views of the flat buffers in distrib_optim.pt beside
it (distrib_optim.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ...base.boxes import Box, intersect, relative, to_slices
from ...sharding.families import FamilyConfig
from ...sharding.layout import Layout
from ...sharding.reshard import LocalTensor, Piece, local_plan, local_tensor, owned_pieces, piece_view
from ..dtypes import Dtypes, most_common
from ..errors import InteropError, SourceMismatchError
from ..torch_file import TorchFile, TorchFiles
from .args import args_layout, bucket_size_of, check_even_stages, config_from_args
from .distrib_optim import read_distributed
from .files import is_model_chunk, open_rank_file, open_torch_file
from .optimizer import LocalOptimState, OptimizerMeta, read_optimizer
from .save import (
    DISTRIB_OPTIM_FILE,
    METADATA_JSON,
    RANK_FILE,
    is_torch_dist,
    iteration_dir,
    megatron_name,
    parse_megatron_layout,
    rank_files,
)


class TensorFile(Protocol):
    """Where a source's meta tensors are read from: a rank file (TorchFile), or a torch_dist checkpoint."""

    def read(self, t: torch.Tensor) -> torch.Tensor: ...


@dataclass
class MegatronSource:
    """A Megatron torch checkpoint opened for reading: layout, model config, and the rank files, whose per-element
    tensors are meta tensors until `read` fetches them (so no file is ever wholly in memory)."""

    root: Path
    iteration: int
    layout: Layout
    config: FamilyConfig
    args: Any
    hf: dict[str, Any]
    files: dict[int, dict[str, Any]]  # ucp rank -> unpickled rank file (per-element tensors on the meta device)
    paths: dict[int, Path]
    readers: dict[int, TensorFile]
    optimizer: OptimizerMeta | None = None  # None: the files hold no optimizer state
    optim_state: dict[int, LocalOptimState] = field(default_factory=dict)  # ucp rank -> its local optimizer state
    not_carried: tuple[str, ...] = ()  # what the source holds that no conversion carries (named in reports)

    @property
    def states(self) -> tuple[str, ...]:
        """The per-parameter optimizer states the files hold (ucp names), () without optimizer."""
        return self.optimizer.states if self.optimizer is not None else ()

    @property
    def scheduler(self) -> Any:
        """Megatron's opt_param_scheduler state (global: every rank saves the same), or None."""
        return self.files[0].get("opt_param_scheduler")

    def local_state(self, rank: int) -> dict[str, Any]:
        """The ucp local state of a rank: its model chunk dicts without Megatron's _extra_state entries, and its
        optimizer state when the files hold one."""
        data = self.files[rank]
        local: dict[str, Any] = {
            k: {n: t for n, t in data[k].items() if not n.endswith("._extra_state")} for k in data if is_model_chunk(k)
        }
        if self.optimizer is not None:
            local["optimizer"] = {"state": self.optim_state[rank]}
        return local

    def read(self, rank: int, key: tuple[str, ...]) -> torch.Tensor:
        """The values of a rank's local tensor (a LocalTensor key), read from its file."""
        tree = {"optimizer": {"state": self.optim_state.get(rank, {})}} if key[0] == "optimizer" else self.files[rank]
        return self.readers[rank].read(local_tensor(tree, key))


def _guess_layout(names: set[str], args: Any) -> str:
    return f"args say {megatron_name(args_layout(args))}; {len(names)} rank directories"


def open_megatron(
    src: str | Path, layout: str | Layout, *, iteration: int | None = None, vocab_size: int | None = None
) -> MegatronSource:
    """Open a Megatron torch checkpoint that `layout` (e.g. "tp2pp2ep2") must describe exactly."""
    root = Path(src)
    if (root / "zarr.json").is_file():
        raise SourceMismatchError(f"{root} is a ucp checkpoint, not a Megatron one: use --from universal")
    want = layout if isinstance(layout, Layout) else parse_megatron_layout(layout)
    asked = layout if isinstance(layout, str) else megatron_name(want)  # (named as the user wrote it)
    it, iter_dir = iteration_dir(root, iteration)
    if not iter_dir.is_dir():
        raise InteropError(f"{iter_dir} does not exist (iteration {it} of {root})")
    if is_torch_dist(iter_dir):
        raise SourceMismatchError(
            f"{iter_dir} is in Megatron's torch_dist format (it has {METADATA_JSON}): use --from torch_dist"
        )
    present = {d.name for d in iter_dir.iterdir() if d.name.startswith("mp_rank_")}
    expected = rank_files(want)
    if not present:
        raise InteropError(f"{iter_dir} holds no mp_rank_* directories")
    # --from is checked against the files' own args before anything else, then against the directory names
    probe = iter_dir / min(present) / RANK_FILE
    if not probe.is_file():
        raise InteropError(f"missing rank file {probe}")
    first, first_reader = open_rank_file(probe)
    args = first.get("args")
    saved = args_layout(args) if args is not None else None
    if saved is not None and saved != want:
        raise SourceMismatchError(f"--from {asked} does not match {root}: its args say {megatron_name(saved)}")
    stray = sorted(present - set(expected))
    if stray:
        raise SourceMismatchError(
            f"--from {asked} does not match {iter_dir}: unexpected rank directories "
            f"{stray[:4]} ({_guess_layout(present, args)})"
        )
    missing = sorted(set(expected) - present) + sorted(n for n in present if not (iter_dir / n / RANK_FILE).is_file())
    if missing:
        raise InteropError(
            f"{iter_dir} is incomplete: missing rank file(s) {[f'{n}/{RANK_FILE}' for n in missing[:4]]}"
            f"{' ...' if len(missing) > 4 else ''} of the {len(expected)} that {asked} has"
        )
    config, hf = config_from_args(args, str(probe), vocab_size)
    if args is not None:
        check_even_stages(args, str(probe))
    paths = {rank: iter_dir / name / RANK_FILE for name, rank in expected.items()}
    opened = {rank: ((first, first_reader) if path == probe else open_rank_file(path)) for rank, path in paths.items()}
    distrib = _open_distrib_optim(paths)
    extra_files = [f for _, f in distrib.values()]
    source = MegatronSource(
        root,
        it,
        want,
        config,
        args,
        hf,
        {r: d for r, (d, _) in opened.items()},
        paths,
        {r: TorchFiles([f, *extra_files]) if extra_files else f for r, (_, f) in opened.items()},
    )
    _check_shapes(source)
    _read_optimizer(source, {r: (data, str(f.path)) for r, (data, f) in distrib.items()})
    return source


def _open_distrib_optim(paths: dict[int, Path]) -> dict[int, tuple[Any, TorchFile]]:
    """Every rank directory's distrib_optim.pt (a distributed optimizer's state; all directories have one, or
    none), its flat tensors left on disk until read."""
    found = {rank: p.parent / DISTRIB_OPTIM_FILE for rank, p in paths.items()}
    present = {rank for rank, p in found.items() if p.exists()}
    if present and present != set(found):
        missing = found[min(set(found) - present)]
        raise InteropError(f"{missing} is missing, but other rank directories have a {DISTRIB_OPTIM_FILE}")
    return {rank: open_torch_file(found[rank], lazy=lambda _path, t: t.dim() > 0) for rank in sorted(present)}


def _read_optimizer(source: MegatronSource, distrib: dict[int, tuple[Any, str]]) -> None:
    """Map every rank's "optimizer" entry (and with a distributed optimizer, the distrib_optim.pt files: `distrib`,
    ucp rank -> content and path) to ucp local optimizer state (all ranks have one, or none)."""
    has = {rank for rank, f in source.files.items() if f.get("optimizer") is not None}
    if not has:
        if distrib:
            raise InteropError(
                f"{source.paths[min(source.files)]} has no 'optimizer' entry beside its {DISTRIB_OPTIM_FILE}"
            )
        return
    if len(has) != len(source.files):
        lacking = source.paths[min(set(source.files) - has)]
        raise InteropError(f"{lacking} has no 'optimizer' entry, but other rank files have one")
    bucket_size = bucket_size_of(source.args)
    for rank in sorted(source.files):
        entry, where = source.files[rank]["optimizer"], str(source.paths[rank])
        if distrib:
            state, meta = read_distributed(entry, distrib, source.config, source.layout, rank, bucket_size, where)
        else:
            state, meta = read_optimizer(entry, source.config, source.layout, rank, where)
        source.optim_state[rank] = state
        source.optimizer = meta if source.optimizer is None else source.optimizer.merge(meta, str(source.paths[rank]))


def _check_shapes(source: MegatronSource) -> None:
    """Every rank holds exactly the tensors (names and shapes) the layout and the args imply."""
    for rank, path in source.paths.items():
        local = source.local_state(rank)
        plan = local_plan(source.config, source.layout, rank, ())
        names = {lt.key for lt in plan}
        for lt in plan:
            chunk, name = lt.key
            t = local.get(chunk, {}).get(name)
            if t is None:
                raise InteropError(f"{path}: missing tensor {chunk}/{name}")
            if tuple(t.shape) != lt.shape:
                raise InteropError(
                    f"{path}: {chunk}/{name} has shape {list(t.shape)}, but the other ranks and the args "
                    f"imply {list(lt.shape)} for {megatron_name(source.layout)}"
                )
        extra = sorted(f"{c}/{n}" for c, tensors in local.items() for n in tensors if (c, n) not in names)
        if extra:
            raise InteropError(f"{path}: tensors ucp cannot map to {type(source.config).__name__} atoms: {extra[:4]}")


@dataclass(frozen=True)
class _Region:
    """Where a source file holds part of an atom: the atom box, and the piece of which rank's local tensor."""

    box: Box
    rank: int
    key: tuple[str, ...]  # LocalTensor key in the rank's local state
    piece: Piece


SourceCache = dict[tuple[int, tuple[str, ...]], torch.Tensor]  # (rank, key) -> source tensor read from its file


@dataclass
class PieceIndex:
    """For each (atom, state), the source regions holding it. Filling reads the source tensors it needs from
    their files into a cache the caller drops when done (one target tensor, or one group of atoms)."""

    source: MegatronSource
    regions: dict[tuple[str, str | None], list[_Region]] = field(default_factory=dict)

    @classmethod
    def of(cls, source: MegatronSource) -> PieceIndex:
        index = cls(source)
        for rank in source.files:
            for lt in owned_pieces(source.config, source.layout, rank, source.states):  # every element exactly once
                for p in lt.pieces:
                    index.regions.setdefault((p.atom, lt.state), []).append(_Region(p.atom_box, rank, lt.key, p))
        return index

    def fill_box(self, atom: str, state: str | None, box: Box, dst: torch.Tensor, cache: SourceCache) -> None:
        """Copy the elements of `box` of an atom (state) into `dst`, shaped like the box."""
        for region in self.regions[(atom, state)]:
            part = intersect(region.box, box)
            if part is None:
                continue
            at = (region.rank, region.key)
            if at not in cache:
                cache[at] = self.source.read(*at)
            view = piece_view(cache[at], region.piece)
            dst[to_slices(relative(part, box))] = view[to_slices(relative(part, region.box))]

    def local(self, lt: LocalTensor, dtype: torch.dtype) -> torch.Tensor:
        """A target rank's local tensor, read from the source files (padding zero)."""
        out = torch.zeros(lt.shape, dtype=dtype)
        cache: SourceCache = {}
        for p in lt.pieces:
            self.fill_box(p.atom, lt.state, p.atom_box, piece_view(out, p), cache)
        return out

    def atom(
        self, atom: str, state: str | None, shape: tuple[int, ...], dtype: torch.dtype, cache: SourceCache
    ) -> torch.Tensor:
        """A whole atom (or one optimizer state of it), read from the source files."""
        out = torch.empty(shape, dtype=dtype)
        self.fill_box(atom, state, tuple((0, n) for n in shape), out, cache)
        return out


def source_dtypes(source: MegatronSource) -> Dtypes:
    """The dtypes of the source files' tensors (from their headers: no tensor is read)."""
    of_state: dict[str | None, torch.dtype] = {}
    of_atom: dict[str, torch.dtype] = {}
    for rank in source.files:
        local = source.local_state(rank)
        for lt in local_plan(source.config, source.layout, rank, source.states):
            dtype = local_tensor(local, lt.key).dtype
            of_state.setdefault(lt.state, dtype)
            if lt.state is None:
                of_atom.update({p.atom: dtype for p in lt.pieces if p.atom not in of_atom})
    of_state[None] = most_common(of_atom.values())
    return Dtypes(of_state, of_atom)
