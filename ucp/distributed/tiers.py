"""A hot tier: the newest steps kept in node-local storage (a directory in /dev/shm, say) as well as at the durable
URL, so that a job that loses a node restarts from memory of the nodes left, not from remote storage.

Saving a step (`HotTier.plan_save` and the hooks it adds; every rank, in the save's background job):

1. the save runs as an ordinary one whose storage is, on each rank, its node's local directory: every rank writes
   its objects there and rank 0 commits the attempt in its node's directory (`ucp.protocol.session`);
2. `replicate`: every rank sends the objects it wrote to a rank of the next node (the nodes form a ring), which
   writes them into its node's directory, so losing any one node loses no hot copy;
3. `publish`: rank 0 sends the manifest and the marker to the other nodes, whose leaders commit the step there;
4. `drain`, every `durable_every`-th save: every rank copies what it wrote to the durable URL, where the step is
   committed as an ordinary save of its own (its own attempt and exclusive commit).
Each node keeps its newest `keep_last` hot steps; the durable URL keeps what the manager's `keep_last` says.

Restoring (`HotTier.restore_sharded`, every rank):

1. each node says which steps it holds committed; the newest step whose objects the surviving nodes hold between
   them (or that the durable URL also holds) or the durable URL's newest step, whichever is newer, is taken;
   hot steps newer than it (a timeline the job will now redo) are removed;
2. each node checks every copy it holds of that step against the commit's checksums, the work spread over its
   ranks; a damaged copy is dropped, reported, and served by another node or the durable URL instead;
3. each rank reads what its node holds, receives over the process group what only other nodes hold (a rank never
   reads another node's directory: on a cluster it cannot) and reads the rest from the durable URL.

Nodes are told apart by host name and local directory (one machine can stand in for several nodes in tests, each
with its own directory). The hot tier of a run lives in `<local_dir>/<hash of the durable URL>`, so that runs that
share a local directory never mix. What one save attempt wrote, read back for replication, is held in memory in
batches of at most `transfer_bytes`.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import hashlib
import json
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.workpool import pack
from ..engine.checkpoint import CheckpointReader, SaveOptions
from ..errors import CheckpointNotFoundError, FormatError, IntegrityError, ObjectMissingError, StorageError, UcpError
from ..format.manifest import ZARR_JSON, AtomMeta, StepManifest, chunk_indices
from ..protocol import attempt, commit
from ..protocol.comm import Comm, LocalComm
from ..protocol.commit import CommitRecord
from ..protocol.coordination import all_gather, broadcast
from ..protocol.session import SaveSession, ensure_root
from ..storage import Capabilities, IOStats, LocalStorage, ReadableStorage, Storage, scatter_into

log = logging.getLogger("ucp")

DEFAULT_TRANSFER_BYTES = 256 << 20


def run_directory(local_dir: str, durable_url: str) -> str:
    """Where a run's hot tier lives in a node's local directory: one directory per durable URL."""
    return os.path.join(local_dir, f"run-{hashlib.sha1(durable_url.rstrip('/').encode()).hexdigest()[:12]}")


# ------------------------------------------------------------------------------- what crosses ranks
# (`ucp.protocol.coordination`; the objects themselves go point to point, `send_rounds`)


@dataclass(frozen=True)
class NodePlace:
    """Where a rank runs: its host and its node's local directory (two ranks with both alike share a node)."""

    host: str
    directory: str

    def to_json(self) -> list:
        return [self.host, self.directory]

    @classmethod
    def from_json(cls, doc: Any) -> NodePlace:
        host, directory = doc
        return cls(str(host), str(directory))


@dataclass(frozen=True)
class Holdings:
    """The steps a rank's node holds committed, and (from rank 0 only) the durable URL's newest."""

    hot: list[int]
    durable: int | None

    def to_json(self) -> dict:
        return {"hot": self.hot, "durable": self.durable}

    @classmethod
    def from_json(cls, doc: Any) -> Holdings:
        durable = doc["durable"]
        return cls([int(s) for s in doc["hot"]], int(durable) if durable is not None else None)


@dataclass(frozen=True)
class Checked:
    """Which of the step's objects (numbered as `_object_list`) a rank found intact in its share of its node's
    copies, and the damaged ones it found (named with their error)."""

    ok: list[bool]
    damaged: list[str]

    def to_json(self) -> dict:
        bits = bytearray((len(self.ok) + 7) // 8)  # (a bit per object: a million objects are 170 KB of JSON)
        for i, intact in enumerate(self.ok):
            if intact:
                bits[i // 8] |= 1 << (i % 8)
        return {"n": len(self.ok), "ok": base64.b64encode(bytes(bits)).decode(), "damaged": self.damaged}

    @classmethod
    def from_json(cls, doc: Any) -> Checked:
        bits = base64.b64decode(doc["ok"])
        return cls([bool(bits[i // 8] & (1 << (i % 8))) for i in range(int(doc["n"]))], list(doc["damaged"]))


@dataclass(frozen=True)
class Needs:
    """The objects a rank reads to restore (numbered as `_object_list`)."""

    objects: list[int]

    def to_json(self) -> list[int]:
        return self.objects

    @classmethod
    def from_json(cls, doc: Any) -> Needs:
        return cls([int(i) for i in doc])


@dataclass(frozen=True)
class Published:
    """Rank 0 to every rank: the commit marker and the manifest of the step it committed in its node's directory,
    byte for byte (the marker holds the manifest's checksum)."""

    marker: bytes
    manifest: bytes

    def to_json(self) -> dict:
        return {"marker": base64.b64encode(self.marker).decode(), "manifest": base64.b64encode(self.manifest).decode()}

    @classmethod
    def from_json(cls, doc: Any) -> Published:
        return cls(base64.b64decode(doc["marker"]), base64.b64decode(doc["manifest"]))


# ------------------------------------------------------------------------------------------------ nodes


@dataclass(frozen=True)
class Nodes:
    """Which node each rank runs on; nodes are numbered in the order of their lowest rank."""

    node_of: tuple[int, ...]

    @property
    def count(self) -> int:
        return max(self.node_of) + 1

    def ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def leader(self, node: int) -> int:
        return self.ranks(node)[0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.node_of[rank]) == rank

    def buddy(self, rank: int) -> int | None:
        """The rank of the next node that keeps `rank`'s replicas (None with a single node)."""
        if self.count == 1:
            return None
        mine = self.ranks(self.node_of[rank])
        others = self.ranks((self.node_of[rank] + 1) % self.count)
        return others[mine.index(rank) % len(others)]

    def senders_to(self, rank: int) -> list[int]:
        """The ranks whose replicas `rank` keeps."""
        return [r for r in range(len(self.node_of)) if self.buddy(r) == rank]


def find_nodes(comm: Comm, local_dir: str) -> Nodes:
    """Which node each rank runs on (a collective: every rank calls it together)."""
    places = all_gather(comm, lambda: NodePlace(socket.gethostname(), os.path.realpath(local_dir)), NodePlace)
    order = list(dict.fromkeys(places))
    return Nodes(tuple(order.index(p) for p in places))


# ------------------------------------------------------------------------------------------ transfers


Fill = Callable[[memoryview], object]  # writes an item's bytes into the memory it is given
Item = tuple[str, int, Fill]  # (name, size, fill)


def from_storage(storage: Storage, key: str, size: int) -> Item:
    """An item read from `storage` straight into the send buffer (one copy)."""
    return key, size, lambda dest: storage.read_into(key, 0, [dest])


def from_bytes(name: str, data: bytes) -> Item:
    def fill(dest: memoryview) -> None:
        dest[:] = data

    return name, len(data), fill


def _pack(items: list[Item], more: bool) -> torch.Tensor:
    """Named items in one buffer: an 8-byte header length, a JSON header, then the items' bytes back to back."""
    header = json.dumps({"items": [[name, size] for name, size, _ in items], "more": more}).encode()
    buf = torch.empty(8 + len(header) + sum(size for _, size, _ in items), dtype=torch.uint8)
    view = buf.numpy().data
    view[:8] = struct.pack("<Q", len(header))
    view[8 : 8 + len(header)] = header
    pos = 8 + len(header)
    for _, size, fill in items:
        fill(view[pos : pos + size])
        pos += size
    return buf


def _unpack(buf: torch.Tensor) -> tuple[dict[str, memoryview], bool]:
    """The items of a buffer, as views of it (no copy), and whether more buffers follow."""
    view = buf.numpy().data
    (n,) = struct.unpack("<Q", view[:8])
    header = json.loads(bytes(view[8 : 8 + n]))
    pos, out = 8 + n, {}
    for name, size in header["items"]:
        out[name] = view[pos : pos + size]
        pos += size
    return out, header["more"]


def send_rounds(
    comm: Comm,
    sends: dict[int, list[list[Item]]],
    receives: Iterable[int],
    on_receive: Callable[[int, dict[str, memoryview]], None],
) -> None:
    """Point-to-point transfers in rounds: `sends[peer]` is this rank's batches for `peer` (each a list of items
    filled when the batch is sent, so that one batch at a time is in memory), `receives` the peers that send to
    this rank. Each batch says whether more follow; every peer in `sends` gets at least one (maybe empty) batch.
    `on_receive` gets views of the received buffer: it must copy what it keeps beyond the call."""
    pending = {peer: list(batches) or [[]] for peer, batches in sends.items()}
    expecting = set(receives)
    while pending or expecting:
        out = {}
        for peer, batches in pending.items():
            batch = batches.pop(0)
            out[peer] = _pack(batch, more=bool(batches))  # (what is left after this one)
        lengths = comm.exchange(
            {p: torch.tensor([t.numel()], dtype=torch.int64).view(torch.uint8) for p, t in out.items()},
            dict.fromkeys(expecting, 8),
        )
        data = comm.exchange(out, {p: int(lengths[p].view(torch.int64)) for p in expecting})
        pending = {p: b for p, b in pending.items() if b}
        for peer, buf in data.items():
            items, more = _unpack(buf)
            if not more:
                expecting.discard(peer)
            on_receive(peer, items)


# ----------------------------------------------------------------------------------------------- tier


@dataclass
class RestoreReport:
    """Where a hot-tier restore read from: the step, and bytes per tier (this node, other nodes, durable URL)."""

    step: int
    source: str  # "hot" or "durable"
    bytes_local: int = 0
    bytes_peers: int = 0
    bytes_durable: int = 0
    damaged: list[str] = field(default_factory=list)  # hot copies that failed their checksums (and were replaced)


class HotTier:
    """One rank's view of a run's hot tier: its node's directory and the other nodes (every rank builds one, in
    the same order: finding the nodes is a collective)."""

    def __init__(
        self,
        local_dir: str,
        durable_url: str,
        comm: Comm | None,
        *,
        keep_last: int = 2,
        durable_every: int = 1,
        transfer_bytes: int = DEFAULT_TRANSFER_BYTES,
        fsync: bool = True,
    ):
        """A collective: every rank of `comm` constructs its HotTier together (finding the nodes exchanges each
        rank's host and directory); each node's leader then collects its directory's garbage (IO)."""
        if keep_last < 1 or durable_every < 1:
            raise ValueError(
                f"the hot tier keeps at least 1 step (local_keep) and makes every Nth durable with N at least 1 "
                f"(durable_every), got {keep_last} and {durable_every}"
            )
        self.storage = LocalStorage(run_directory(local_dir, durable_url), fsync=fsync)
        self.comm: Comm = comm or LocalComm()
        self.keep_last, self.durable_every, self.transfer_bytes = keep_last, durable_every, transfer_bytes
        self.nodes = find_nodes(self.comm, local_dir)
        self.saves = 0
        if self.is_leader:
            attempt.collect_garbage(self.storage)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def is_leader(self) -> bool:
        return self.nodes.is_leader(self.rank)

    # -- saving

    def attach(
        self,
        session: SaveSession,
        documents: list[str],
        manifest: StepManifest | None,
        durable: Storage,
        options: SaveOptions,
        on_durable: Callable[[CommitRecord | None], None],
    ) -> None:
        """Add the hot tier's steps (module doc, 2-4) to a save whose storage is `self.storage`: they run after the
        attempt commits on rank 0's node. `documents`: the zarr.json keys this rank wrote; `manifest`: rank 0's."""
        self.saves += 1
        drain = self.saves % self.durable_every == 0

        def after_commit(record: CommitRecord | None) -> None:
            self.replicate(session)
            self.publish(session)
            if self.is_leader:
                self.apply_retention()
            if drain:
                on_durable(self.drain(session, documents, manifest, durable, options))

        session.after_commit.append(after_commit)

    def replicate(self, session: SaveSession) -> int:
        """Step 2: send the objects this rank wrote to its buddy and keep the replicas sent to it; returns the bytes
        received."""
        objects = session.objects
        buddy = self.nodes.buddy(self.rank)
        received = 0

        def keep(_peer: int, items: dict[str, memoryview]) -> None:
            nonlocal received
            for key, data in items.items():
                self.storage.write(key, [data])
                received += data.nbytes

        batches = [
            [from_storage(self.storage, k, objects[k][0]) for k in keys]
            for keys in pack({k: s[0] for k, s in objects.items()}, self.transfer_bytes)
        ]
        send_rounds(self.comm, {buddy: batches} if buddy is not None else {}, self.nodes.senders_to(self.rank), keep)
        self.storage.flush()
        return received

    def publish(self, session: SaveSession) -> None:
        """Step 3: the leaders of the other nodes commit the step in their directories with rank 0's manifest."""
        if self.nodes.count == 1:
            return

        def committed() -> Published:
            marker = bytes(self.storage.read(commit.marker_key(session.step)))
            return Published(marker, bytes(self.storage.read(f"{session.prefix}/{ZARR_JSON}")))

        published = broadcast(self.comm, committed, Published)
        if self.is_leader and self.nodes.node_of[self.rank] != self.nodes.node_of[0]:
            ensure_root(self.storage)
            self.storage.write(f"{session.prefix}/{ZARR_JSON}", [published.manifest])
            self.storage.flush()
            if not commit.create_once(self.storage, commit.marker_key(session.step), published.marker):
                log.warning(
                    "hot tier %s: step %d was committed here before by another save; kept as it was",
                    self.storage.url,
                    session.step,
                )

    def apply_retention(self) -> None:
        for step in commit.committed_steps(self.storage)[: -self.keep_last]:
            commit.delete_step(self.storage, step)
        attempt.collect_garbage(self.storage)

    def drain(
        self,
        session: SaveSession,
        documents: list[str],
        manifest: StepManifest | None,
        durable: Storage,
        options: SaveOptions,
    ) -> CommitRecord | None:
        """Step 4: copy what this rank wrote to the durable URL and commit the step there (every rank)."""
        target = SaveSession.begin(durable, session.step, self.comm)
        try:
            objects = session.objects
            moved = {key: f"{target.prefix}{key[len(session.prefix) :]}" for key in [*objects, *documents]}

            def copy(key: str) -> None:
                durable.write(moved[key], [bytes(self.storage.read(key))])
                if key in objects:
                    target.record(moved[key], *objects[key])

            for path, chunks in session.packed.items():  # the packs keep their names, so their chunks their places
                target.record_packed(path, chunks)

            with cf.ThreadPoolExecutor(options.io_threads or durable.capabilities.io_threads) as pool:
                list(pool.map(copy, moved))
            durable.flush()
        except BaseException as e:  # noqa: BLE001 -- raised on every rank (with any other rank's), the attempt removed
            target.fail(e)
        return target.finish(manifest)

    # -- restoring

    def restore_sharded(
        self,
        model: Any,
        durable: Storage,
        into: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any], Any, RestoreReport]:
        """This rank's local state of the newest restorable step (module doc), its extra state, the LoadReport and
        where the bytes came from; `into` and `device` as `load_sharded` takes them. Every rank calls it together."""
        from .read_plan import ReadPlan, plan_reads
        from .sharded_load import load_sharded, run_plan
        from .sharded_model import extra_state

        chosen = self._choose_step(durable)
        if chosen.source == "durable":
            reader = CheckpointReader(durable, chosen.step)
            local, report = load_sharded(reader, model, self.rank, into=into, device=device)
            return (
                local,
                extra_state(reader),
                report,
                RestoreReport(chosen.step, "durable", bytes_durable=report.bytes_read),
            )
        assert chosen.reader is not None and chosen.held is not None
        reader, held = chosen.reader, chosen.held
        objects = _object_list(reader.atoms)
        number = {o: i for i, o in enumerate(objects)}
        # One plan: what this rank asks the other nodes for is what its load then reads. A plan the step refuses (an
        # atom it lacks, an `into` tensor of another shape) is raised once this rank has done its part of the
        # exchange, in which the other ranks wait for it.
        plan: ReadPlan | UcpError
        try:
            plan = plan_reads(reader.atoms, model, self.rank, into=into, step=chosen.step)
        except UcpError as e:
            plan = e
        planned = plan.objects() if isinstance(plan, ReadPlan) else set()
        needs = sorted(number[o] for o in planned | _extra_objects(reader))
        serve: dict[int, dict[str, int]] = {}  # peer -> {key: nbytes} that this rank sends it
        receives: set[int] = set()
        for rank, wanted in enumerate(all_gather(self.comm, lambda: Needs(needs), Needs)):
            node = self.nodes.node_of[rank]
            for i in wanted.objects:
                holder = next((n for n in range(self.nodes.count) if held[n][i]), None)
                if held[node][i] or holder is None:
                    continue  # read on its own node, or from the durable URL
                ranks = self.nodes.ranks(holder)
                server = ranks[i % len(ranks)]
                if server == self.rank:
                    key = _key(reader, objects[i])
                    serve.setdefault(rank, {})[key] = reader.recorded(reader.atoms[objects[i][0]], objects[i][1])[0]  # type: ignore[index]
                elif rank == self.rank:
                    receives.add(server)
        fetched: dict[str, bytes] = {}
        sends = {
            peer: [[from_storage(self.storage, k, sizes[k]) for k in keys] for keys in pack(sizes, self.transfer_bytes)]
            for peer, sizes in serve.items()
        }
        send_rounds(
            self.comm, sends, receives, lambda _peer, items: fetched.update((k, bytes(v)) for k, v in items.items())
        )
        my_node = self.nodes.node_of[self.rank]
        # an object is usable here if every chunk it holds is intact here (a pack holds many)
        keys = [_key(reader, o) for o in objects]
        usable = set(keys) - {k for k, ok in zip(keys, held[my_node]) if not ok}
        durable_reader = CheckpointReader(durable, chosen.step) if chosen.durable_too else None
        source = TierSource(self.storage, usable, fetched, durable_reader)
        tiered = CheckpointReader(source, committed=(reader.record, chosen.manifest_bytes))
        if not isinstance(plan, ReadPlan):
            raise plan
        local, report = run_plan(tiered, plan, into=into, device=device)
        extra = extra_state(tiered)
        stats = source.read_stats
        restore = RestoreReport(
            chosen.step,
            "hot",
            stats["local"].bytes_read,
            stats["peers"].bytes_read,
            stats["durable"].bytes_read,
            chosen.damaged,
        )
        if restore.damaged and self.rank == 0:
            log.warning(
                "hot tier: %d damaged copies of step %d were served by good ones instead: %s",
                len(restore.damaged),
                chosen.step,
                restore.damaged[:3],
            )
        return local, extra, report, restore

    def _choose_step(self, durable: Storage) -> _Choice:
        """The step to restore (module doc, 1 and 2). Hot steps newer than it are removed: the job redoes them."""

        def holdings() -> Holdings:
            durable_steps = commit.committed_steps(durable) if self.rank == 0 else []
            return Holdings(commit.committed_steps(self.storage), durable_steps[-1] if durable_steps else None)

        reports = all_gather(self.comm, holdings, Holdings, failed=lambda f: f.error("hot tier: choosing the step"))
        mine = reports[self.rank].hot
        durable_latest = reports[0].durable
        chosen = None
        for step in sorted({s for r in reports for s in r.hot}, reverse=True):
            if durable_latest is not None and step < durable_latest:
                break
            choice = _Choice(
                step, "hot", [r for r, rep in enumerate(reports) if step in rep.hot], durable_latest == step
            )
            self._load_holdings(choice)
            assert choice.held is not None
            if choice.durable_too or all(any(node[i] for node in choice.held) for i in range(len(choice.held[0]))):
                chosen = choice
                break
            log.warning("hot tier: step %d is not held whole by the surviving nodes; trying an older one", step)
        if chosen is None and durable_latest is not None:
            chosen = _Choice(durable_latest, "durable", [], True)
        if self.is_leader:  # a timeline the job will now redo (all of it, on a fresh start)
            for step in mine:
                if chosen is None or step > chosen.step:
                    commit.delete_step(self.storage, step)
        if chosen is None:
            raise CheckpointNotFoundError(f"no committed step at {durable.url} nor held whole by the nodes' hot tiers")
        return chosen

    def _load_holdings(self, choice: _Choice) -> None:
        """The step's commit record and manifest (read here, or received from the lowest rank whose node holds the
        step: a node that joined holds nothing), and per node which objects it holds intact: each rank checks its
        share of its node's copies against the commit's checksums."""
        from ..engine.inspection import check_object

        holder = choice.ranks[0]
        lacking = [r for r in range(self.comm.world_size) if r not in choice.ranks]
        marker = manifest_bytes = b""
        if self.rank in choice.ranks:
            marker = bytes(self.storage.read(commit.marker_key(choice.step)))
            record = commit.parse_marker(marker, choice.step, f"{self.storage.url}/{commit.marker_key(choice.step)}")
            manifest_bytes = commit.read_manifest_bytes(self.storage, record)
        got: dict[str, bytes] = {}
        sends = (
            {r: [[from_bytes("marker", marker), from_bytes("manifest", manifest_bytes)]] for r in lacking}
            if self.rank == holder
            else {}
        )
        send_rounds(
            self.comm,
            sends,
            [holder] if self.rank in lacking else [],
            lambda _peer, items: got.update((k, bytes(v)) for k, v in items.items()),
        )
        if got:
            marker, manifest_bytes = got["marker"], got["manifest"]
        record = commit.parse_marker(marker, choice.step, f"hot tier step {choice.step} from rank {holder}")
        reader = CheckpointReader(self.storage, committed=(record, manifest_bytes))
        objects = _object_list(reader.atoms)
        node_ranks = self.nodes.ranks(self.nodes.node_of[self.rank])
        share = node_ranks.index(self.rank)

        def check() -> Checked:
            ok = [False] * len(objects)
            damaged: list[str] = []
            if self.rank in choice.ranks:
                for i, (path, index) in enumerate(objects):
                    if i % len(node_ranks) != share:
                        continue
                    try:
                        check_object(reader, reader.atoms[path], index)
                        ok[i] = True
                    except ObjectMissingError:
                        pass  # (not held here: another node's copy or the durable URL serves it)
                    except (IntegrityError, FormatError, StorageError) as e:
                        damaged.append(f"{self.storage.url}: {e}")
            return Checked(ok, damaged)

        held = [[False] * len(objects) for _ in range(self.nodes.count)]
        checks = all_gather(
            self.comm, check, Checked, failed=lambda f: f.error(f"hot tier: checking step {choice.step}")
        )
        for rank, checked in enumerate(checks):
            node = self.nodes.node_of[rank]
            held[node] = [h or b for h, b in zip(held[node], checked.ok)]
            choice.damaged += checked.damaged
        choice.reader, choice.manifest_bytes, choice.held = reader, manifest_bytes, held


@dataclass
class _Choice:
    """A step considered for a restore, and (for a hot one) what the surviving nodes hold of it."""

    step: int
    source: str  # "hot" or "durable"
    ranks: list[int]  # the ranks whose node holds the step committed
    durable_too: bool  # the durable URL holds it committed as well
    reader: CheckpointReader | None = None
    manifest_bytes: bytes = b""
    held: list[list[bool]] | None = None  # per node, per object: an intact copy is there
    damaged: list[str] = field(default_factory=list)


def _object_list(atoms: dict[str, AtomMeta]) -> list[tuple[str, tuple[int, ...]]]:
    return [(path, index) for path, meta in atoms.items() for index in chunk_indices(meta.grid)]


def _extra_objects(reader: CheckpointReader) -> set[tuple[str, tuple[int, ...]]]:
    """The objects of the extra state's atoms, which every rank reads whole."""
    from ..format import tree

    node = reader.manifest.tree["dict"].get("extra")
    paths = tree.tree_atoms(node) if node is not None else []
    return {(p, i) for p in paths for i in chunk_indices(reader.atoms[p].grid)}


def _key(reader: CheckpointReader, obj: tuple[str, tuple[int, ...]]) -> str:
    """The key of the object that holds a chunk (of a packed atom: its pack, which holds other chunks too)."""
    return reader.object_key(reader.atoms[obj[0]], obj[1])


class TierSource(ReadableStorage):
    """Reads of one step's objects from wherever they are: this node's hot copies (`usable`: those verified),
    objects received from other nodes, or the durable URL (another attempt id, hence the key mapping). It can only
    be read: a save handed it is refused (`storage.writable`)."""

    def __init__(self, local: Storage, usable: set[str], fetched: dict[str, bytes], durable: CheckpointReader | None):
        self.local, self.usable, self.fetched, self.durable = local, usable, fetched, durable
        self.url = local.url
        self.stats = IOStats()
        # (reads go to memory, a local directory or the durable URL, key by key: no one store's traits hold for all)
        self.capabilities = Capabilities()
        self.read_stats = {"local": IOStats(), "peers": IOStats(), "durable": IOStats()}

    def _route(self, key: str) -> tuple[str, ReadableStorage | None, str]:
        if key in self.fetched:
            return "peers", None, key
        if key in self.usable:
            return "local", self.local, key
        if self.durable is None:
            raise IntegrityError(f"{key}: no surviving node holds an intact copy and the durable URL lacks its step")
        within_attempt = key.split("/", 2)[2]  # step_N/attempt-.../<atom>/<chunk>
        return "durable", self.durable.storage, f"{self.durable.prefix}/{within_attempt}"

    def read(self, key: str, start: int = 0, end: int | None = None) -> memoryview:
        tier, storage, mapped = self._route(key)
        data = memoryview(self.fetched[key])[start:end] if storage is None else storage.read(mapped, start, end)
        self.read_stats[tier].record_read(data.nbytes)
        self.stats.record_read(data.nbytes)
        return data

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> int:
        tier, storage, mapped = self._route(key)
        if storage is None:
            got = scatter_into(memoryview(self.fetched[key])[offset:], buffers)
        else:
            got = storage.read_into(mapped, offset, buffers)
        self.read_stats[tier].record_read(got)
        self.stats.record_read(got)
        return got

    def exists(self, key: str) -> bool:
        return self.local.exists(key)

    def listdir(self, key: str = "") -> list[str]:
        return self.local.listdir(key)
