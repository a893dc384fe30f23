"""A writer process: encodes and writes an async save's staged chunks outside the trainer's interpreter.

Writer threads in the training process share its GIL: while they checksum, encode and issue writes, the
training loop's Python waits for the lock (`python -m bench_io gil`: a training-like loop ran 4.4x slower during
a save with writer threads, 1.6x with a writer process). So async and lazy saves hand their staged chunks to a
child process instead: the staging arenas are shared memory (memfd) that both processes map, and a chunk is
sent as a reference (arena, offset, dtype, shape) plus its atom's metadata; the child encodes it straight from
the shared pages and writes it with its own IO threads. The training process keeps the commit (it may need the
job's collectives), after the child has flushed (made its directory entries durable).

The child is started as a fresh `python -c` that runs `main` here (not multiprocessing's spawn, which would re-import
the trainer's main module), talks over a Unix socket pair (arena fds passed with SCM_RIGHTS), ignores SIGINT
(the parent decides), and exits when the parent closes the socket. It dies with its parent: the kernel kills it
when the parent dies (PR_SET_PDEATHSIG, where the parent started it from its main thread: the signal follows
the thread that started the child), a watchdog thread exits within a tenth of a second of noticing a new parent,
and every write first checks that the parent is still the one that started it. So a trainer killed with
SIGKILL leaves no writer draining its queue; and since every save writes in its own attempt directory, a write
that raced the parent's death can only land in that dead attempt. Linux only (memfd); elsewhere the pipeline
keeps writer threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import functools
import itertools
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from ..base.workpool import SMALL_OBJECT_BYTES, ObjectCall, SizedPool, submit_sized
from ..errors import UcpError, WriterProcessError
from ..format.manifest import AtomMeta
from ..protocol import codec
from ..storage import Storage
from .staging import Arena, map_shared_arena

SUPPORTED = sys.platform.startswith("linux") and hasattr(os, "memfd_create")


@dataclass(frozen=True)
class ChunkRef:
    """One chunk object to write, by reference to its staged values in a shared arena."""

    key: str
    meta: AtomMeta
    index: tuple[int, ...]
    arena: int
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    pack: tuple[tuple[int, int], ...] | None = None  # a pack's member spans (offset, nbytes): ucp.format.packs

    @property
    def nbytes(self) -> int:
        return self.meta.itemsize * math.prod(self.shape)


# (key, bytes, checksum of a chunk object, checksums of a pack's members) of each object a request wrote
Written = list[tuple[str, int, "int | None", list[int]]]
_WATCH_S = 0.1  # how often the child checks that its parent lives


# ------------------------------------------------------------------------------------- the training side


class WriterProcess:
    """The training process's handle on one writer child. Requests return futures whose result is the list of
    objects written; they are marked running at once, so they cannot be cancelled while the child may still
    read their staged chunks."""

    def __init__(self, io_threads: int):
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        try:
            main_thread = threading.current_thread() is threading.main_thread()
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys, ucp.engine.writer_process as w; w.main(sys.argv[1:])",
                    str(theirs.fileno()),
                    str(io_threads),
                    str(os.getpid()),
                    str(int(main_thread)),
                ],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except OSError as e:
            ours.close()
            raise WriterProcessError(f"cannot start the writer process: {e}") from e
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[cf.Future, Callable[[], None]]] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._failure: str | None = None
        self._receiver = threading.Thread(target=self._receive, name="ucp-writer-replies", daemon=True)
        self._receiver.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._failure is None and self._proc.poll() is None

    # -- arenas and storages

    def map_arena(self, arena: Arena) -> None:
        assert arena.fd is not None, "only shared arenas can be mapped by the writer process"
        with self._send_lock:
            self._send(("arena", arena.id, arena.size))
            reduction.send_handle(self._conn, arena.fd, self._proc.pid)

    def unmap_arena(self, arena: Arena) -> None:
        with self._send_lock:
            self._send(("drop", arena.id), quiet=True)

    def open_storage(self, storage: Storage) -> int:
        """Register a copy of `storage` in the child (one per save: its flush covers that save's writes)."""
        sid = next(self._ids)
        with self._send_lock:
            self._send(("storage", sid, storage))
        return sid

    def close_storage(self, sid: int) -> None:
        with self._send_lock:
            self._send(("forget", sid), quiet=True)

    # -- requests

    def write_chunks(self, sid: int, chunks: Sequence[ChunkRef], on_done: Callable[[], None]) -> cf.Future:
        """Encode and write `chunks`; `on_done` runs (here) exactly once, when the child no longer reads their
        arenas: at its reply, when the child dies, or at once if the request cannot be sent (then this raises)."""
        return self._request("chunks", sid, list(chunks), on_done)

    def write_documents(self, sid: int, documents: Sequence[tuple[str, bytes]]) -> cf.Future:
        return self._request("documents", sid, list(documents))

    def flush(self, sid: int) -> cf.Future:
        return self._request("flush", sid, None)

    def close(self, timeout: float = 30.0) -> None:
        with self._send_lock:
            self._send(None, quiet=True)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
        self._receiver.join(timeout)

    def _request(self, kind: str, sid: int, payload: Any, on_done: Callable[[], None] | None = None) -> cf.Future:
        future: cf.Future = cf.Future()
        future.set_running_or_notify_cancel()
        req = next(self._ids)
        with self._pending_lock:
            self._pending[req] = (future, on_done or _nothing)
        try:
            with self._send_lock:
                self._send((kind, req, sid, payload))
        except BaseException:
            with self._pending_lock:
                entry = self._pending.pop(req, None)  # (None: a failure already settled it)
            if entry is not None:
                entry[1]()
            raise
        return future

    def _send(self, message: Any, quiet: bool = False) -> None:
        """Send under the caller's lock; a dead child fails the pending requests (and this one, unless quiet)."""
        if self._failure is None:
            try:
                self._conn.send(message)
                return
            except OSError as e:
                self._fail(f"the writer process (pid {self._proc.pid}) died ({e}) while a save was in flight")
        if not quiet:
            raise WriterProcessError(self._failure)

    def _receive(self) -> None:
        while True:
            try:
                _, req, error, written = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as e:  # noqa: BLE001 -- an unreadable reply: no request can be trusted to finish
                self._proc.kill()
                self._fail(f"the writer process (pid {self._proc.pid}) sent a reply that cannot be read ({e!r})")
                break
            with self._pending_lock:
                future, on_done = self._pending.pop(req, (None, _nothing))
            on_done()
            if future is None:
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(written)
        code = self._proc.wait()
        self._fail(f"the writer process (pid {self._proc.pid}) died (exit code {code}) while a save was in flight")

    def _fail(self, reason: str) -> None:
        """Fail every pending request: their staged chunks are released (the child no longer reads them)."""
        self._failure = self._failure or reason
        with self._pending_lock:
            pending, self._pending = list(self._pending.values()), {}
        for future, on_done in pending:
            on_done()
            future.set_exception(WriterProcessError(self._failure))


def _nothing() -> None:
    pass


# ------------------------------------------------------------------------------------------ the child


class _Server:
    """The child's loop: map arenas, keep storages, run requests on IO threads, reply when each is done."""

    def __init__(self, conn: Connection, io_threads: int):
        self.conn = conn
        self.pool = SizedPool(io_threads, "ucp-writer")
        self.arenas: dict[int, Arena] = {}
        self.storages: dict[int, Storage] = {}
        # Replies go out from their own thread: the loop that reads requests must never block on a send (the
        # parent may be sending to us while its reply reader waits for staging memory), or both could wait.
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_replies, name="ucp-writer-replies", daemon=True)
        self._sender.start()

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # (ConnectionResetError: the parent was killed)
                _check_parent()  # gone: exit at once, quietly
                break
            if message is None:
                break
            kind = message[0]
            if kind == "arena":
                _, arena_id, size = message
                self.arenas[arena_id] = map_shared_arena(arena_id, reduction.recv_handle(self.conn), size)
            elif kind == "drop":
                self.arenas.pop(message[1], None)
            elif kind == "storage":
                self.storages[message[1]] = message[2]
            elif kind == "forget":
                self.storages.pop(message[1], None)
            else:
                self._start(*message)
        self.pool.shutdown(wait=True)
        self._replies.put(None)
        self._sender.join()

    def _send_replies(self) -> None:
        while (reply := self._replies.get()) is not None:
            try:
                self.conn.send(reply)
            except OSError:  # (BrokenPipeError, ConnectionResetError: the parent is gone or closed us)
                _check_parent()
                return

    def _start(self, kind: str, req: int, sid: int, payload: Any) -> None:
        storage = self.storages[sid]
        written: Written = []
        calls: list[ObjectCall]
        if kind == "chunks":
            calls = [
                ObjectCall(functools.partial(self._write_chunk, storage, ref, written), ref.nbytes) for ref in payload
            ]
        elif kind == "documents":
            calls = [
                ObjectCall(functools.partial(_write_document, storage, key, data, written), 0) for key, data in payload
            ]
        else:
            calls = [ObjectCall(storage.flush, SMALL_OBJECT_BYTES)]
        self._reply_when_done(req, submit_sized(self.pool, calls, storage.capabilities.serial_small_writes), written)

    def _write_chunk(self, storage: Storage, ref: ChunkRef, written: Written) -> None:
        values = self.arenas[ref.arena].memory[ref.offset : ref.offset + ref.nbytes].view(ref.dtype).view(ref.shape)
        if ref.pack is not None:
            encoded = codec.encode_pack(ref.pack, ref.nbytes, values)
        else:
            encoded = codec.encode(ref.meta, ref.index, values)
        _check_parent()
        storage.write(ref.key, encoded.parts)
        written.append((ref.key, *encoded.sum, list(encoded.members)))

    def _reply_when_done(self, req: int, futures: list[cf.Future], written: Written) -> None:
        remaining = len(futures)
        lock = threading.Lock()

        def one_done(_: cf.Future | None) -> None:
            nonlocal remaining
            with lock:
                remaining -= 1
                if remaining > 0:
                    return
            error = next((f.exception() for f in futures if f.exception() is not None), None)
            self._reply(req, error, written)

        if not futures:
            remaining = 1
            one_done(None)
        for f in futures:
            f.add_done_callback(one_done)

    def _reply(self, req: int, error: BaseException | None, written: Written) -> None:
        if error is not None:
            try:
                copy.deepcopy(error)  # rebuilt from its reduce tuple, as the parent will rebuild it
            except Exception:  # noqa: BLE001 -- an exception that cannot cross processes is described instead
                error = UcpError(f"{type(error).__name__}: {error}")
        self._replies.put(("done", req, error, written))


def _write_document(storage: Storage, key: str, data: bytes, written: Written) -> None:
    _check_parent()
    storage.write(key, [data])
    written.append((key, len(data), None, []))


_parent_pid = 0


def _check_parent() -> None:
    """Exit at once if the process that started us is gone (we were re-parented): nothing it asked for may
    still be written."""
    if os.getppid() != _parent_pid:
        os._exit(1)


def _die_with_parent(from_main_thread: bool) -> None:
    if from_main_thread:
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still applies
    _check_parent()  # the parent may have died before the prctl

    def watch() -> None:
        while True:
            time.sleep(_WATCH_S)
            _check_parent()

    threading.Thread(target=watch, name="ucp-writer-watchdog", daemon=True).start()


def main(argv: list[str]) -> None:
    global _parent_pid
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes us
    fd, io_threads, _parent_pid = int(argv[0]), int(argv[1]), int(argv[2])
    _die_with_parent(bool(int(argv[3])))
    torch.set_num_threads(1)
    _Server(Connection(fd), io_threads).serve()
