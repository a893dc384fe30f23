"""A step's manifest read once for all the ranks of a distributed load (`open_shared`).

Every rank of a job that loads a step needs its commit marker, its manifest and (format 3.1) the index parts that
hold the records of the atoms it reads; ranks of one pipeline stage or one expert group need the same parts. Read
rank by rank, that is W reads of the marker and the manifest (a hot key on an object store: 100,000 GETs of one
object) and each part read by every rank that needs it. Here rank 0 reads the marker and the manifest and broadcasts
them; every rank says which parts it needs (up the gather tree to rank 0, a few numbers each); rank 0 gives each part
one reader among the ranks that need it (spread over them), and each rank reads its share and sends each part to
the other ranks that need it, point to point. A rank's cost is its own parts, not the world's. What a rank receives
is checked as if it had read it (each part's size and CRC-32C against the manifest, which the marker covers).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.checkpoint import CheckpointReader
from ..format.index import IndexedManifest, atoms_part_name
from ..format.manifest import dumps
from ..protocol import commit
from ..protocol.comm import Comm
from ..protocol.coordination import all_reduce, broadcast
from ..storage import ReadableStorage


@dataclass(frozen=True)
class _Documents:
    """Rank 0 to every rank: the step's commit record (as its marker says it) and its manifest, byte for byte."""

    marker: bytes
    manifest: bytes

    def to_json(self) -> dict[str, str]:
        return {"marker": base64.b64encode(self.marker).decode(), "manifest": base64.b64encode(self.manifest).decode()}

    @classmethod
    def from_json(cls, doc: Any) -> _Documents:
        return cls(base64.b64decode(doc["marker"]), base64.b64decode(doc["manifest"]))


@dataclass(frozen=True)
class _Done:
    """A rank's part of a collective step went well (its failure goes instead, `ucp.protocol.coordination`)."""

    def to_json(self) -> None:
        return None

    @classmethod
    def from_json(cls, doc: Any) -> _Done:
        return cls()


def open_shared(
    storage: ReadableStorage,
    comm: Comm,
    step: int | str | None = "latest",
    *,
    paths: Callable[[CheckpointReader], Iterable[str]],
    io_threads: int | None = None,
) -> CheckpointReader:
    """Every rank's reader of one committed step, its documents read once for all (module doc); `paths(reader)` are
    the atoms this rank will read (their index parts are shared; any other atom's part is read by the rank that asks
    for it). A collective: every rank calls it together; a failure on any rank is raised on every rank."""

    def documents() -> _Documents:
        _, record = commit.resolve_step(storage, step)
        return _Documents(dumps(record.to_json()), commit.read_manifest_bytes(storage, record))

    docs = broadcast(comm, documents, _Documents)
    number = int(step) if isinstance(step, int) else _json_step(docs.marker)
    record = commit.parse_marker(docs.marker, number, f"{storage.url}: step {number} as rank 0 read it")
    reader = CheckpointReader(storage, committed=(record, docs.manifest), io_threads=io_threads)
    manifest = reader.manifest
    if comm.world_size == 1 or not isinstance(manifest, IndexedManifest):
        return reader  # (a manifest of format 3.0 or older is one document: every rank has it whole)
    wanted = manifest.parts(list(paths(reader)))
    route = _routes(comm, wanted)
    sizes = [e.size for e in manifest.entries]

    def read_mine() -> _Done:
        for n in route.read:
            manifest.add_part(n, reader.read_index_object(atoms_part_name(n), sizes[n]))
        return _Done()

    all_reduce(comm, read_mine, lambda _: _Done(), _Done, _Done)
    outgoing = {
        peer: torch.frombuffer(bytearray(b"".join(manifest.part_bytes(n) for n in parts)), dtype=torch.uint8)
        for peer, parts in route.send.items()
    }
    incoming = {peer: sum(sizes[n] for n in parts) for peer, parts in route.receive.items()}
    received = comm.exchange(outgoing, incoming)

    def install() -> _Done:
        for peer, parts in route.receive.items():
            data, pos = bytes(received[peer].numpy()), 0
            for n in parts:
                manifest.add_part(n, data[pos : pos + sizes[n]])
                pos += sizes[n]
        return _Done()

    all_reduce(comm, install, lambda _: _Done(), _Done, _Done)
    return reader


def _json_step(marker: bytes) -> int:
    import json

    return int(json.loads(marker)["step"])


@dataclass(frozen=True)
class _Route:
    """One rank's share of the exchange: the parts it reads, what it sends each peer and receives from each."""

    read: list[int]
    send: dict[int, list[int]]
    receive: dict[int, list[int]]


def _routes(comm: Comm, wanted: list[int]) -> _Route:
    """Each rank's route, decided on rank 0 from what every rank wants (gathered up the tree, scattered down it):
    each part is read by one of the ranks that want it, in turn by part number, and sent to the others."""
    gathered = comm.gather_bytes(struct.pack(f"<{len(wanted)}q", *wanted))
    routes = None
    if gathered is not None:
        wanting: dict[int, list[int]] = {}
        for rank, buf in enumerate(gathered):
            for n in struct.unpack(f"<{len(buf) // 8}q", buf):
                wanting.setdefault(n, []).append(rank)
        plans: list[_Route] = [_Route([], {}, {}) for _ in range(comm.world_size)]
        for n, ranks in sorted(wanting.items()):
            reader = ranks[n % len(ranks)]
            plans[reader].read.append(n)
            for rank in ranks:
                if rank != reader:
                    plans[reader].send.setdefault(rank, []).append(n)
                    plans[rank].receive.setdefault(reader, []).append(n)
        routes = [_encode_route(r) for r in plans]
    return _decode_route(comm.scatter_bytes(routes))


def _encode_route(route: _Route) -> bytes:
    """[reads, then per peer sent to (peer, count, parts), then per peer received from], as int64s with counts."""
    out = [len(route.read), *route.read]
    for table in (route.send, route.receive):
        out.append(len(table))
        for peer, parts in table.items():
            out += [peer, len(parts), *parts]
    return struct.pack(f"<{len(out)}q", *out)


def _decode_route(buf: bytes) -> _Route:
    values = list(struct.unpack(f"<{len(buf) // 8}q", buf))
    pos = 0

    def take(n: int) -> list[int]:
        nonlocal pos
        pos += n
        return values[pos - n : pos]

    read = take(take(1)[0])
    tables: list[dict[int, list[int]]] = []
    for _ in range(2):
        table = {}
        for _ in range(take(1)[0]):
            peer, count = take(2)
            table[peer] = take(count)
        tables.append(table)
    return _Route(read, tables[0], tables[1])
