"""Megatron-LM checkpoints converted through atoms (`convert`, `ucp convert`): a torch-format checkpoint
(`iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`) resharded into another TP/PP/EP layout, either format
(the torch format, or torch_dist: ucp.interop.megatron.dist) into the other, and either to and from a ucp
checkpoint.

Conversion never holds the model, nor a whole rank file: every target tensor is filled piece by piece from the
source tensors that hold the same atom box (`ucp.sharding.reshard.local_plan` gives both sides' boxes; the source's are
indexed by source.PieceIndex), each source tensor read from its file only when needed and dropped after,
and each target file is written tensor by tensor (target), a few files at a time within the memory budget.

The optimizer's state reshards the same way (its per-parameter tensors are ucp local optimizer states); the scheduler
and the iteration are global and go to every file; the RNG states are per rank and are carried only into the same
layout. What the source holds and a conversion does not carry is named in its report's `dropped`.

The modules beside this one, each for one concern: save (the names and layouts of a save on disk),
files (its torch.save files read safely), args (a job's args and ucp's model configs),
source (a checkpoint opened as a source), target (what is written, and the rank files),
optimizer and distrib_optim (the optimizer's entries), dist (the torch_dist format).
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...base import dtypes
from ...base.workpool import pack
from ...distributed.sharded_load import piece_reads
from ...distributed.sharded_model import AtomKey, ShardedModel, atom_path, check_atom, extra_state, model_config_of
from ...engine.checkpoint import CheckpointReader, open_checkpoint
from ...errors import CheckpointNotFoundError, FormatError, LayoutError, UcpError
from ...format.manifest import AtomMeta
from ...sharding.families import FamilyConfig, block_scales, buffer_atoms, canonical_atoms, family_for
from ...sharding.layout import Layout
from ...sharding.reshard import LocalTensor, local_plan
from ..dtypes import Dtypes
from ..errors import SourceMismatchError
from ..streaming import group_limit, save_atoms
from .args import args_for, args_json, check_windows
from .dist import open_torch_dist, write_torch_dist
from .optimizer import OptimizerMeta
from .save import TORCH_DIST, TRACKER, UNIVERSAL, megatron_name, parse_megatron_layout, rank_files
from .source import MegatronSource, PieceIndex, SourceCache, open_megatron, source_dtypes
from .target import Produce, TargetFiles, write_rank_files


@dataclass(frozen=True)
class ConvertReport:
    source: str
    destination: str
    atoms: int  # carried: each parameter's, and each optimizer state's where the optimizer was carried
    files: int
    bytes_written: int
    dropped: tuple[str, ...] = ()  # source entries not carried (e.g. "rng_state" into another layout)


@dataclass(frozen=True)
class DistJob:
    """The job a --to torch_dist checkpoint's distributed optimizer is written for. With `layout`: Megatron-LM's
    default form (`dp_reshardable`: each model-parallel rank's grad buffer buckets, which that job loads in its
    TP, PP, VPP and EP with any DP, and Megatron-LM's loader refuses in another TP or PP); without: the form every
    layout loads (`fully_reshardable`), its entry made for a job of expert parallelism `ep` (None: the source's),
    since megatron-core chains a dense and an expert optimizer only with EP > 1."""

    layout: Layout | None = None
    ep: int | None = None

    @classmethod
    def of(cls, to_layout: str, target_ep: int | None, target_layout: str | None) -> DistJob:
        """From convert's arguments, checked: they name a job only for --to torch_dist, and one way."""
        for flag, value in (("--target-ep", target_ep), ("--target-layout", target_layout)):
            if value is not None and to_layout != TORCH_DIST:
                raise UcpError(
                    f"{flag} {value}: it says which job loads a --to torch_dist checkpoint; --to {to_layout} names "
                    "its own layout"
                )
        if target_ep is not None and target_layout is not None:
            raise UcpError(f"--target-ep {target_ep} and --target-layout {target_layout}: the layout names its EP")
        if target_ep is not None and target_ep < 1:
            raise UcpError(f"--target-ep {target_ep}: an expert-parallel size is 1 or more")
        return cls(parse_megatron_layout(target_layout) if target_layout is not None else None, target_ep)

    def check_fits(self, config: FamilyConfig) -> None:
        """The EP named must be one the model can be trained in: its experts split evenly over it."""
        experts = getattr(config, "num_local_experts", 0)
        if self.ep is not None and self.ep > 1 and (not experts or experts % self.ep):
            raise LayoutError(
                f"--target-ep {self.ep}: the model has {experts or 'no'} experts, which {self.ep} expert-parallel "
                "ranks cannot split evenly"
            )

    def expert_parallel(self, meta: OptimizerMeta) -> bool:
        """Whether the job chains a dense and an expert optimizer (EP > 1)."""
        if self.layout is not None:
            return self.layout.ep > 1
        return self.ep > 1 if self.ep is not None else any(key[2] for key in meta.groups)


@dataclass(frozen=True)
class ConvertOptions:
    """What a conversion is asked to do (`convert`; `ucp convert`, `export --to megatron-dist` and `import --from
    megatron-dist` build one from their flags), checked when made: a combination that means nothing is a UcpError.

    `from_layout` / `to_layout`: a Megatron layout of torch-format rank files (tp{T}[pp{P}][vpp{V}][ep{E}]),
    "torch_dist" (Megatron's dist_checkpointing format, which needs no layout) or "universal" (a ucp checkpoint).
    `step`: the ucp step to read (default the latest) or write (default the iteration). `iteration`: the Megatron
    iteration to read (default the tracker's). `vocab_size`: the true vocabulary, where the args know only the
    padded one. `model_config`: with --from torch_dist, the model's shape of a checkpoint saved without Megatron-LM's
    args (dist.model_shape). `target_ep` / `target_layout`: with --to torch_dist, the job that loads it
    (`DistJob`). The rest: peak tensor memory, parallel reads and writes, fsspec options of a ucp URL, a progress
    bar."""

    from_layout: str
    to_layout: str
    step: int | None = None
    iteration: int | None = None
    vocab_size: int | None = None
    model_config: str | Path | None = None
    target_ep: int | None = None
    target_layout: str | None = None
    memory_budget: int = 4 << 30
    workers: int = 8
    storage_options: dict[str, Any] | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        for flag, text, formats in (
            ("--from", self.from_layout, (UNIVERSAL, TORCH_DIST)),
            ("--to", self.to_layout, (UNIVERSAL, TORCH_DIST)),
            ("--target-layout", self.target_layout, ()),
        ):
            if text is None or text in formats:
                continue
            try:
                parse_megatron_layout(text)
            except LayoutError as e:
                malformed = str(e).startswith("malformed")  # (not a layout at all: say what else the flag takes)
                also = f", {' or '.join(formats)}" if formats and malformed else ""
                raise LayoutError(f"{flag} {text}: {e}{also}") from None
        job = self.job  # (checked)
        # (torch_dist into torch_dist for a job: its optimizer in another form or entry)
        same = self.from_layout == self.to_layout and self.from_layout in (UNIVERSAL, TORCH_DIST)
        if same and job == DistJob():
            raise UcpError(
                f"--from {self.from_layout} --to {self.to_layout}: nothing to convert (it loads in any layout as it is)"
            )
        if self.model_config is not None and self.from_layout != TORCH_DIST:
            raise UcpError(
                f"--config {self.model_config}: it gives the model's shape of a torch_dist checkpoint saved without "
                f"Megatron-LM's args; --from {self.from_layout} "
                + ("has its own config" if self.from_layout == UNIVERSAL else "files have their args")
            )

    @property
    def job(self) -> DistJob:
        """The job a --to torch_dist checkpoint is for (DistJob(): any; checked against --to)."""
        return DistJob.of(self.to_layout, self.target_ep, self.target_layout)


def convert(src: str | Path, dst: str | Path, options: ConvertOptions | None = None, **keywords: Any) -> ConvertReport:
    """Reshard a Megatron torch checkpoint into another TP/PP/EP layout, or convert it to (`to_layout="universal"`)
    or from (`from_layout="universal"`) a ucp checkpoint; "torch_dist" on either side is Megatron's
    dist_checkpointing format (ucp.interop.megatron.dist), which needs no layout. What to do is `options`, or its
    fields as keywords (`convert(src, dst, from_layout="tp2pp2", to_layout="universal")`). Carried: model weights,
    the optimizer's state (into torch_dist: a distributed optimizer's, in Megatron-LM's default form for the job of
    `target_layout`, or else in the form any layout loads, made for a job of expert parallelism `target_ep`, by
    default the source's: `DistJob`), opt_param_scheduler and the iteration; rng_state only into the source's own
    layout. What is not carried is listed in `dropped`."""
    if options is None:
        options = ConvertOptions(**keywords)
    elif keywords:
        raise TypeError(f"convert: options, or keywords {sorted(keywords)}, not both")
    src, dst = str(src), str(dst)
    if options.from_layout == UNIVERSAL:
        return _from_universal(src, dst, options)
    if options.from_layout == TORCH_DIST:
        source = open_torch_dist(
            src, iteration=options.iteration, vocab_size=options.vocab_size, model_config=options.model_config
        )
    else:
        source = open_megatron(src, options.from_layout, iteration=options.iteration, vocab_size=options.vocab_size)
    if options.to_layout == UNIVERSAL:
        return _to_universal(source, dst, options)
    return _reshard(source, dst, options)


def _universal_extra(source: MegatronSource) -> dict[str, Any]:
    """The JSON (and small tensors) a Megatron -> ucp conversion stores beside the atoms. `optimizer_step` is
    where ucp's trainer keeps the optimizer's step counter; `megatron_optimizer` holds what writing the optimizer
    entry back needs (kind, per-parameter entries, param-group hyperparameters, grad scaler)."""
    extra: dict[str, Any] = {
        "hf_config": source.hf,
        "megatron_args": args_json(source.args),
        "source": {
            "format": "megatron",
            "path": str(source.root.absolute()),
            "iteration": source.iteration,
            "layout": megatron_name(source.layout),
        },
    }
    if source.scheduler is not None:
        extra["opt_param_scheduler"] = source.scheduler
    if source.optimizer is not None:
        extra["megatron_optimizer"] = source.optimizer.to_json()
        if source.optimizer.step is not None:
            extra["optimizer_step"] = source.optimizer.step
    return extra


def carried_atoms(config: FamilyConfig, states: tuple[str, ...]) -> list[AtomKey]:
    """The atoms a conversion carries: every parameter, and its optimizer `states` (a buffer has none)."""
    buffers = buffer_atoms(config)
    return [(a, s) for a in canonical_atoms(config) for s in ((None,) if a in buffers else (None, *states))]


def _to_universal(source: MegatronSource, url: str, options: ConvertOptions) -> ConvertReport:
    """Megatron -> ucp, written in layout tp1pp1 by `streaming.save_atoms`: atoms move in groups within the
    budget, each atom filled from the source regions holding it; a group's source tensors are read from their
    files and dropped with the group."""
    check_windows(source.args, source.hf, str(source.root))  # (the HF config stored must say the job's windows)
    index = PieceIndex.of(source)
    dtypes_ = source_dtypes(source)
    shapes = {name: tuple(shape) for name, (shape, _) in canonical_atoms(source.config).items()}
    keys = carried_atoms(source.config, source.states)
    sizes = {(a, s): math.prod(shapes[a]) * dtypes_.atom(a, s).itemsize for a, s in keys}

    def load(keys: list[AtomKey]) -> dict[AtomKey, torch.Tensor]:
        cache: SourceCache = {}
        return {(a, s): index.atom(a, s, shapes[a], dtypes_.atom(a, s), cache) for a, s in keys}

    written = save_atoms(
        url,
        [functools.partial(load, keys) for keys in pack(sizes, group_limit(options.memory_budget))],
        step=source.iteration if options.step is None else options.step,
        model=ShardedModel(source.config, Layout(), optim_states=source.states),
        dtype_of=dtypes_.save_dtypes(),
        extra=_universal_extra(source),
        storage_options=options.storage_options,
        workers=options.workers,
        progress=options.progress,
    )
    dropped = ("rng_state",) if "rng_state" in source.files[0] else ()  # per rank: no layout-free form
    return ConvertReport(str(source.root), url, len(keys), 0, written, dropped + source.not_carried)


def _target_layout(to_layout: str) -> tuple[Layout, str]:
    """The layout and format a --to names: a Megatron layout (torch format), or torch_dist (layout-free: written
    as tp1pp1, which Megatron's loader reshards to any layout)."""
    if to_layout == TORCH_DIST:
        return Layout(), TORCH_DIST
    return parse_megatron_layout(to_layout), "torch"


def _target_optimizer(meta: OptimizerMeta | None, fmt: str, job: DistJob) -> tuple[OptimizerMeta | None, bool]:
    """(the optimizer a target of format `fmt` gets, whether its torch_dist entry is for a job with EP > 1).
    torch_dist holds a distributed optimizer's state only (another kind of optimizer keeps its own form there,
    which ucp does not write); its entry is for the job `job` names, by default one like the source (expert param
    groups of their own: EP > 1)."""
    if meta is None or (fmt == TORCH_DIST and meta.distributed is None):
        return None, False
    return meta, job.expert_parallel(meta)


def _dist_args(config: FamilyConfig, layout: Layout, job: DistJob, **kwargs: Any) -> argparse.Namespace:
    """A target's args: its layout's, or for a torch_dist written for one job's layout (`job.layout`, the
    dp_reshardable form) that job's, which Megatron-LM's loader compares with its own TP and PP."""
    return args_for(config, job.layout if job.layout is not None else layout, **kwargs)


def _write(
    dst: str, target: TargetFiles, produce: Produce, dtype_of: Callable[[LocalTensor], torch.dtype], o: ConvertOptions
) -> tuple[int, int]:
    """Every file of the target, in its format: (files, bytes of tensors written)."""
    if target.format == TORCH_DIST:
        return write_torch_dist(dst, target, produce, dtype_of, o.progress)
    return write_rank_files(dst, target, produce, dtype_of, o.memory_budget, o.workers, o.progress)


def _check_fits(config: FamilyConfig, layout: Layout, options: ConvertOptions) -> None:
    """The target's layout and the job it is written for fit the model, before anything is written; a refusal
    names the flag and the layout as the user wrote it (ucp's own name of a Megatron layout adds its DP = EP)."""
    for flag, value, fits in (
        ("--to", options.to_layout, layout),
        ("--target-layout", options.target_layout, options.job.layout),
    ):
        if fits is not None:
            try:
                local_plan(config, fits, 0, ())
            except LayoutError as e:
                raise LayoutError(f"{flag} {value}: {e}") from None
    options.job.check_fits(config)


def _reshard(source: MegatronSource, dst: str, options: ConvertOptions) -> ConvertReport:
    """Megatron -> Megatron: each target tensor (parameter or optimizer state) filled from the source regions."""
    job = options.job
    layout, fmt = _target_layout(options.to_layout)
    _check_fits(source.config, layout, options)
    index = PieceIndex.of(source)
    dtypes_ = source_dtypes(source)
    # RNG states are per rank: a file of the same layout is the same rank, any other has no source to take them from
    has_rng = all("rng_state" in f for f in source.files.values())
    same = megatron_name(layout) == megatron_name(source.layout) and fmt == "torch"
    rng = {name: source.files[r]["rng_state"] for name, r in rank_files(layout).items()} if has_rng and same else None
    args = _dist_args(source.config, layout, job, base=source.args)
    args.ckpt_format = fmt
    optimizer, expert_parallel = _target_optimizer(source.optimizer, fmt, job)
    target = TargetFiles(
        source.config,
        layout,
        args,
        source.iteration,
        optimizer,
        source.scheduler,
        rng,
        fmt,
        expert_parallel,
        job.layout,
    )
    files, written = _write(dst, target, lambda _rank, lt: index.local(lt, dtypes_.of(lt)), dtypes_.of, options)
    dropped: tuple[str, ...] = ("rng_state",) if has_rng and not same else ()
    dropped += ("optimizer",) if source.optimizer is not None and optimizer is None else ()
    atoms = len(carried_atoms(source.config, target.states))
    return ConvertReport(str(source.root), dst, atoms, files, written, dropped + source.not_carried)


def _from_universal(src: str, dst: str, options: ConvertOptions) -> ConvertReport:
    """ucp -> Megatron: each target rank's local state read straight from the atoms. The optimizer entry is
    written when the checkpoint came from Megatron with one (its `megatron_optimizer` says how to build it);
    optimizer state without it (e.g. from ucp's trainer: no Megatron param groups to rebuild) is dropped."""
    job = options.job
    reader = _open_universal(src, options.step, options.storage_options)
    config = model_config_of(reader)
    extra = extra_state(reader)
    hf = extra.get("hf_config")
    hf = hf if isinstance(hf, dict) else None
    family = family_for(config)
    if family.megatron is None:
        raise SourceMismatchError(f"{src} holds a {family.name} model, which no Megatron checkpoint holds here")
    refused = family.megatron.refuses(config, hf or {})
    if refused is not None:
        raise SourceMismatchError(f"{src} holds {refused}")
    quantised = list(block_scales(config))
    if quantised:  # (Megatron-LM trains and saves bf16 parameters: its loaders have no place for fp8 blocks' scales)
        raise SourceMismatchError(
            f"{src}: {quantised[0]} and {len(quantised) - 1} more are fp8 weights with block scales, which Megatron "
            "checkpoints do not hold; dequantise first: ucp export SRC --to hf DIR --dtype bf16, ucp import DIR URL, "
            "then convert URL"
        )
    layout, fmt = _target_layout(options.to_layout)
    _check_fits(config, layout, options)
    meta = OptimizerMeta.from_json(extra["megatron_optimizer"]) if "megatron_optimizer" in extra else None
    try:
        args = _dist_args(config, layout, job, hf=hf)
    except UcpError as e:  # (what the model's config says that no Megatron args say: its RoPE's scaling)
        raise SourceMismatchError(f"{src}: {e}") from None
    args.ckpt_format = fmt
    optimizer, expert_parallel = _target_optimizer(meta, fmt, job)
    target = TargetFiles(
        config,
        layout,
        args,
        reader.step,
        optimizer,
        extra.get("opt_param_scheduler"),
        format=fmt,
        expert_parallel=expert_parallel,
        optimizer_layout=job.layout,
    )
    atom_meta = _atom_metas(reader, config, layout, target.states)
    of_state = {state: dtypes.torch_dtype(meta.dtype) for (_, state), meta in reversed(atom_meta.items())}
    stored = Dtypes(of_state, {a: dtypes.torch_dtype(m.dtype) for (a, s), m in atom_meta.items() if s is None})
    files, written = _write(
        dst, target, lambda _rank, lt: _read_local(reader, atom_meta, lt, stored.of(lt)), stored.of, options
    )
    has_optimizer = any(p.startswith("optimizer/") for p in reader.atoms)
    dropped = ("optimizer",) if target.optimizer is None and has_optimizer else ()
    return ConvertReport(src, dst, len(atom_meta), files, written, dropped)


def _atom_metas(
    reader: CheckpointReader, config: FamilyConfig, layout: Layout, states: tuple[str, ...]
) -> dict[AtomKey, AtomMeta]:
    """The stored atoms every rank of `layout` needs, checked to exist with the config's shapes."""
    shapes = canonical_atoms(config)
    out: dict[AtomKey, AtomMeta] = {}
    for atom, (shape, _) in shapes.items():
        for state in (None, *states):
            path = atom_path(atom, state)
            if path not in reader.atoms:
                raise FormatError(
                    f"step {reader.step} has no atom {path!r}, which the {megatron_name(layout)} files need"
                )
            check_atom(reader.atoms[path], tuple(shape))
            out[(atom, state)] = reader.atoms[path]
    return out


def _read_local(
    reader: CheckpointReader, atom_meta: Mapping[AtomKey, AtomMeta], lt: LocalTensor, dtype: torch.dtype
) -> torch.Tensor:
    """One local tensor of a target rank, read from the atom chunks it overlaps (load_sharded, for one tensor;
    padding zero). A piece of an atom stored in another dtype than `dtype` (a fused tensor of atoms stored in
    several) is read into a buffer of its own dtype and cast."""
    out = torch.zeros(lt.shape, dtype=dtype)
    finishes: list[Callable[[], object]] = []
    for read in piece_reads(reader, lt, [atom_meta[(p.atom, lt.state)] for p in lt.pieces], out, finishes):
        read.call()
    for finish in finishes:
        finish()
    return out


def _open_universal(src: str, step: int | None, storage_options: dict[str, Any] | None) -> CheckpointReader:
    if (Path(src) / TRACKER).is_file():
        raise SourceMismatchError(
            f"{src} is a Megatron checkpoint (it has {TRACKER}), not a ucp one: give its layout to --from"
        )
    try:
        return open_checkpoint(src, "latest" if step is None else step, storage_options=storage_options)
    except CheckpointNotFoundError as e:
        raise SourceMismatchError(f"--from universal, but {src} holds no committed ucp checkpoint: {e}") from None
