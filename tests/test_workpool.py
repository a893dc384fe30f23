"""The work pools: small objects in one lane, large ones on the pool, the first failure cancelling the rest."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import random
import threading

import pytest

from ucp.base.workpool import SMALL_OBJECT_BYTES, ObjectCall, SizedPool, run_sized, wait_all, when_all_done


def _recorder():
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        with lock:
            seen.append((i, threading.current_thread().name))

    return seen, call


def test_run_sized_runs_small_objects_in_the_calling_thread_and_large_ones_on_the_pool():
    rng = random.Random()
    sizes = [rng.choice([1, SMALL_OBJECT_BYTES - 1, SMALL_OBJECT_BYTES, 64 << 20]) for _ in range(200)]
    seen, call = _recorder()
    with cf.ThreadPoolExecutor(4, thread_name_prefix="pool") as pool:
        run_sized(pool, [ObjectCall(lambda i=i: call(i), n) for i, n in enumerate(sizes)])
    assert sorted(i for i, _ in seen) == list(range(len(sizes)))  # each exactly once
    for i, thread in seen:
        small = sizes[i] < SMALL_OBJECT_BYTES
        assert (thread == threading.current_thread().name) == small, (sizes[i], thread)
    small_order = [i for i, thread in seen if sizes[i] < SMALL_OBJECT_BYTES]
    assert small_order == sorted(small_order)  # one after another, in order


def test_run_sized_starts_the_largest_objects_first_each_a_task_of_its_own():
    """Many small objects (batched several a task) and, last in the list, large ones that can only finish together
    (a barrier): the large ones start first, largest first, none queued behind another in one task."""
    rng = random.Random()
    large = sorted((rng.randrange(SMALL_OBJECT_BYTES, 64 << 20) for _ in range(2)), reverse=True)
    together = threading.Barrier(len(large), timeout=30)
    started: list[int] = []

    def run(n: int) -> None:
        started.append(n)
        if n >= SMALL_OBJECT_BYTES:
            together.wait()

    sizes = [rng.randrange(1, SMALL_OBJECT_BYTES) for _ in range(rng.randrange(200, 2000))] + large[::-1]
    with cf.ThreadPoolExecutor(len(large)) as pool:
        run_sized(pool, [ObjectCall(lambda n=n: run(n), n) for n in sizes], serial_small=False)
    assert sorted(started[: len(large)], reverse=True) == large and len(started) == len(sizes)


@pytest.mark.parametrize("failing", ["small", "large"])
def test_run_sized_raises_the_first_failure_and_runs_nothing_after_it_in_its_lane(failing):
    ran: list[int] = []

    def ok(i: int) -> None:
        ran.append(i)

    def boom() -> None:
        raise OSError("disk full")

    big = 64 << 20
    calls = [ObjectCall(lambda i=i: ok(i), 1 if failing == "small" else big) for i in range(5)]
    calls.insert(2, ObjectCall(boom, 1 if failing == "small" else big))
    with cf.ThreadPoolExecutor(1) as pool, pytest.raises(OSError, match="disk full"):
        run_sized(pool, calls)
    if failing == "small":
        assert ran == [0, 1]  # the calls after the failed one in the same lane never ran


def test_sized_pool_puts_small_work_on_its_own_thread():
    pool = SizedPool(3, "t")
    seen, call = _recorder()
    try:
        wait_all([pool.submit(lambda i=i: call(i), n) for i, n in enumerate([10, 1 << 30, 0, SMALL_OBJECT_BYTES])])
    finally:
        pool.shutdown()
    lanes = dict(seen)
    assert lanes[0] == lanes[2] and lanes[0].startswith("t-small")
    assert not lanes[1].startswith("t-small") and not lanes[3].startswith("t-small")


def test_run_sized_tells_the_storage_the_small_lanes_keys_in_order_and_each_object_it_has_read():
    rng = random.Random()
    sizes = [rng.choice([1, SMALL_OBJECT_BYTES - 1, SMALL_OBJECT_BYTES, 64 << 20]) for _ in range(rng.randint(1, 200))]
    lane: list[tuple] = []  # what the calling thread did, in order
    me = threading.get_ident()

    @contextlib.contextmanager
    def prefetching(keys):
        lane.append(("told", list(keys)))
        yield lambda: lane.append(("advanced",))
        lane.append(("done",))

    def read(i: int) -> None:
        if threading.get_ident() == me:
            lane.append(("read", i))

    calls = [ObjectCall(lambda i=i: read(i), n, f"k{i}") for i, n in enumerate(sizes)]
    with cf.ThreadPoolExecutor(4) as pool:
        run_sized(pool, calls, True, prefetching)
    small = [i for i, n in enumerate(sizes) if n < SMALL_OBJECT_BYTES]
    if not small:
        assert lane == []  # nothing read one after another: nothing to read ahead of
        return
    assert lane == [
        ("told", [f"k{i}" for i in small]),
        *[e for i in small for e in (("read", i), ("advanced",))],
        ("done",),
    ]


def test_when_all_done_calls_back_once_after_the_last_future_ends_cancelled_ones_included():
    gate = threading.Event()
    called: list[str] = []
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(gate.wait, 30)
        queued = [pool.submit(lambda: None) for _ in range(random.randint(1, 8))]
        when_all_done([running, *queued], lambda: called.append(threading.current_thread().name))
        assert queued[-1].cancel() and called == [], "one future cancelled, the rest not done: no call yet"
        gate.set()
        wait_all([running, *queued[:-1]])
    assert len(called) == 1
    when_all_done([], lambda: called.append("none"))
    assert called[-1] == "none", "no futures: called at once"
