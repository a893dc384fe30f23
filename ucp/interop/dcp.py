"""PyTorch Distributed Checkpoint (torch.distributed.checkpoint) to and from ucp.

A DCP checkpoint is per-rank `.distcp` blobs plus one pickled `.metadata`. DCP itself unpickles that metadata
with plain `pickle.load`; ucp never does: the metadata is read with an unpickler that only resolves the DCP
metadata dataclasses, torch.Size, dtypes and paths (the tensor data is read through torch.load with
weights_only=True by DCP's own reader). DCP reassembles DTensor / FSDP2 shards by overlapping chunks, so a
no-process-group load of full tensors gives the atoms directly; loading only some entries at a time keeps the
import within a memory budget. The export is DCP's own writer, handed each atom only when it writes it.

Tensor names: a DCP state dict of a Hugging Face Mixtral module (optionally nested under "model"), with
either expert naming. Optimizer state saved as torch's `get_optimizer_state_dict` writes it
(`optim.state.<param>.<state>`) is carried when every parameter has the same per-element states (e.g. Adam's
exp_avg and exp_avg_sq); 0-d entries (step) and param_groups are left behind.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import pathlib
import pickle
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..base import dtypes
from ..base.workpool import pack
from ..distributed.sharded_model import AtomKey, ShardedModel, atom_path, model_config_of
from ..engine.checkpoint import CheckpointReader, open_checkpoint
from ..sharding.families import FamilyConfig, block_scales, canonical_atoms, expert_names_of, family_for
from ..sharding.layout import Layout
from .dtypes import kept_param_dtypes, parse_dtype
from .errors import InteropError, SourceMismatchError
from .hf import QuantisedDtypes, hf_config_from_ucp, read_hf_config, refuse_cast_of_quantised, stored_hf_config
from .paths import file_beside
from .staging import staged_dir
from .streaming import DEFAULT_MEMORY_BUDGET, DEFAULT_WORKERS, group_limit, nbytes, progress_bar, save_atoms

METADATA = ".metadata"
_META_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = (
    {
        (_META_MODULE, n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        # the save plans megatron-core's torch_dist writer keeps in the metadata (`all_local_plans`): plain dataclasses
        # and an enum, resolved but never used
        ("torch.distributed.checkpoint.planner", n)
        for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP metadata is made of; anything else is refused, never imported."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_metadata(root: Path) -> Any:
    """DCP's `.metadata`, unpickled with an allowlist (nothing else is imported or run) and checked to be the
    metadata DCP writes: anything else, garbage included, is an InteropError naming the file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    path = root / METADATA
    if not path.is_file():
        raise InteropError(f"{root} is not a DCP checkpoint (no {METADATA})")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as e:  # noqa: BLE001 -- garbage raises anything (struct, unicode, recursion...): all mean "not DCP"
        raise InteropError(f"{path}: refused or unreadable DCP metadata ({type(e).__name__}: {e})") from None
    entries = getattr(metadata, "state_dict_metadata", None) if isinstance(metadata, Metadata) else None
    if not isinstance(entries, dict):
        raise InteropError(f"{path} is not DCP metadata (it unpickles to a {type(metadata).__name__})")
    for fqn, entry in entries.items():
        tensor_ok = (
            isinstance(entry, TensorStorageMetadata)
            and isinstance(getattr(entry.properties, "dtype", None), torch.dtype)
            and isinstance(entry.size, tuple)
            and all(isinstance(n, int) and n >= 0 for n in entry.size)
        )
        if not isinstance(fqn, str) or not (tensor_ok or isinstance(entry, BytesStorageMetadata)):
            raise InteropError(f"{path}: the entry {fqn!r:.80} is not a tensor's or an object's DCP metadata")
    storage = getattr(metadata, "storage_data", None)
    for index, info in storage.items() if isinstance(storage, dict) else ():
        file_beside(path, getattr(info, "relative_path", None), f"the entry {getattr(index, 'fqn', index)!r:.80}")
    return metadata


def _safe_reader(root: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_metadata(root)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(root))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


# ----------------------------------------------------------------------------------------------- names

_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")
_OPTIMIZER_PREFIXES = ("optim.", "optimizer.", "optim_state.")
_IGNORED = re.compile(r".*(rotary_emb\.inv_freq|_extra_state)$")


@dataclass(frozen=True)
class _Target:
    """One DCP tensor and the atoms it holds (fused expert tensors hold several); state None: parameters."""

    fqn: str
    shape: tuple[int, ...]
    atoms: tuple[str, ...]
    state: str | None = None


def _map_name(name: str, config: FamilyConfig, atoms: set[str]) -> tuple[str, ...] | None:
    if name in atoms:
        return (name,)
    moe = expert_names_of(config)
    if moe is not None and (m := _ROUTER.fullmatch(name)):
        return (moe.router_atom(m[1]),)
    if moe is not None and (m := _FUSED.fullmatch(name)):
        if m[2] == "gate_up_proj":
            return moe.gate_up_atoms(m[1], config.num_local_experts)
        return moe.down_atoms(m[1], config.num_local_experts)
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return ()
    return None


def _map_param(fqn: str, config: FamilyConfig, atoms: set[str]) -> tuple[str, ...] | None:
    mapped = _map_name(fqn, config, atoms)
    return mapped if mapped is not None else _map_name(fqn.removeprefix("model."), config, atoms)


def plan_import(metadata: Any, config: FamilyConfig, where: str) -> tuple[list[_Target], list[str]]:
    """Which DCP tensors make which atoms (parameters, and per-element optimizer states present for every
    parameter); unmappable tensors are an error naming them."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    atoms = set(canonical_atoms(config))
    targets, optim, skipped, unmapped = [], [], [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata) or _IGNORED.match(fqn):
            skipped.append(fqn)
            continue
        if fqn.startswith(_OPTIMIZER_PREFIXES):
            param, _, state = fqn.partition(".state.")[2].rpartition(".")
            mapped = _map_param(param, config, atoms) if param and len(md.size) > 0 else None
            if mapped:
                optim.append(_Target(fqn, tuple(md.size), mapped, state))
            else:
                skipped.append(fqn)
            continue
        mapped = _map_param(fqn, config, atoms)
        if mapped is None:
            unmapped.append(fqn)
        elif mapped:
            targets.append(_Target(fqn, tuple(md.size), mapped))
    if unmapped:
        raise SourceMismatchError(
            f"{where} holds tensors ucp cannot map to {family_for(config).name.capitalize()} atoms: {unmapped[:5]}"
            f"{' ...' if len(unmapped) > 5 else ''}"
        )
    given: dict[tuple[str, str | None], str] = {}  # (atom, state) -> the tensor that gives it
    for t in targets + optim:
        for atom in t.atoms:
            if (first := given.setdefault((atom, t.state), t.fqn)) != t.fqn:
                raise InteropError(
                    f"{where}: atom {atom}{f' ({t.state})' if t.state else ''} is given twice, by {first} and by "
                    f"{t.fqn}; a checkpoint holds each weight once"
                )
    covered = {a for t in targets for a in t.atoms}
    missing = [a for a in canonical_atoms(config) if a not in covered]
    if missing:
        raise InteropError(f"{where} lacks tensors for atoms {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    states = sorted({t.state for t in optim if t.state is not None})
    complete = [s for s in states if {a for t in optim if t.state == s for a in t.atoms} == covered]
    skipped += [t.fqn for t in optim if t.state not in complete]
    return targets + [t for t in optim if t.state in complete], skipped


def _split(target: _Target, tensor: torch.Tensor, config: FamilyConfig) -> dict[str, torch.Tensor]:
    if len(target.atoms) == 1:
        return {target.atoms[0]: tensor}
    if len(target.atoms) == 2 * tensor.shape[0]:  # fused gate_up_proj (or its optimizer state): per expert [gate; up]
        ffn = tensor.shape[1] // 2
        return {a: tensor[i // 2, :ffn] if i % 2 == 0 else tensor[i // 2, ffn:] for i, a in enumerate(target.atoms)}
    return {a: tensor[i] for i, a in enumerate(target.atoms)}


# ----------------------------------------------------------------------------------------------- import


@dataclass(frozen=True)
class DcpImportReport:
    step: int
    atoms: int
    bytes_read: int
    optim_states: tuple[str, ...]  # per-element optimizer states carried (empty: weights only)
    skipped: tuple[str, ...]  # entries left behind (0-d optimizer entries such as step, param_groups, non-tensors)


def _config(config: FamilyConfig | str | Path | None, root: Path) -> tuple[FamilyConfig, dict[str, Any]]:
    """The family config (given, or from a Hugging Face config.json: `config` names one, else the checkpoint's own),
    and the Hugging Face fields it does not model (carried as the checkpoint's hf_config)."""
    if config is not None and not isinstance(config, (str, Path)):
        return config, {}
    path = Path(config) if config is not None else root / "config.json"
    if not path.is_file():
        raise InteropError(
            f"DCP checkpoints carry no model config: give one (a Hugging Face config.json); {path} does not exist"
        )
    return read_hf_config(path)


def _check_shapes(targets: list[_Target], config: FamilyConfig, where: str) -> None:
    """Every atom a DCP tensor gives has the shape the config implies (from the metadata alone)."""
    expected = canonical_atoms(config)
    for t in targets:
        for atom, part in _split(t, torch.empty(t.shape, device="meta"), config).items():
            if tuple(part.shape) != expected[atom][0]:
                what = "parameter" if t.state is None else t.state
                raise InteropError(
                    f"{where}: {what} of {atom} has shape {list(part.shape)}, the config implies {list(expected[atom][0])}"
                )


def _load_targets(
    root: Path, metadata: Any, targets: list[_Target], config: FamilyConfig
) -> dict[AtomKey, torch.Tensor]:
    """Some DCP tensors, reassembled by DCP's own reader (only these entries are read), split into atoms."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with _quiet():
        full = {
            t.fqn: torch.empty(t.shape, dtype=metadata.state_dict_metadata[t.fqn].properties.dtype) for t in targets
        }
        try:
            dcp.load(full, storage_reader=_safe_reader(root), no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 -- (DCP's is a BaseException) what a damaged or hostile data file raises
            files = sorted(_files_of(metadata, {t.fqn for t in targets}))
            raise InteropError(
                f"cannot read {', '.join(str(root / f) for f in files) or root} (tensors "
                f"{', '.join(t.fqn for t in targets[:3])}{' ...' if len(targets) > 3 else ''}): damaged, or not what "
                f"its {METADATA} says ({_innermost(e)})"
            ) from None
    return {(atom, t.state): part for t in targets for atom, part in _split(t, full.pop(t.fqn), config).items()}


def _files_of(metadata: Any, fqns: set[str]) -> set[str]:
    """The data files (relative to the checkpoint) that hold DCP entries `fqns`, as its metadata says."""
    storage = getattr(metadata, "storage_data", None) or {}
    return {str(info.relative_path) for index, info in storage.items() if getattr(index, "fqn", None) in fqns}


def _innermost(e: BaseException) -> str:
    """The first line of the deepest cause that DCP wrapped (its CheckpointException holds each rank's failure)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))  # (the exception and its stack)
        e = first[0] if isinstance(first, tuple) else first
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].split('. ')[0][:200] if text else ''}".rstrip(": ")


def _first_dtype(metadata: Any, targets: list[_Target], state: str | None) -> torch.dtype:
    return next(metadata.state_dict_metadata[t.fqn].properties.dtype for t in targets if t.state == state)


def import_dcp(
    src_dir: str | Path,
    url: str,
    *,
    config: FamilyConfig | str | Path | None = None,
    step: int = 0,
    dtype: str | torch.dtype | None = None,
    storage_options: dict[str, Any] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    workers: int = DEFAULT_WORKERS,
    progress: bool = False,
) -> DcpImportReport:
    """A DCP checkpoint of a Mixtral model (written by dcp.save from any world size, DTensor/FSDP2 shards or
    plain tensors) becomes a ucp checkpoint in layout tp1pp1 that any layout can load: the parameters (cast to
    `dtype` if given) and, where present for every parameter, the per-element optimizer states (as stored).
    Names and shapes are checked from the metadata first; DCP's reader then loads the tensors in groups that
    fit `memory_budget` (a DCP tensor is loaded whole: fused experts are one tensor per layer)."""
    root = Path(src_dir)
    metadata = read_metadata(root)
    cfg, hf_fields = _config(config, root)
    targets, skipped = plan_import(metadata, cfg, str(root))
    _check_shapes(targets, cfg, str(root))
    states = tuple(sorted({t.state for t in targets if t.state is not None}))
    stored = {
        a: metadata.state_dict_metadata[t.fqn].properties.dtype for t in targets if t.state is None for a in t.atoms
    }
    quantised = QuantisedDtypes(cfg)
    for atom, stored_dtype in stored.items():
        quantised.check(atom, stored_dtype, str(root))
    cfg = quantised.config(cfg)
    refuse_cast_of_quantised(cfg, dtype, str(root))
    dtype_of = kept_param_dtypes(stored, parse_dtype(dtype))
    dtype_of.update({s: _first_dtype(metadata, targets, s) for s in states})
    by_fqn = {t.fqn: t for t in targets}
    sizes = {t.fqn: math.prod(t.shape) * metadata.state_dict_metadata[t.fqn].properties.dtype.itemsize for t in targets}
    groups = pack(sizes, group_limit(memory_budget))
    loads = [functools.partial(_load_targets, root, metadata, [by_fqn[f] for f in g], cfg) for g in groups]
    extra = {"hf_config": hf_fields, "source": {"format": "dcp", "path": str(root.absolute())}}
    written = save_atoms(
        url,
        loads,
        step=step,
        model=ShardedModel(cfg, Layout(), optim_states=states),
        dtype_of=dtype_of,
        extra=extra,
        storage_options=storage_options,
        workers=workers,
        progress=progress,
    )
    return DcpImportReport(step, len(canonical_atoms(cfg)), written, states, tuple(skipped))


# ----------------------------------------------------------------------------------------------- export


@dataclass(frozen=True)
class DcpExportReport:
    tensors: int
    bytes_written: int


def _atom_reading_planner(reader: CheckpointReader, cast: torch.dtype | None, bar: Any) -> Any:
    """A DCP save planner for a state dict of placeholder (meta) tensors: DCP's writer asks for each tensor
    when it writes it, and only then is the atom read (and cast)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class AtomReadingPlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            path = atom_path(index.fqn, None)
            tensor = reader.read_atoms([path])[path]
            bar.update(nbytes(tensor))
            return tensor.to(cast) if cast is not None else tensor

    return AtomReadingPlanner()


def export_dcp(
    url: str,
    out_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    step: int | str = "latest",
    storage_options: dict[str, Any] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    workers: int = DEFAULT_WORKERS,
    progress: bool = False,
) -> DcpExportReport:
    """Write a ucp checkpoint's parameters as a DCP checkpoint: a flat state dict of full tensors under their
    canonical (Hugging Face) names, which DCP loads into any world size and any sharding (DTensor / FSDP2).

    DCP's own writer writes one file per tensor (its `single_file_per_rank=False` layout; one file per rank
    would hold every tensor of the file in memory until it is written), reading each atom as it goes, with as
    many tensors in flight as `memory_budget` allows for the largest."""
    import torch.distributed.checkpoint as dcp

    reader = open_checkpoint(url, step, storage_options=storage_options)
    config = model_config_of(reader)
    names = list(canonical_atoms(config))
    missing = [n for n in names if atom_path(n, None) not in reader.atoms]
    if missing:
        raise InteropError(f"step {reader.step} at {url} lacks parameter atoms {missing[:5]}")
    cast = parse_dtype(dtype)
    if cast is not None and block_scales(config):
        raise InteropError(
            f"step {reader.step} at {url} holds fp8 weights with block scales: DCP export writes them as they are "
            "(without --dtype); a dequantised copy is ucp export --to hf --dtype, or load_weights(..., dtype=)"
        )
    metas = {n: reader.atoms[atom_path(n, None)] for n in names}
    out_dtype = {n: cast or dtypes.torch_dtype(m.dtype) for n, m in metas.items()}
    placeholders = {n: torch.empty(m.shape, dtype=out_dtype[n], device="meta") for n, m in metas.items()}
    in_flight = max(max(m.nbytes, nbytes(placeholders[n])) for n, m in metas.items()) * 2  # the read, and its cast
    threads = max(1, min(workers, memory_budget // in_flight))
    written = sum(nbytes(t) for t in placeholders.values())
    with (
        staged_dir(out_dir) as tmp,
        _quiet(),
        progress_bar(sum(m.nbytes for m in metas.values()), "export dcp", progress) as bar,
    ):
        # staged_dir fsyncs every file before it publishes the directory
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False, sync_files=False, thread_count=threads)
        dcp.save(placeholders, storage_writer=writer, planner=_atom_reading_planner(reader, cast, bar), no_dist=True)
        # DCP has no place for a model's config: a config.json beside its files carries it (what import reads)
        config_dtype = cast or dtypes.torch_dtype(next(iter(metas.values())).dtype)
        (tmp / "config.json").write_text(
            json.dumps(hf_config_from_ucp(config, stored_hf_config(reader), config_dtype), indent=2) + "\n"
        )
    return DcpExportReport(len(placeholders), written)
