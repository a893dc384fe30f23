"""Many small IO tasks on a thread pool: batched so that per-task overhead does not dominate small objects,
cancelled together when one fails; and keys packed into groups of bounded bytes."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

Call = Callable[[], object]
K = TypeVar("K", bound=Hashable)


def pack(sizes: Mapping[K, int], limit: int) -> list[list[K]]:
    """Consecutive keys packed into groups of at most `limit` bytes (a key larger than that gets a group alone)."""
    groups: list[list[K]] = [[]]
    used = 0
    for key, n in sizes.items():
        if groups[-1] and used + n > limit:
            groups.append([])
            used = 0
        groups[-1].append(key)
        used += n
    return [g for g in groups if g]


def chain(calls: Sequence[Call]) -> Call:
    """One call that runs `calls` in order."""

    def run() -> None:
        for call in calls:
            call()

    return run


def submit_batched(pool: cf.ThreadPoolExecutor, calls: Sequence[Call], per_task: int | None = None) -> list[cf.Future]:
    """Submit `calls`, several per pool task when there are many (default: about 8 tasks per worker)."""
    if per_task is None:
        per_task = max(1, len(calls) // (8 * pool._max_workers))
    if per_task == 1:
        return [pool.submit(call) for call in calls]
    return [pool.submit(chain(calls[i : i + per_task])) for i in range(0, len(calls), per_task)]


def wait_all(futures: Sequence[cf.Future]) -> None:
    """Wait for every future; on the first failure cancel what has not started, wait for what runs, raise it."""
    done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
    failed = next((f for f in futures if f in done and f.exception() is not None), None)
    if failed is not None:
        for f in futures:
            f.cancel()
        cf.wait(futures)  # running tasks may still use buffers the caller will free
        raise failed.exception()  # type: ignore[misc]


def run_tasks(pool: cf.ThreadPoolExecutor, calls: Sequence[Call], per_task: int | None = None) -> None:
    wait_all(submit_batched(pool, calls, per_task))
