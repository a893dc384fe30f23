"""CheckpointManager: owns the steps under one root, their saves (sync, async or lazy), retention, and the
cleanup of interrupted saves, so that a trainer says little."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Self

import torch

from .base.devices import on_host
from .distributed.read_plan import plan_paths
from .distributed.sharded_load import LoadReport, load_sharded
from .distributed.sharded_model import ShardedModel, extra_state
from .distributed.sharded_save import RankSaver, extra_atoms, plan_sharded_save
from .distributed.shared_manifest import open_shared
from .distributed.tiers import HotTier, RestoreReport
from .engine.checkpoint import CheckpointReader, SaveOptions, chunk_jobs, io_threads_for, plan_atoms, plan_save
from .engine.pipeline import DEFAULT_WRITER, Mode, SaveHandle, SavePipeline, SavePlan, Writer, check_mode
from .errors import FormatError, IntegrityError, ObjectMissingError, StateError
from .format import tree
from .protocol import attempt, commit
from .protocol.comm import Comm
from .protocol.commit import CommitRecord
from .storage import Storage, open_storage

log = logging.getLogger("ucp")


class CheckpointManager:
    """Steps of one training run under `root_url`.

    A trainer says `manager.save(step, state)` (or, in a parallel job, `manager.save_sharded(step, local_state,
    model)` on every rank) and, on start, `manager.restore()` / `restore_sharded()`. `mode` is "sync" (save
    returns once committed), "async" (save returns once a snapshot is taken; call `wait()` or just save
    again) or "lazy" (the snapshot too runs in the background: call `handle.wait_snapshot()` before changing
    the saved tensors). Async and lazy saves are encoded and written by a writer process (`writer="process"`,
    the default on Linux: it keeps checksums and IO calls off the trainer's GIL) or by writer threads
    (`writer="threads"`). One save is in flight at a time: a new save waits for the previous one and raises its
    error (logged with the `ucp` logger when it happens); one in flight when the interpreter exits is waited for. The
    manager keeps the last `keep_last` committed steps (all when None) and, when it starts and
    after each commit, removes the save attempts that no live process owns (`ucp.protocol.attempt`: interrupted saves,
    the losers of a race, a killed job's). In a parallel job pass `comm` (e.g. `TorchComm(dist.new_group(
    backend="gloo"))`): rank 0 does the cleanup and the commits.

    With `local_dir` (node-local storage, e.g. a directory in /dev/shm) the manager keeps a hot tier
    (`ucp.distributed.tiers`): every save commits there first, each node holding its ranks' objects plus a replica of the
    previous node's, and every `durable_every`-th save since the last drain (counted across restarts: each node
    keeps the count) is then drained to `root_url` and committed there; each
    node keeps `local_keep` hot steps. `restore_sharded` takes the newest step that the surviving nodes hold
    between them or that `root_url` holds, reading over the process group what other nodes hold; what it read
    from where is in `last_restore`. Every rank of the job must pass a `local_dir` (its node's).

    On GPUs: saves take tensors on any device (copied to page-locked staging memory on a side stream, the caller's
    stream waiting for the copies); `prepare` makes that memory before the first save; restores land on a device
    (`device=`, or the job's own CUDA tensors as `into`).
    """

    def __init__(
        self,
        root_url: str,
        *,
        keep_last: int | None = None,
        storage_options: dict[str, Any] | None = None,
        options: SaveOptions | None = None,
        mode: Mode = "sync",
        staging_bytes: int | None = None,
        writer: Writer = DEFAULT_WRITER,
        comm: Comm | None = None,
        local_dir: str | None = None,
        local_keep: int = 2,
        durable_every: int = 1,
    ):
        """Opens the root and starts the writer process (async and lazy modes). Does IO and, with a `comm`, runs
        collectives: every rank must construct its manager together (rank 0 collects garbage, then all wait at a
        barrier; a hot tier finds the nodes, `HotTier`)."""
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (or None to keep every step), got {keep_last}")
        self.root_url = root_url
        self.keep_last = keep_last
        self.options = options or SaveOptions()
        self.mode = check_mode(mode)
        self.comm = comm
        self.storage: Storage = open_storage(root_url, storage_options, fsync=self.options.fsync)
        self.hot: HotTier | None = None
        if local_dir:
            self.hot = HotTier(
                local_dir,
                self.storage,
                comm,
                keep_last=local_keep,
                durable_every=durable_every,
                fsync=self.options.fsync,
            )
        self.last_restore: RestoreReport | None = None
        self._stopped: str | None = None  # "closed" or "abandoned": no more saves
        self._last: SaveHandle | None = None
        self.pipeline = SavePipeline(io_threads_for(self.options, self.storage), staging_bytes, writer)
        if mode != "sync":
            self.pipeline.start_writer()  # it imports while the trainer sets up, not at the first save
        if self.is_coordinator:
            self.gc()
        if comm is not None:
            comm.barrier()

    @property
    def is_coordinator(self) -> bool:
        return self.comm is None or self.comm.rank == 0

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return commit.committed_steps(self.storage)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving

    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        layout: str | None = None,
        atom_attributes: Mapping[str, Mapping[str, Any]] | None = None,
        mode: Mode | None = None,
        durable: bool = False,
    ) -> SaveHandle:
        """Save `state` (a nested dict of tensors and JSON values) as `step`; retention follows the commit. With a hot
        tier, `durable=True` commits the step at the durable URL too, whatever `durable_every` says (a run's last
        save: the node-local copies go with the job's nodes)."""
        self._check_open()
        check_mode(mode or self.mode)
        self.pipeline.wait()
        plan = plan_save(state, self._target, step, self.options, layout=layout, atom_attributes=atom_attributes)
        return self._submit(plan, mode, durable)

    def save_sharded(
        self,
        step: int,
        local_state: Mapping[str, Any],
        model: ShardedModel,
        *,
        extra: dict[str, Any] | None = None,
        mode: Mode | None = None,
        durable: bool = False,
    ) -> SaveHandle:
        """Every rank calls this with its local state (docs/LOCAL_STATE.md); `extra` is taken from rank 0. `durable`
        as `save` takes it (every rank passes the same)."""
        if self.comm is None:
            raise ValueError("save_sharded needs the manager's comm (CheckpointManager(..., comm=TorchComm(group)))")
        self._check_open()
        check_mode(mode or self.mode)
        self.pipeline.wait()
        plan = plan_sharded_save(
            local_state, self._target, step=step, model=model, comm=self.comm, extra=extra, options=self.options
        )
        return self._submit(plan, mode, durable)

    def prepare(
        self,
        state: Mapping[str, Any],
        model: ShardedModel | None = None,
        *,
        extra: dict[str, Any] | None = None,
        mode: Mode | None = None,
    ) -> int:
        """Make the staging memory that saves of `state` need now (page-locked where the process uses CUDA), and start
        the writer process, so that the first save spends its blocking time on the snapshot alone. `state` is what
        `save` takes or, with `model`, this rank's local state as `save_sharded` takes it (with its `extra`, for rank
        0). Only what a save in `mode` (default: the manager's) copies counts: a sync save copies only tensors on a
        device. Returns the bytes of staging memory the manager holds."""
        self._check_open()
        staged = (mode or self.mode) != "sync"
        if model is None:
            tensors = tree.flatten(dict(state))[1]
            values = [job.source() for job in chunk_jobs(plan_atoms(tensors, self.options.chunking), tensors)]
            sizes = [_nbytes(v) for v in values if staged or not on_host(v)]
        else:
            rank = self.comm.rank if self.comm is not None else 0
            saver = RankSaver(state, model, rank, self.options)
            sizes = saver.chunk_nbytes() if staged or not saver.on_host else []
            if rank == 0 and extra:
                sizes += [_nbytes(job.source()) for job in extra_atoms(extra, self.options.chunking)[2]]
        self.pipeline.prepare(sizes)
        return self.pipeline.staging.allocated_bytes

    def _check_open(self) -> None:
        if self._stopped is not None:
            raise StateError(f"the manager of {self.root_url} was {self._stopped}: saves need a new CheckpointManager")

    @property
    def _target(self) -> Storage:
        """Where saves commit first: the hot tier if there is one, else the durable root."""
        return self.hot.storage if self.hot is not None else self.storage

    @property
    def after_commit_errors(self) -> list[Exception]:
        """What failed after the last save committed (retention, gc, a drain to the durable URL): such failures
        never fail a committed save; they are logged (`ucp` logger) and kept here until the next save."""
        return self._last.after_commit_errors if self._last is not None else []

    def _submit(self, plan: SavePlan, mode: Mode | None, durable: bool) -> SaveHandle:
        self.pipeline.fit_packs(plan)  # (before the hot tier learns the packs' documents)
        if self.hot is None:
            plan.session.after_commit.append(self._after_commit)
        else:
            documents = [key for key, _ in plan.documents()]
            self.hot.attach(
                plan.session, documents, plan.manifest, self.storage, self.options, self._after_commit, drain=durable
            )
        self._last = self.pipeline.submit(plan, mode or self.mode)
        return self._last

    def _after_commit(self, record: CommitRecord | None) -> None:
        if record is not None:  # (the coordinator)
            self._apply_retention(record.step)
            self.gc()

    def wait(self) -> CommitRecord | None:
        """Wait for the save in flight (if any) to commit; raises its error (unless `handle.result()` raised it
        already)."""
        return self.pipeline.wait()

    def close(self) -> None:
        """Finish the save in flight and stop the writers (threads and process)."""
        self._stopped = self._stopped or "closed"  # (an abandoned manager stays one: that is what its saves lost)
        self.pipeline.close()

    def abandon(self) -> None:
        """Stop without waiting for the save in flight, which stays uncommitted (a job that lost a peer: that
        save's collectives cannot complete). The manager is unusable afterwards."""
        self._stopped = "abandoned"
        self.pipeline.abandon()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restoring

    def reader(self, step: int | str | None = "latest") -> CheckpointReader:
        return CheckpointReader(self.storage, step, io_threads=self.options.io_threads)

    def restore(self, step: int | str | None = "latest", *, device: torch.device | str | None = None) -> dict[str, Any]:
        """The state of a committed step ('latest' or None: the newest; with a hot tier, of either tier), its tensors
        on `device` (default: host memory)."""
        if self.hot is not None and step in ("latest", None):
            hot, durable = commit.committed_steps(self.hot.storage), self.steps()
            if hot and hot[-1] >= (durable[-1] if durable else -1):
                try:
                    reader = CheckpointReader(self.hot.storage, hot[-1], io_threads=self.options.io_threads)
                    return reader.load_state(device=device)
                except (IntegrityError, FormatError, ObjectMissingError) as e:
                    # (a damaged hot copy: the durable URL's copy of the same step serves, where it has one)
                    if hot[-1] not in durable:
                        raise type(e)(
                            f"hot tier {self.hot.storage.url}: step {hot[-1]} is damaged and {self.root_url} lacks "
                            f"it: {e}"
                        ) from e
                    log.warning("hot tier %s: step %d is damaged (%s); read from %s", self.hot.storage.url,
                                hot[-1], e, self.root_url)  # fmt: skip
                    step = hot[-1]
        return self.reader(step).load_state(device=device)

    def restore_sharded(
        self,
        model: ShardedModel,
        rank: int,
        step: int | str | None = "latest",
        *,
        into: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
    ) -> tuple[dict[str, Any], dict[str, Any], LoadReport]:
        """This rank's local state in `model.layout` (whatever layout saved it), the extra state, and what was read;
        `into`: the job's own tensors to fill in place, on any device, and `device`: where the tensors `into` lacks are
        made (`load_sharded`). With a hot tier and step 'latest' every rank calls it together (`ucp.distributed.tiers`);
        `last_restore` says what came from where."""
        if self.hot is not None and step in ("latest", None):
            local, extra, report, self.last_restore = self.hot.restore_sharded(model, self.storage, into, device)
            return local, extra, report
        if self.comm is not None and self.comm.world_size > 1:  # (the manifest read once for all the ranks)
            reader = open_shared(
                self.storage,
                self.comm,
                step,
                paths=lambda r: plan_paths(model, rank, r.manifest.tree_at("extra")),
                io_threads=self.options.io_threads,
            )
        else:
            reader = self.reader(step)
        local, report = load_sharded(reader, model, rank, into=into, device=device)
        self.last_restore = RestoreReport(reader.step, "durable", bytes_durable=report.bytes_read)
        return local, extra_state(reader), report

    # -- cleanup

    def gc(self) -> list[str]:
        """Remove the save attempts that no live process owns (interrupted or failed saves, the losers of a race,
        a killed job's); returns what was removed, as keys below the root. A save in progress, here or in another
        job, is never touched: ownership is decided by the attempt's owner record (`ucp.protocol.attempt`)."""
        return attempt.collect_garbage(self.storage)

    def _apply_retention(self, saved: int) -> None:
        if self.keep_last is None:
            return
        for step in self.steps()[: -self.keep_last]:
            if step == saved:  # (a step older than every kept one: saved, then removed by its own retention)
                log.warning(
                    "step %d at %s was removed as soon as it was committed: %d newer steps are kept (keep_last)",
                    step,
                    self.root_url,
                    self.keep_last,
                )
            attempt.delete_step(self.storage, step)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
