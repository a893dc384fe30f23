"""The elastic, resumable loader core shared by the pretraining and SFT loaders.

Global batch ``b`` holds global positions ``[b*G, (b+1)*G)``, laid out by lane (each source's order gives each of
its positions a lane; stably, so in position order within a lane, and in plain position order where the order has
one lane); data-parallel rank ``r`` of ``D`` takes the contiguous slice ``[r*G/D, (r+1)*G/D)`` of that layout. The
layout depends on the positions alone, so a global batch is the same list of samples on any number of ranks. With
several sources, :mod:`.blend` maps each position to a source and that source's own position; each source maps its
positions to samples with its order (:mod:`.order`).

Background threads read ahead ``prefetch`` batches, but the state counts only the batches handed to the
caller: a state is a few integers that any data-parallel size can resume from.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, Self

import numpy as np

from .blend import blend_schedule, normalize_weights
from .errors import BatchSizeError, ManifestMismatchError, StateError

log = logging.getLogger(__name__)

STATE_VERSION = 1
# What a state written before a key existed meant by it: the global order was the only shuffled one.
LEGACY_STATE = {"shuffle": {"mode": "global"}}


def check_batch(global_batch_size: int, dp_rank: int, dp_size: int) -> None:
    """A global batch that `dp_size` ranks split evenly, and `dp_rank` one of them (BatchSizeError otherwise)."""
    if global_batch_size <= 0:
        raise BatchSizeError(f"global batch size must be positive, got {global_batch_size}")
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise BatchSizeError(f"dp rank {dp_rank} is not in [0, dp size {dp_size})")
    if global_batch_size % dp_size:
        raise BatchSizeError(
            f"global batch size {global_batch_size} is not divisible by the data-parallel size {dp_size}"
        )


def datasets_of(data, weights: list[float] | None) -> list:
    """The datasets a loader reads: ``data`` itself, or with ``weights`` the list of datasets it is (one dataset
    given as a string, not a list of them, is that one dataset: not its characters)."""
    if weights is None or isinstance(data, str):
        return [data]
    return list(data)


def _count(value, what: str) -> int:
    """A sample counter of a state: a non-negative int (not a bool, a float or a string of digits)."""
    if type(value) is not int or value < 0:
        raise StateError(f"{what} must be a non-negative int, got {value!r:.80}")
    return value


class SampleSource(Protocol):
    """A dataset of fixed-shape samples with a deterministic global order."""

    kind: str
    manifest_hash: str
    num_samples: int

    def samples(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(epoch, sample index)`` of the source's own global positions."""
        ...

    def lanes(self, positions: np.ndarray) -> np.ndarray:
        """The lane of each of the source's own global positions (how a global batch is laid out)."""
        ...

    def fetch(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Arrays ``[len(sample_ids), ...]`` for these samples."""
        ...

    def describe(self) -> dict:
        """JSON-able identity beyond the manifest that a resume must match (e.g. sequence length)."""
        ...


@dataclass
class Batch:
    """This rank's slice of one global batch. Tensors are torch int64 ``[G/D, seq_len]``."""

    tensors: dict  # name -> torch.Tensor
    position: int  # global position of the first sample of the global batch
    sample_ids: np.ndarray  # int64 [G/D]: the sample index within its source and epoch
    epochs: np.ndarray  # int64 [G/D]
    sources: np.ndarray  # int64 [G/D]: which source (0 unless blending)
    meta: dict = field(default_factory=dict)

    def __getitem__(self, name: str):
        return self.tensors[name]

    def keys(self):
        return self.tensors.keys()


@dataclass(frozen=True)
class _Plan:
    position: int
    sources: np.ndarray
    local_positions: np.ndarray
    counts_after: tuple[int, ...]


class ElasticLoader:
    def __init__(
        self,
        sources: list[SampleSource],
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        weights: list[float] | None = None,
        seed: int = 0,
        prefetch: int = 2,
        num_threads: int = 2,
    ) -> None:
        if not sources:
            raise StateError("a loader needs at least one source")
        if len({s.kind for s in sources}) != 1:
            raise StateError(f"cannot blend sources of kinds {sorted({s.kind for s in sources})}")
        check_batch(global_batch_size, dp_rank, dp_size)
        self.sources = list(sources)
        self.kind = sources[0].kind
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.micro = global_batch_size // dp_size
        self.seed = seed
        self.weights = normalize_weights(weights if weights is not None else [1.0] * len(sources), len(sources))
        if len(sources) == 1:
            self.manifest_hash = sources[0].manifest_hash
        else:
            blob = json.dumps([[s.manifest_hash for s in sources], self.weights])
            self.manifest_hash = hashlib.sha256(blob.encode()).hexdigest()[:32]
        import torch  # noqa: F401 - imported here (seconds, once) rather than inside the first batch's fetch

        self.prefetch = max(0, prefetch)
        self._pool = ThreadPoolExecutor(max_workers=max(1, num_threads), thread_name_prefix="dataloader")
        self._queue: deque[tuple[_Plan, Future]] = deque()
        self._counts = [0] * len(sources)  # per-source samples handed out (consumed), all ranks together
        self._planned = tuple(self._counts)  # counters after the last planned (maybe prefetched) batch

    # --- iteration -------------------------------------------------------------------------------------------

    @property
    def consumed_samples(self) -> int:
        return sum(self._counts)

    @property
    def epoch(self) -> int:
        """The epoch of the next sample (of the first source, when blending)."""
        return self._counts[0] // self.sources[0].num_samples

    def _plan(self, counts: tuple[int, ...]) -> _Plan:
        start = sum(counts)
        if len(self.sources) == 1:
            src = np.zeros(self.global_batch_size, dtype=np.int64)
            local = np.arange(start, start + self.global_batch_size, dtype=np.int64)
            after = (start + self.global_batch_size,)
        else:
            src, local, after_list = blend_schedule(self.weights, list(counts), start, self.global_batch_size)
            after = tuple(after_list)
        lanes = np.empty(self.global_batch_size, dtype=np.int64)
        for i, source in enumerate(self.sources):
            sel = src == i
            lanes[sel] = source.lanes(local[sel])
        layout = np.argsort(lanes, kind="stable")
        src, local = src[layout], local[layout]
        lo, hi = self.dp_rank * self.micro, (self.dp_rank + 1) * self.micro
        return _Plan(start, src[lo:hi], local[lo:hi], after)

    def _fetch(self, plan: _Plan) -> Batch:
        import torch

        n = plan.sources.shape[0]
        epochs = np.empty(n, dtype=np.int64)
        ids = np.empty(n, dtype=np.int64)
        arrays: dict[str, np.ndarray] = {}
        for i, source in enumerate(self.sources):
            sel = np.nonzero(plan.sources == i)[0]
            if sel.size == 0:
                continue
            e, s = source.samples(plan.local_positions[sel])
            epochs[sel], ids[sel] = e, s
            got = source.fetch(s)
            for name, arr in got.items():
                if name not in arrays:
                    arrays[name] = np.empty((n, *arr.shape[1:]), dtype=arr.dtype)
                arrays[name][sel] = arr
        tensors = {name: torch.from_numpy(arr) for name, arr in arrays.items()}
        return Batch(self._to_model_inputs(tensors), plan.position, ids, epochs, plan.sources.copy())

    def _to_model_inputs(self, tensors: dict) -> dict:
        return tensors

    def _fill(self) -> None:
        while len(self._queue) < max(1, self.prefetch):
            plan = self._plan(self._planned)
            self._planned = plan.counts_after
            self._queue.append((plan, self._pool.submit(self._fetch, plan)))

    def __iter__(self) -> ElasticLoader:
        return self

    def __next__(self) -> Batch:
        self._fill()
        plan, fut = self._queue.popleft()
        try:
            batch = fut.result()
        except BaseException:
            # Nothing was consumed: drop the read-ahead so that the next call retries this very batch.
            self._drop_prefetched()
            raise
        # Counted only now that the caller has it: prefetched batches are not in the state.
        self._counts = list(plan.counts_after)
        if self.prefetch:
            self._fill()
        return batch

    def _drop_prefetched(self) -> None:
        for _, fut in self._queue:
            fut.cancel()
        self._queue.clear()
        self._planned = tuple(self._counts)

    def close(self, wait: bool = False) -> None:
        """Drop the read-ahead and stop the threads (``wait``: until a read in progress has finished)."""
        self._drop_prefetched()
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- state -----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain JSON: global counters of samples handed to the caller over all ranks, and what they count."""
        state = {
            "version": STATE_VERSION,
            "kind": self.kind,
            "manifest_hash": self.manifest_hash,
            "seed": self.seed,
            "consumed_samples": self.consumed_samples,
            "epoch": self.epoch,
            "global_batch_size": self.global_batch_size,
            **self.sources[0].describe(),
        }
        if len(self.sources) > 1:
            state["sources"] = [
                {"manifest_hash": s.manifest_hash, "consumed_samples": c, "epoch": c // s.num_samples}
                for s, c in zip(self.sources, self._counts, strict=True)
            ]
            state["weights"] = self.weights
        return state

    def load_state_dict(self, state: dict, allow_manifest_change: bool = False) -> None:
        """Resume where ``state`` stopped, on this loader's data-parallel size (any that divides the batch).

        A state saved for another dataset is refused with :class:`ManifestMismatchError` unless
        ``allow_manifest_change``: then the counters are kept and applied to this dataset's order (the sequence
        of samples is no longer the one the old run would have seen).
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise StateError(
                f"unknown loader state version {state.get('version') if isinstance(state, dict) else state!r}"
            )
        if state.get("kind") != self.kind:
            raise StateError(f"state is for a {state.get('kind')!r} loader, this is a {self.kind!r} loader")
        # The dataset first: what the order describes (a window's size) follows from it, so another dataset would
        # otherwise be refused as another order, with a hint that no parameter can follow.
        changed = state.get("manifest_hash") != self.manifest_hash
        msg = (
            f"loader state was saved for dataset {state.get('manifest_hash')}, "
            f"this loader reads dataset {self.manifest_hash}"
        )
        if changed and not allow_manifest_change:
            raise ManifestMismatchError(msg + " (pass allow_manifest_change=True to resume anyway)")
        for key, value in self.sources[0].describe().items():
            saved = state.get(key, LEGACY_STATE.get(key))
            if changed and key == "shuffle" and isinstance(saved, dict):
                # (another dataset: a window's size follows from it, so only the kind of order must be the same)
                saved, value = saved.get("mode"), value.get("mode")
            if saved != value:
                hint = ""
                if key == "shuffle" and isinstance(saved, dict) and "mode" in saved:
                    # (a state saved before the windowed order became the default is in the global order)
                    mode = saved["mode"]  # (the SFT loader's shuffle is on or off: its orders are global or none)
                    hint = (
                        f"; resume it with shuffle={mode != 'none'}"
                        if self.kind == "sft"
                        else f"; resume it with shuffle={mode!r} (and that order's parameters)"
                    )
                raise StateError(f"state has {key}={saved!r}, this loader has {key}={value!r}{hint}")
        if state.get("seed") != self.seed:
            raise StateError(f"state has seed {state.get('seed')}, this loader has seed {self.seed}")
        consumed = _count(state.get("consumed_samples"), "consumed_samples")
        if len(self.sources) == 1:
            counts = [consumed]
        else:
            recs = state.get("sources")
            if not isinstance(recs, list) or len(recs) != len(self.sources):
                if not allow_manifest_change:
                    raise StateError(f"state has no per-source counters for {len(self.sources)} blended sources")
                # Keep the total, split by the weights (remainder to the first sources).
                counts = [int(w * consumed) for w in self.weights]
                for i in range(consumed - sum(counts)):
                    counts[i % len(counts)] += 1
            else:
                counts = []
                for i, r in enumerate(recs):
                    if not isinstance(r, dict):
                        raise StateError(f"source {i} of the state is {r!r:.80}, not a record of its counters")
                    counts.append(_count(r.get("consumed_samples"), f"consumed_samples of source {i}"))
                if sum(counts) != consumed:
                    raise StateError(f"per-source counters {counts} do not add up to consumed_samples {consumed}")
        if changed:
            log.warning("%s; resuming at position %d of the new dataset", msg, consumed)
        self._drop_prefetched()
        self._counts = counts
        self._planned = tuple(counts)
