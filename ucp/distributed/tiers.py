"""A hot tier: the newest steps kept in node-local storage (a directory in /dev/shm, say) as well as at the durable
URL, so that a job that loses a node restarts from memory of the nodes left, not from remote storage.

Saving a step (`HotTier.plan_save` and the hooks it adds; every rank, in the save's background job):

1. the save runs as an ordinary one whose storage is, on each rank, its node's local directory: every rank writes
   its objects there and rank 0 commits the attempt in its node's directory (`ucp.protocol.session`);
2. `replicate`: every rank sends the objects it wrote to a rank of the next node (the nodes form a ring), which
   writes them into its node's directory, so losing any one node loses no hot copy;
3. `publish`: rank 0 sends the manifest and the marker to the other nodes, whose leaders commit the step there;
4. `drain`, every `durable_every`-th save: every rank copies what it wrote to the durable URL, where the step is
   committed as an ordinary save of its own (its own attempt and exclusive commit). The saves since the last drain
   are counted across restarts of the job (`UNDRAINED_KEY`, in each node's directory), so that a job restarted
   more often than every `durable_every` saves still drains.
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

import array
import base64
import concurrent.futures as cf
import hashlib
import itertools
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
from ..errors import (
    CheckpointNotFoundError,
    FormatError,
    IntegrityError,
    ObjectMissingError,
    PeerLostError,
    StorageError,
    UcpError,
)
from ..format.manifest import ZARR_JSON, AtomMeta, StepManifest, chunk_indices
from ..protocol import attempt, commit
from ..protocol.comm import Comm, LocalComm, exchange_sizes
from ..protocol.commit import CommitRecord
from ..protocol.coordination import all_reduce, broadcast
from ..protocol.session import SaveSession, ensure_root, root_id
from ..storage import Capabilities, IOStats, LocalStorage, ReadableStorage, Storage, scatter_into

log = logging.getLogger("ucp")

DEFAULT_TRANSFER_BYTES = 256 << 20
UNDRAINED_KEY = "undrained.json"  # in a node's run directory: {"saves": the hot saves committed since the last drain}
ROOT_KEY = "root.json"  # in a node's run directory: {"url": the durable URL, "id": the id of the root its steps are of}


def run_directory(local_dir: str, durable_url: str) -> str:
    """Where a run's hot tier lives in a node's local directory: one directory per durable URL (as its storage
    names it: a local path made absolute)."""
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
class NodeMap:
    """Rank 0 to every rank: which node each rank runs on (`Nodes.node_of`)."""

    node_of: list[int]

    def to_json(self) -> list[int]:
        return self.node_of

    @classmethod
    def from_json(cls, doc: Any) -> NodeMap:
        return cls([int(n) for n in doc])


@dataclass(frozen=True)
class Undrained:
    """A node's count of hot saves committed since the last drain (from its leader; 0 from the other ranks), and
    rank 0's decision: the largest, so that a node that lost its count (a new node) never delays a drain."""

    saves: int

    def to_json(self) -> int:
        return self.saves

    @classmethod
    def from_json(cls, doc: Any) -> Undrained:
        return cls(int(doc))


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
class RootId:
    """Rank 0 to every rank: the durable root's id (None: a root without one, written by an older ucp)."""

    id: str | None

    def to_json(self) -> dict:
        return {"id": self.id}

    @classmethod
    def from_json(cls, doc: Any) -> RootId:
        return cls(doc["id"])


@dataclass(frozen=True)
class Candidates:
    """Rank 0 to every rank: the hot steps worth trying, newest first, each with the lowest rank of each node that
    holds it (one of them hands the step's marker and manifest to the others: the first whose copy reads), and the
    durable URL's newest step."""

    hot: list[tuple[int, list[int]]]  # (step, holding ranks)
    durable: int | None

    def to_json(self) -> dict:
        return {"hot": [[step, ranks] for step, ranks in self.hot], "durable": self.durable}

    @classmethod
    def from_json(cls, doc: Any) -> Candidates:
        durable = doc["durable"]
        hot = [(int(step), [int(r) for r in ranks]) for step, ranks in doc["hot"]]
        return cls(hot, int(durable) if durable is not None else None)


def _ints(values: Sequence[int]) -> str:
    return base64.b64encode(array.array("I", values).tobytes()).decode()


def _from_ints(text: str) -> array.array:
    out = array.array("I")
    out.frombytes(base64.b64decode(text))
    return out


@dataclass(frozen=True)
class Checked:
    """The objects of the step (numbered as `_object_list`) that a rank found intact in its share of its node's
    copies, and the damaged ones it found (named with their error). Only what it holds: a rank's message grows with
    its share, not with the step."""

    intact: list[int]
    damaged: list[str]

    def to_json(self) -> dict:
        return {"intact": _ints(self.intact), "damaged": self.damaged}

    @classmethod
    def from_json(cls, doc: Any) -> Checked:
        return cls(list(_from_ints(doc["intact"])), list(doc["damaged"]))


@dataclass(frozen=True)
class Directory:
    """Rank 0 to every rank: which nodes hold an intact copy of each object of the step (object i's nodes are
    `nodes[starts[i]:starts[i + 1]]`), and every damaged copy found. Its size is the step's objects and their copies
    (two each, a node's and its buddy's), whatever the number of ranks: every rank plans its own reads from it."""

    starts: Sequence[int]
    nodes: Sequence[int]
    damaged: list[str]

    @classmethod
    def of(cls, holders: list[list[int]], damaged: list[str]) -> Directory:
        starts = array.array("I", [0, *itertools.accumulate(len(h) for h in holders)])
        return cls(starts, array.array("I", [n for h in holders for n in h]), damaged)

    def holders(self, i: int) -> Sequence[int]:
        return self.nodes[self.starts[i] : self.starts[i + 1]]

    @property
    def whole(self) -> bool:
        """Every object has an intact copy on some node."""
        return all(b > a for a, b in itertools.pairwise(self.starts))

    def to_json(self) -> dict:
        return {"starts": _ints(self.starts), "nodes": _ints(self.nodes), "damaged": self.damaged}

    @classmethod
    def from_json(cls, doc: Any) -> Directory:
        return cls(_from_ints(doc["starts"]), _from_ints(doc["nodes"]), list(doc["damaged"]))


@dataclass(frozen=True)
class Published:
    """Rank 0 to every rank: the commit marker and the manifest of the step it committed in its node's directory,
    and the manifest's index parts (format 3.1), byte for byte (the marker holds the manifest's checksum, the
    manifest each part's)."""

    marker: bytes
    manifest: bytes
    index: dict[str, bytes] = field(default_factory=dict)  # name below the attempt -> bytes

    def to_json(self) -> dict:
        return {
            "marker": base64.b64encode(self.marker).decode(),
            "manifest": base64.b64encode(self.manifest).decode(),
            "index": {name: base64.b64encode(data).decode() for name, data in self.index.items()},
        }

    @classmethod
    def from_json(cls, doc: Any) -> Published:
        index = {name: base64.b64decode(data) for name, data in doc["index"].items()}
        return cls(base64.b64decode(doc["marker"]), base64.b64decode(doc["manifest"]), index)


# ------------------------------------------------------------------------------------------------ nodes


@dataclass(frozen=True)
class Nodes:
    """Which node each rank runs on; nodes are numbered in the order of their lowest rank. Each question about a
    rank's node costs that node's size, never the world's (a buddy or its senders asked on each of 100k ranks)."""

    node_of: tuple[int, ...]
    members: tuple[tuple[int, ...], ...] = field(init=False, repr=False)  # each node's ranks, in order
    position: tuple[int, ...] = field(init=False, repr=False)  # each rank's place among its node's ranks

    def __post_init__(self) -> None:
        members: list[list[int]] = [[] for _ in range(max(self.node_of, default=-1) + 1)]
        position = []
        for rank, node in enumerate(self.node_of):
            position.append(len(members[node]))
            members[node].append(rank)
        object.__setattr__(self, "members", tuple(map(tuple, members)))
        object.__setattr__(self, "position", tuple(position))

    @property
    def count(self) -> int:
        return len(self.members)

    def ranks(self, node: int) -> tuple[int, ...]:
        return self.members[node]

    def leader(self, node: int) -> int:
        return self.members[node][0]

    def is_leader(self, rank: int) -> bool:
        return self.position[rank] == 0

    def buddy(self, rank: int) -> int | None:
        """The rank of the next node that keeps `rank`'s replicas (None with a single node)."""
        if self.count == 1:
            return None
        others = self.members[(self.node_of[rank] + 1) % self.count]
        return others[self.position[rank] % len(others)]

    def senders_to(self, rank: int) -> list[int]:
        """The ranks whose replicas `rank` keeps: those of the previous node whose place, wrapped around this node's
        ranks, is `rank`'s (the inverse of `buddy`)."""
        if self.count == 1:
            return []
        node = self.node_of[rank]
        mine = len(self.members[node])
        previous = self.members[(node - 1) % self.count]
        return [r for i, r in enumerate(previous) if i % mine == self.position[rank]]


def find_nodes(comm: Comm, local_dir: str) -> Nodes:
    """Which node each rank runs on (a collective: every rank calls it together). Rank 0 numbers the places; every
    rank receives the numbers (a small integer a rank), not every rank's place."""

    def number(places: list[NodePlace]) -> NodeMap:
        order = {p: i for i, p in enumerate(dict.fromkeys(places))}
        return NodeMap([order[p] for p in places])

    place = NodePlace(socket.gethostname(), os.path.realpath(local_dir))
    return Nodes(tuple(all_reduce(comm, lambda: place, number, NodePlace, NodeMap).node_of))


# ------------------------------------------------------------------------------------------ transfers


Fill = Callable[[memoryview], object]  # writes an item's bytes into the memory it is given
Item = tuple[str, int, Fill]  # (name, size, fill)


def from_storage(storage: Storage, key: str, size: int) -> Item:
    """An item read from `storage` straight into the send buffer (one copy)."""

    def fill(dest: memoryview) -> None:
        got = storage.read_into(key, 0, [dest])
        if got != size:  # (a file cut short since it was written: never send what the buffer held before)
            raise StorageError(f"{storage.url}/{key}: {got} bytes read back of the {size} written")

    return key, size, fill


def from_bytes(name: str, data: bytes) -> Item:
    def fill(dest: memoryview) -> None:
        dest[:] = data

    return name, len(data), fill


def _pack(items: list[Item], more: bool) -> tuple[torch.Tensor, dict[str, UcpError]]:
    """Named items in one buffer: an 8-byte header length, a JSON header, then the items' bytes back to back; and the
    items left out, with why: one whose fill fails (an object this rank cannot read) is not sent, and the peer still
    gets its buffer, so the rounds stay in step (the header precedes the fills: a failure packs the batch again)."""
    failed: dict[str, UcpError] = {}
    while True:
        kept = [item for item in items if item[0] not in failed]
        header = json.dumps({"items": [[name, size] for name, size, _ in kept], "more": more}).encode()
        buf = torch.empty(8 + len(header) + sum(size for _, size, _ in kept), dtype=torch.uint8)
        view = buf.numpy().data
        view[:8] = struct.pack("<Q", len(header))
        view[8 : 8 + len(header)] = header
        pos = 8 + len(header)
        for name, size, fill in kept:
            try:
                fill(view[pos : pos + size])
            except UcpError as e:
                failed[name] = e
                break
            pos += size
        else:
            return buf, failed


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
) -> dict[str, UcpError]:
    """Point-to-point transfers in rounds: `sends[peer]` is this rank's batches for `peer` (each a list of items
    filled when the batch is sent, so that one batch at a time is in memory), `receives` the peers that send to
    this rank. Each batch says whether more follow; every peer in `sends` gets at least one (maybe empty) batch.
    `on_receive` gets views of the received buffer: it must copy what it keeps beyond the call. Returns the items
    this rank could not send, with why (left out of their batches: a receiver never gets them)."""
    pending = {peer: list(batches) or [[]] for peer, batches in sends.items()}
    expecting = set(receives)
    failed: dict[str, UcpError] = {}
    while pending or expecting:
        out = {}
        for peer, batches in pending.items():
            batch = batches.pop(0)
            out[peer], unsent = _pack(batch, more=bool(batches))  # (what is left after this one)
            failed.update(unsent)
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
    return failed


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
        durable: Storage,
        comm: Comm | None,
        *,
        keep_last: int = 2,
        durable_every: int = 1,
        transfer_bytes: int = DEFAULT_TRANSFER_BYTES,
        fsync: bool = True,
    ):
        """A collective: every rank of `comm` constructs its HotTier together (finding the nodes exchanges each
        rank's host and directory; rank 0 makes the durable root if there is none and tells every rank its id); each
        node's leader then removes steps kept for another root and collects its directory's garbage (IO)."""
        if keep_last < 1 or durable_every < 1:
            raise ValueError(
                f"the hot tier keeps at least 1 step (local_keep) and makes every Nth durable with N at least 1 "
                f"(durable_every), got {keep_last} and {durable_every}"
            )
        self.storage = LocalStorage(run_directory(local_dir, durable.url), fsync=fsync)
        self.comm: Comm = comm or LocalComm()
        self.keep_last, self.durable_every, self.transfer_bytes = keep_last, durable_every, transfer_bytes
        self.nodes = find_nodes(self.comm, local_dir)
        root = broadcast(self.comm, lambda: RootId(root_id(durable)), RootId)
        if self.is_leader:
            self._claim(durable.url, root.id)
            attempt.collect_garbage(self.storage)
        self.undrained = all_reduce(
            self.comm,
            lambda: Undrained(self._read_undrained() if self.is_leader else 0),
            lambda counts: Undrained(max(c.saves for c in counts)),
            Undrained,
            Undrained,
        ).saves

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
        *,
        drain: bool = False,
    ) -> None:
        """Add the hot tier's steps (module doc, 2-4) to a save whose storage is `self.storage`: they run after the
        attempt commits on rank 0's node. `documents`: the zarr.json keys this rank wrote; `manifest`: rank 0's;
        `drain`: drain this save whatever `durable_every` says."""
        # (the previous save's hooks have run: saves are in turn)
        drain = drain or self.undrained + 1 >= self.durable_every

        def after_commit(record: CommitRecord | None) -> None:
            # Every rank runs every step's collectives whatever failed on it before (a replica it could not write,
            # its node's retention): one that skipped the drain would take the others' next collective for its own.
            # The first failure is raised at the end (the save logs it: the step is committed); a lost peer at once.
            failures: list[Exception] = []
            drained = False

            def drain_step() -> None:
                nonlocal drained
                record = self.drain(session, documents, manifest, durable, options)
                drained = True  # (committed at the durable URL, or raised, on every rank alike)
                on_durable(record)

            works = [lambda: self.replicate(session), lambda: self.publish(session)]
            works += [self.apply_retention] if self.is_leader else []
            works += [drain_step] if drain else []
            for work in works:
                try:
                    work()
                except PeerLostError:
                    raise
                except Exception as e:  # noqa: BLE001 -- this rank's own failure: the others go on in step
                    failures.append(e)
            # A failed drain is tried again at the next save, not `durable_every` saves later.
            self.undrained = 0 if drained else self.undrained + 1
            if self.is_leader:
                try:
                    self.storage.write(UNDRAINED_KEY, [json.dumps({"saves": self.undrained}).encode()])
                except UcpError as e:
                    failures.append(e)
            if failures:
                raise failures[0]

        session.after_commit.append(after_commit)

    def _claim(self, durable_url: str, root: str | None) -> None:
        """Make this node's directory the hot tier of the durable root `root`: steps kept here for another root (one
        removed and made again at the URL, by a job that starts over) are another job's timeline, never restored:
        they are removed (logged). A directory of a root without an id (an older ucp's) is taken as this root's."""
        try:
            recorded = json.loads(bytes(self.storage.read(ROOT_KEY)))["id"]
        except FileNotFoundError:
            recorded = root if root is None else ""  # ("": no record, steps of unknown root if any)
        except (UcpError, ValueError, KeyError, TypeError):
            recorded = ""
        steps = commit.committed_steps(self.storage)
        if recorded != root:
            if steps:
                log.warning(
                    "hot tier %s: steps %s are of another root than the one now at %s; removed, not restored",
                    self.storage.url,
                    steps,
                    durable_url,
                )
            for step in steps:
                attempt.delete_step(self.storage, step)
            if self.storage.exists(UNDRAINED_KEY):
                self.storage.delete(UNDRAINED_KEY)
        if recorded != root or not self.storage.exists(ROOT_KEY):
            self.storage.write(ROOT_KEY, [json.dumps({"url": durable_url, "id": root}).encode()])
            self.storage.flush()

    def _read_undrained(self) -> int:
        """This node's count of saves since the last drain; a damaged count is taken as a drain due (logged)."""
        if not self.storage.exists(UNDRAINED_KEY):
            return 0
        try:
            saves = json.loads(bytes(self.storage.read(UNDRAINED_KEY)))["saves"]
            if type(saves) is not int or saves < 0:
                raise ValueError(f"not a count: {saves!r}")
            return saves
        except (UcpError, ValueError, KeyError, TypeError) as e:
            log.warning(
                "hot tier %s: %s is unreadable (%s); the next save drains to the durable URL",
                self.storage.url,
                UNDRAINED_KEY,
                e,
            )
            return self.durable_every - 1

    def replicate(self, session: SaveSession) -> int:
        """Step 2: send the objects this rank wrote to its buddy and keep the replicas sent to it; returns the bytes
        received."""
        objects = session.objects
        buddy = self.nodes.buddy(self.rank)
        received = 0

        failed: list[UcpError] = []

        def keep(_peer: int, items: dict[str, memoryview]) -> None:
            nonlocal received
            for key, data in items.items():
                try:
                    self.storage.write(key, [data])
                except UcpError as e:  # (a full node disk: the rounds go on, in step with the senders)
                    failed.append(e)
                    continue
                received += data.nbytes

        batches = [
            [from_storage(self.storage, k, objects[k][0]) for k in keys]
            for keys in pack({k: s[0] for k, s in objects.items()}, self.transfer_bytes)
        ]
        unsent = send_rounds(
            self.comm, {buddy: batches} if buddy is not None else {}, self.nodes.senders_to(self.rank), keep
        )
        if unsent:
            key, error = next(iter(unsent.items()))
            raise StorageError(
                f"hot tier {self.storage.url}: {len(unsent)} objects of this rank not replicated to rank {buddy} "
                f"(cannot be read back: {key}: {error})"
            )
        if failed:
            raise StorageError(f"hot tier {self.storage.url}: {len(failed)} replicas not kept: {failed[0]}")
        self.storage.flush()
        return received

    def publish(self, session: SaveSession) -> None:
        """Step 3: the leaders of the other nodes commit the step in their directories with rank 0's manifest."""
        if self.nodes.count == 1:
            return

        def committed() -> Published:
            marker = bytes(self.storage.read(commit.marker_key(session.step)))
            manifest = bytes(self.storage.read(f"{session.prefix}/{ZARR_JSON}"))
            return Published(marker, manifest, CheckpointReader(self.storage, session.step).index_parts())

        published = broadcast(self.comm, committed, Published)
        if self.is_leader and self.nodes.node_of[self.rank] != self.nodes.node_of[0]:
            ensure_root(self.storage)
            for name, data in published.index.items():
                self.storage.write(f"{session.prefix}/{name}", [data])
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
            attempt.delete_step(self.storage, step)
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
        assert chosen.reader is not None and chosen.directory is not None
        reader, directory = chosen.reader, chosen.directory
        objects = _object_list(reader.atoms)
        number = {o: i for i, o in enumerate(objects)}
        my_node = self.nodes.node_of[self.rank]
        # One plan: what this rank asks the other nodes for is what its load then reads. A plan the step refuses (an
        # atom it lacks, an `into` tensor of another shape) is raised once this rank has done its part of the
        # exchange, in which the other ranks wait for it.
        plan: ReadPlan | UcpError
        try:
            plan = plan_reads(reader.atoms, model, self.rank, into=into, step=chosen.step)
        except UcpError as e:
            plan = e
        planned = plan.objects() if isinstance(plan, ReadPlan) else set()
        # Where this rank reads each object from (a pack holds chunks of many atoms): this node, if its copy holds
        # intact every chunk the rank reads of it; else, whole, a node whose copy does (asked of one of its ranks,
        # spread over such nodes and their ranks); else the durable URL.
        keys = [_key(reader, o) for o in objects]
        read: dict[str, list[int]] = {}
        for i in sorted(number[o] for o in planned | _extra_objects(reader)):
            read.setdefault(keys[i], []).append(i)
        # (an object intact here whole is read here whatever reads it)
        usable = set(keys) - {k for i, k in enumerate(keys) if my_node not in directory.holders(i)}
        asks: dict[int, list[int]] = {}
        for key, chunks in read.items():
            intact = set(directory.holders(chunks[0])).intersection(*(directory.holders(i) for i in chunks[1:]))
            if my_node in intact:
                usable.add(key)
            elif intact:
                nodes, first = sorted(intact), chunks[0]
                ranks = self.nodes.ranks(nodes[first % len(nodes)])
                asks.setdefault(ranks[first % len(ranks)], []).append(first)
        sent = {peer: torch.tensor(wanted, dtype=torch.int64).view(torch.uint8) for peer, wanted in asks.items()}
        asked = self.comm.exchange(sent, exchange_sizes(self.comm, {p: t.numel() for p, t in sent.items()}))
        serve: dict[int, dict[str, int]] = {}  # peer -> {key: nbytes} that this rank sends it
        for peer, wanted in asked.items():
            for i in wanted.view(torch.int64).tolist():
                path, index = objects[i]
                key = _key(reader, objects[i])
                serve.setdefault(peer, {})[key] = reader.recorded(reader.atoms[path], index)[0]  # type: ignore[index]
        receives = set(asks)
        fetched: dict[str, bytes] = {}
        sends = {
            peer: [[from_storage(self.storage, k, sizes[k]) for k in keys] for keys in pack(sizes, self.transfer_bytes)]
            for peer, sizes in serve.items()
        }
        unsent = send_rounds(
            self.comm, sends, receives, lambda _peer, items: fetched.update((k, bytes(v)) for k, v in items.items())
        )
        if unsent:  # (the peers read those from the durable URL, or say that no intact copy is left)
            key, error = next(iter(unsent.items()))
            log.warning("hot tier: %d objects asked of rank %d not sent (%s: %s)", len(unsent), self.rank, key, error)
        durable_reader = CheckpointReader(durable, chosen.step) if chosen.durable_too else None
        source = TierSource(self.storage, usable, fetched, durable_reader)
        tiered = CheckpointReader(source, committed=(reader.record, chosen.manifest_bytes, chosen.index))
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
        mine = commit.committed_steps(self.storage)

        def holdings() -> Holdings:
            durable_steps = commit.committed_steps(durable) if self.rank == 0 else []
            return Holdings(mine, durable_steps[-1] if durable_steps else None)

        def candidates(reports: list[Holdings]) -> Candidates:
            durable_latest = reports[0].durable
            holders: dict[int, dict[int, int]] = {}  # step -> node -> its lowest rank that reported the step
            for rank, report in enumerate(reports):
                for step in report.hot:
                    holders.setdefault(step, {}).setdefault(self.nodes.node_of[rank], rank)
            hot = [
                (s, sorted(by_node.values()))
                for s, by_node in sorted(holders.items(), reverse=True)
                if durable_latest is None or s >= durable_latest
            ]
            return Candidates(hot, durable_latest)

        steps = all_reduce(
            self.comm,
            holdings,
            candidates,
            Holdings,
            Candidates,
            failed=lambda f: f.error("hot tier: choosing the step"),
        )
        chosen = None
        for step, holders in steps.hot:
            choice = _Choice(step, "hot", holders, steps.durable == step)
            if not self._load_holdings(choice, step in mine):
                if choice.durable_too:  # (no node's documents of it read: the durable URL's copy serves)
                    chosen = _Choice(step, "durable", [], True)
                    break
                continue
            assert choice.directory is not None
            if choice.durable_too or choice.directory.whole:
                chosen = choice
                break
            log.warning("hot tier: step %d is not held whole by the surviving nodes; trying an older one", step)
        if chosen is None and steps.durable is not None:
            chosen = _Choice(steps.durable, "durable", [], True)
        if self.is_leader:  # a timeline the job will now redo (all of it, on a fresh start)
            for step in mine:
                if chosen is None or step > chosen.step:
                    attempt.delete_step(self.storage, step)
        if chosen is None:
            raise CheckpointNotFoundError(f"no committed step at {durable.url} nor held whole by the nodes' hot tiers")
        return chosen

    def _load_holdings(self, choice: _Choice, held_here: bool) -> bool:
        """The step's commit record and manifest (read by a rank whose node holds the step: the first of its holders
        whose copy reads), and which nodes hold each object intact: each rank checks its share of its node's copies
        against the commit's checksums, and rank 0 makes the directory. False where no holder's documents read (each
        is logged)."""
        from ..engine.inspection import check_object

        for holder in choice.holders:
            try:
                step = self._documents(choice.step, holder)
                break
            except StorageError as e:  # (the same on every rank: the next holder is tried by all)
                log.warning("%s", e)
        else:
            return False
        record = commit.parse_marker(step.marker, choice.step, f"hot tier step {choice.step} from rank {holder}")
        reader = CheckpointReader(self.storage, committed=(record, step.manifest, step.index))
        objects = _object_list(reader.atoms)
        share, ranks_here = self.nodes.position[self.rank], len(self.nodes.ranks(self.nodes.node_of[self.rank]))

        def check() -> Checked:
            intact: list[int] = []
            damaged: list[str] = []
            if held_here:
                for i in range(share, len(objects), ranks_here):
                    path, index = objects[i]
                    try:
                        check_object(reader, reader.atoms[path], index)
                        intact.append(i)
                    except ObjectMissingError:
                        pass  # (not held here: another node's copy or the durable URL serves it)
                    except (IntegrityError, FormatError, StorageError) as e:
                        damaged.append(f"{self.storage.url}: {e}")
            return Checked(intact, damaged)

        def directory(checks: list[Checked]) -> Directory:
            holders: list[list[int]] = [[] for _ in objects]
            for rank, checked in enumerate(checks):
                for i in checked.intact:
                    holders[i].append(self.nodes.node_of[rank])
            return Directory.of(holders, [d for c in checks for d in c.damaged])

        failed = f"hot tier: checking step {choice.step}"
        found = all_reduce(self.comm, check, directory, Checked, Directory, failed=lambda f: f.error(failed))
        choice.reader, choice.manifest_bytes, choice.index, choice.directory = reader, step.manifest, step.index, found
        choice.damaged = found.damaged
        return True

    def _documents(self, step: int, holder: int) -> Published:
        """Step `step`'s marker, manifest and index parts as rank `holder` reads them from its node, on every rank
        (handed to rank 0, broadcast from there: a node that joined holds nothing); a StorageError on every rank says
        why that rank could not read them."""
        held_by: Published | str | None = None  # the holder's copy of the step's documents, or why it has none
        if self.rank == holder:
            try:
                marker = bytes(self.storage.read(commit.marker_key(step)))
                where = f"{self.storage.url}/{commit.marker_key(step)}"
                record = commit.parse_marker(marker, step, where)
                manifest = commit.read_manifest_bytes(self.storage, record)
                # (format 3.1: the manifest's index parts go with it)
                index = CheckpointReader(self.storage, committed=(record, manifest)).index_parts()
                held_by = Published(marker, manifest, index)
            except (UcpError, OSError) as e:
                held_by = f"hot tier: rank {self.rank} cannot read step {step}'s marker and manifest: {e}"
        if holder != 0:  # (handed to rank 0, which broadcasts it; an empty marker says it failed)

            def received(_peer: int, items: dict[str, memoryview]) -> None:
                nonlocal held_by
                marker, manifest = bytes(items["marker"]), bytes(items["manifest"])
                index = {k.removeprefix("index/"): bytes(v) for k, v in items.items() if k.startswith("index/")}
                held_by = Published(marker, manifest, index) if marker else manifest.decode()

            ours = (
                (held_by.marker, held_by.manifest) if isinstance(held_by, Published) else (b"", str(held_by).encode())
            )
            parts = held_by.index if isinstance(held_by, Published) else {}
            items = [from_bytes("marker", ours[0]), from_bytes("manifest", ours[1])]
            items += [from_bytes(f"index/{name}", data) for name, data in parts.items()]
            send_rounds(self.comm, {0: [items]} if self.rank == holder else {}, [holder] if self.rank == 0 else [],
                        received)  # fmt: skip

        def documents() -> Published:
            if not isinstance(held_by, Published):
                raise StorageError(str(held_by))
            return held_by

        return broadcast(self.comm, documents, Published)


@dataclass
class _Choice:
    """A step considered for a restore, and (for a hot one) what the surviving nodes hold of it."""

    step: int
    source: str  # "hot" or "durable"
    holders: list[int]  # the lowest rank of each node that holds the step committed
    durable_too: bool  # the durable URL holds it committed as well
    reader: CheckpointReader | None = None
    manifest_bytes: bytes = b""
    index: dict[str, bytes] = field(default_factory=dict)  # the manifest's index parts (format 3.1)
    directory: Directory | None = None  # which nodes hold each object intact
    damaged: list[str] = field(default_factory=list)


def _object_list(atoms: Mapping[str, AtomMeta]) -> list[tuple[str, tuple[int, ...]]]:
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
            raise IntegrityError(
                f"{key}: no surviving node holds a copy intact in every chunk read of it, and the durable URL lacks its"
                " step"
            )
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
