"""What `ucp inspect` and `ucp verify` report about a committed step."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from ..base import dtypes
from ..base.boxes import box_shape, relative, to_slices
from ..errors import FormatError, IntegrityError, ObjectMissingError, StorageError
from ..format.index import IndexedManifest
from ..format.manifest import (
    CRC_BYTES,
    MAX_DOCUMENT_BYTES,
    ZARR_JSON,
    AtomMeta,
    PackedChunk,
    chunk_indices,
    group_json,
    loads,
    quantization_of,
)
from ..format.packs import pack_meta, pack_object_key
from ..protocol.session import root_attributes
from .checkpoint import CheckpointReader, group_paths


def describe(reader: CheckpointReader) -> dict[str, Any]:
    """Step, format version, layout and every atom (name, role, shape, dtype, bytes, chunks and, for a packed atom,
    the packs that hold it), the packs (name, bytes, atoms), with totals."""
    packed = reader.manifest.packed
    atoms = [
        {
            "name": m.path,
            "role": m.attributes.get("role", "tensor"),
            "shape": list(m.shape),
            "dtype": m.dtype,
            "bytes": m.nbytes,
            "chunks": math.prod(m.grid),
            "inner_chunks": math.prod(m.grid) * math.prod(m.inner_grid),
            **({"packs": sorted({c.pack for c in packed[m.path]})} if m.packed else {}),
        }
        for m in reader.atoms.values()
    ]
    held: dict[str, int] = {}
    for chunks in packed.values():
        for c in chunks:
            held[c.pack] = held.get(c.pack, 0) + 1
    packs = [
        {"name": name, "bytes": s[0] - CRC_BYTES, "chunks": held.get(name, 0)}
        for name, s in reader.manifest.packs.items()
    ]
    return {
        "url": reader.storage.url,
        "step": reader.step,
        "model": model_summary(reader),
        "format_version": reader.manifest.format_version,
        "layout": reader.manifest.layout,
        "created_at": reader.manifest.created_at,
        "committed_at": reader.record.committed_at,
        "writer": reader.manifest.writer,
        "atoms": atoms,
        "packs": packs,
        "totals": {
            "atoms": len(atoms),
            "bytes": sum(a["bytes"] for a in atoms),
            "chunks": sum(a["chunks"] for a in atoms),
            "packed_atoms": len(packed),
            "packs": len(packs),
            "objects": reader.chunk_count(),
        },
    }


def _json_at(tree: Any, *keys: str) -> Any:
    """A JSON value in the state tree (no atom is read), or None."""
    node = tree
    for i, key in enumerate(keys):
        if isinstance(node, dict) and isinstance(node.get("value"), dict):  # a JSON subtree stored whole
            value = node["value"]
            for k in keys[i:]:
                value = value.get(k) if isinstance(value, dict) else None
            return value
        body = node.get("dict") if isinstance(node, dict) else None
        if not isinstance(body, dict) or key not in body:
            return None
        node = body[key]
    return node.get("value") if isinstance(node, dict) else None


def model_summary(reader: CheckpointReader) -> dict[str, Any] | None:
    """The model family, its config and the Hugging Face fields carried beside it, for checkpoints that hold one."""
    config = _json_at(reader.manifest.tree, "model_config")
    if not isinstance(config, dict):
        return None
    hf = _json_at(reader.manifest.tree, "extra", "hf_config")
    return {
        "family": config.get("family"),
        "config": {k: v for k, v in config.items() if k != "family"},
        "hf_config": hf if isinstance(hf, dict) else {},
    }


def _model_line(model: dict[str, Any] | None) -> list[str]:
    if model is None:
        return []
    c, hf = model["config"], model["hf_config"]
    shape = ", ".join(
        f"{k} {c[k]}"
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "num_local_experts",
            "num_experts_per_tok",
            "vocab_size",
            "attention_bias",
            "qk_norm",
            "qk_norm_full",
            "n_shared_experts",
            "first_k_dense_replace",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        )
        if k in c and c[k] is not None and c[k] is not False
    )
    rope = (
        (hf.get("rope_parameters") or {}).get("rope_theta")
        if isinstance(hf.get("rope_parameters"), dict)
        else hf.get("rope_theta")
    )
    more = {
        "rope_theta": rope,
        **{
            k: hf.get(k)
            for k in (
                "rms_norm_eps",
                "max_position_embeddings",
                "sliding_window",
                "norm_topk_prob",
                "n_group",
                "topk_group",
                "routed_scaling_factor",
                "clip_qkv",
            )
        },
    }
    extras = ", ".join(f"{k} {v}" for k, v in more.items() if v is not None)
    kind = hf.get("model_type")  # (the HF architecture, where the family holds several)
    arch = f" ({kind})" if isinstance(kind, str) and kind != model["family"] else ""
    lines = [f"model       {model['family']}{arch}: {shape}" + (f"; {extras}" if extras else "")]
    block = c.get("weight_block_size")
    if isinstance(block, list):  # (block-quantised linear weights: ucp.sharding.quantization)
        quant = hf.get("quantization_config") if isinstance(hf.get("quantization_config"), dict) else {}
        lines.append(
            f"quantised   fp8 {quant.get('fmt', 'e4m3')} linear weights (float8_e4m3fn), one "
            f"{c.get('weight_scale_dtype', 'float32')} scale per "
            f"{'x'.join(map(str, block))} block (weight_scale_inv); activations {quant.get('activation_scheme', 'dynamic')}"
        )
    return lines


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
        *_model_line(info.get("model")),
        "",
    ]
    header = ("atom", "role", "shape", "dtype", "bytes", "chunks")
    rows = [
        (
            a["name"],
            str(a["role"]),  # (a caller's attribute: any JSON value)
            "x".join(map(str, a["shape"])) or "scalar",
            a["dtype"],
            _human(a["bytes"]),
            f"{a['chunks']} in {' '.join(p.removeprefix('ucp-packs/') for p in a['packs'])}"
            if "packs" in a
            else str(a["chunks"]),
        )
        for a in info["atoms"]
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:{'>' if i >= 4 else '<'}{w}}}" for i, w in enumerate(widths))
    lines += [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    t = info["totals"]
    if info["packs"]:
        lines += ["", f"{'pack':<20}  {'bytes':>10}  chunks", f"{'-' * 20}  {'-' * 10}  ------"]
        lines += [f"{p['name']:<20}  {_human(p['bytes']):>10}  {p['chunks']:>6}" for p in info["packs"]]
    total = f"total       {t['atoms']} atoms, {_human(t['bytes'])} ({t['bytes']} bytes), {t['chunks']} chunks; "
    lines += ["", total + f"{t['packed_atoms']} atoms packed in {t['packs']} packs; {t['objects']} data objects"]
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


def _check_document(reader: CheckpointReader, key: str, expected: dict[str, Any], what: str) -> None:
    """A group's zarr.json must exist and say what ucp wrote (what other Zarr readers see of the hierarchy)."""
    where = f"{reader.storage.url.rstrip('/')}/{key}"
    try:
        doc = loads(reader.storage.read(key, 0, MAX_DOCUMENT_BYTES + 1), where, MAX_DOCUMENT_BYTES)
    except FileNotFoundError:
        raise ObjectMissingError(f"{what} is missing ({where})") from None
    if not isinstance(doc, dict) or any(doc.get(k) != v for k, v in expected.items()):
        raise FormatError(f"{what} ({where}) is not the Zarr group document ucp wrote: {json.dumps(doc)[:200]}")


def _check_root(reader: CheckpointReader) -> None:
    _check_document(reader, ZARR_JSON, {"zarr_format": 3, "node_type": "group"}, "the root group's zarr.json")
    root_attributes(reader.storage)


def _check_tree(reader: CheckpointReader) -> None:
    """The state tree, which every load rebuilds: each node well formed, each atom it names in the manifest (format
    3.1 reads its tree parts here)."""
    reader.tree_atoms  # noqa: B018 -- (the property checks the tree when first read)
    if isinstance(reader.manifest, IndexedManifest):
        reader.manifest.check_placement()


def check_object(reader: CheckpointReader, meta: AtomMeta, index: tuple[int, ...]) -> None:
    """Read and check one object (into memory of its own size: verify never holds a whole atom), and (format 2)
    that its size is the one its commit recorded. A packed atom's chunk is read from its pack and checked against
    its own checksum, and the pack's size against the pack's record."""
    box = meta.chunk_box(index)
    values = torch.empty(box_shape(box), dtype=dtypes.torch_dtype(meta.dtype))
    reader.read_object(meta, index, lambda part: (values[to_slices(relative(part, box))], tuple(0 for _ in part)))
    recorded = reader.recorded(meta, index)
    if recorded is not None:
        key = reader.object_key(meta, index)
        if recorded[0] == 0 or len(reader.storage.read(key, recorded[0] - 1, recorded[0] + 1)) != 1:
            raise IntegrityError(
                f"atom {meta.path!r} chunk {meta.chunk_key(index)} (step {reader.step}): the object "
                f"is not {recorded[0]} bytes long, the size its commit recorded"
            )


PackMembers = dict[str, list[tuple[str, tuple[int, ...], PackedChunk]]]  # pack -> (atom, chunk index, where)


def pack_members(reader: CheckpointReader) -> PackMembers:
    """Every packed chunk of the step, by pack (built once for all the packs: each atom's records read once)."""
    members: PackMembers = {name: [] for name in reader.manifest.packs}
    for path, chunks in reader.manifest.packed.items():
        for index, c in zip(chunk_indices(reader.atoms[path].grid), chunks):
            members.setdefault(c.pack, []).append((path, index, c))
    return members


def check_pack(reader: CheckpointReader, name: str, members: PackMembers) -> None:
    """Read one pack whole (no more than its recorded size) and check it: its zarr.json, its size and checksum
    against what the commit recorded, and every packed chunk it holds (`members`): inside it, overlapping no other,
    and matching its own recorded checksum. A failure names the atoms the pack holds."""
    nbytes, crc = reader.manifest.packs[name]
    meta = pack_meta(name, nbytes - CRC_BYTES)
    where = f"pack {name} (step {reader.step})"
    try:
        doc = reader.storage.read(f"{reader.prefix}/{name}/{ZARR_JSON}", 0, MAX_DOCUMENT_BYTES + 1)
    except FileNotFoundError:
        raise IntegrityError(f"{where}: its {ZARR_JSON} is missing") from None
    meta.check_zarr_json(loads(doc, f"{where} {ZARR_JSON}", MAX_DOCUMENT_BYTES))
    try:
        data = reader.storage.read(pack_object_key(reader.prefix, name), 0, nbytes + 1)
    except FileNotFoundError:
        raise IntegrityError(f"{where} is missing; {reader.pack_holds(name)}") from None
    if len(data) != nbytes:
        longer = "more than" if len(data) > nbytes else f"{len(data)} bytes, not"
        raise IntegrityError(f"{where} is {longer} the {nbytes} bytes its commit recorded; {reader.pack_holds(name)}")
    body, stored = data[:-CRC_BYTES], int.from_bytes(data[-CRC_BYTES:], "little")
    if crc32c.crc32c(body) != stored:
        raise IntegrityError(
            f"{where}: checksum mismatch (crc32c), the stored bytes are damaged; {reader.pack_holds(name)}"
        )
    if stored != crc:
        raise IntegrityError(
            f"{where} is not the pack the commit recorded (its checksum differs): it was swapped, copied from another "
            f"step or left by another save; {reader.pack_holds(name)}"
        )
    end, previous = 0, ""
    for path, index, c in sorted(members.get(name, []), key=lambda m: m[2].offset):
        chunk = f"atom {path!r} chunk {reader.atoms[path].chunk_key(index)}"
        if c.offset < end or c.offset + c.nbytes > len(body):
            # (the records of different index parts: each part's own are checked when it is read)
            raise FormatError(
                f"{chunk} in {where}: bytes [{c.offset}, {c.offset + c.nbytes}) "
                + (f"overlap {previous}'s" if c.offset < end else f"pass the pack's end ({len(body)})")
            )
        end, previous = c.offset + c.nbytes, chunk
        if crc32c.crc32c(body[c.offset : c.offset + c.nbytes]) != c.crc:
            raise IntegrityError(f"{chunk} in {where}: checksum mismatch")


def verify(reader: CheckpointReader) -> VerifyReport:
    """Re-read every object of every atom and check every checksum, each object's size and checksum against what
    the commit recorded, every atom's and group's zarr.json, and the root's; collect every problem."""
    problems: list[str] = []
    tasks: list[Callable[[], object]] = [functools.partial(_check_root, reader), functools.partial(_check_tree, reader)]
    tasks += [
        functools.partial(
            _check_document, reader, f"{reader.prefix}/{g}/{ZARR_JSON}", group_json(), f"group {g!r}'s zarr.json"
        )
        for g in group_paths(reader.atoms.values())
    ]
    for meta in reader.atoms.values():
        if "quantization" in meta.attributes:  # (what a sharded load takes to dequantise it)
            tasks.append(functools.partial(quantization_of, meta, reader.atoms))
        if not meta.packed:
            tasks.append(functools.partial(reader.check_atom_metadata, meta))
            tasks += [functools.partial(check_object, reader, meta, i) for i in chunk_indices(meta.grid)]
    members = pack_members(reader)
    tasks += [functools.partial(check_pack, reader, name, members) for name in reader.manifest.packs]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        with cf.ThreadPoolExecutor(reader.io_threads) as pool:
            for future in [pool.submit(t) for t in tasks]:
                try:
                    future.result()
                except (IntegrityError, FormatError, StorageError) as e:
                    problems.append(str(e))
    return VerifyReport(reader.step, len(reader.atoms), reader.chunk_count(), problems)
