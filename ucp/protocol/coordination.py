"""How the ranks of a save agree, written once: map on every rank, decide on the coordinator (rank 0), and give
every rank the decision or one error naming every rank that failed (the shape of PyTorch DCP's
`_DistWrapper.all_reduce`).

- `all_reduce(comm, local, decide, ...)`: every rank runs `local`; the coordinator runs `decide` on every rank's
  value, in rank order; every rank returns the decision.
- `all_gather(comm, local, ...)`: every rank's value, in rank order, on every rank.
- `broadcast(comm, decide, ...)`: the coordinator runs `decide`; every rank returns its value.

What crosses ranks is a `Message`, a record with `to_json` and `from_json`, sent as JSON over the `Comm`
(`gather_bytes`, then `broadcast_bytes`): never a pickle. A rank's failure never leaves another waiting: a rank
whose `local` raised still joins each collective, with its failure in place of its value. Then the coordinator does
not decide: it runs `on_failure` (to undo what the ranks started) and words one error, `failed(Failures)`: by
default of the first failing rank's own ucp type (looked up by name, `errors.error_kind`, so that a type from a
module the coordinator never imported is raised as itself), naming every failing rank and its reason. A failure
of `decide` itself also runs `on_failure` and is raised as what it is (its type and message). Every rank raises
the coordinator's error, chained to its own failure if it had one.

In a world of one (`LocalComm`) nothing is encoded: the value and the decision pass as they are, and an exception
that is neither a ucp nor an OS error (a bug, an interrupt) is raised as itself, with its traceback, as is any
failure of `decide`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, Self, TypeVar

from ..errors import UcpError, error_kind
from .comm import Comm

log = logging.getLogger("ucp")

COORDINATOR = 0


class Message(Protocol):
    """What one rank sends another: a record that is JSON on the way (never a pickle)."""

    def to_json(self) -> Any: ...

    @classmethod
    def from_json(cls, doc: Any) -> Self: ...


M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)


@dataclass(frozen=True)
class RankFailure:
    """What failed on one rank: its exception's class name and message."""

    rank: int
    kind: str
    reason: str

    @classmethod
    def of(cls, rank: int, error: BaseException) -> RankFailure:
        return cls(rank, type(error).__name__, str(error) or type(error).__name__)

    def to_json(self) -> list:
        return [self.rank, self.kind, self.reason]

    @classmethod
    def from_json(cls, doc: Any) -> RankFailure:
        rank, kind, reason = doc
        return cls(int(rank), str(kind), str(reason))


@dataclass(frozen=True)
class Failures:
    """Every rank whose own work failed, in rank order, in a world of `world_size` ranks."""

    ranks: tuple[RankFailure, ...]
    world_size: int

    @property
    def first(self) -> RankFailure:
        return self.ranks[0]

    def kind(self, default: type[UcpError] = UcpError) -> type[UcpError]:
        """The first failing rank's ucp error type, or `default` for any other exception (an OSError, a bug)."""
        return error_kind(self.first.kind) or default

    @property
    def reason(self) -> str:
        """'rank 1 failed: ...', or 'ranks 0, 1 failed: rank 0: <type>: ...; rank 1: <type>: ...' (in a world of one:
        the failure's message)."""
        if self.world_size == 1:
            return self.first.reason
        if len(self.ranks) == 1:
            return f"rank {self.first.rank} failed: {self.first.reason}"
        return f"ranks {', '.join(str(f.rank) for f in self.ranks)} failed: " + "; ".join(
            f"rank {f.rank}: {f.kind}: {f.reason}" for f in self.ranks
        )

    def error(self, context: str = "", default: type[UcpError] = UcpError) -> UcpError:
        """One error for them all: of the first failing rank's type (`kind`), saying `context` and then `reason`."""
        return self.kind(default)(f"{context}: {self.reason}" if context else self.reason)


FailedHook = Callable[[Failures], UcpError]


def _default_failed(failures: Failures) -> UcpError:
    return failures.error()


def all_reduce(
    comm: Comm,
    local: Callable[[], M],
    decide: Callable[[list[M]], R],
    message: type[M],
    result: type[R],
    *,
    failed: FailedHook = _default_failed,
    on_failure: Callable[[], None] | None = None,
) -> R:
    """Run `local` on every rank and `decide` on the coordinator with every rank's value (rank order); return the
    decision on every rank, or raise on every rank (module doc). Every rank calls this together."""
    return _run(
        comm,
        local,
        lambda docs: [message.from_json(d) for d in docs],
        decide,
        lambda decision: decision.to_json(),
        result.from_json,
        failed,
        on_failure,
    )


def all_gather(
    comm: Comm, local: Callable[[], M], message: type[M], *, failed: FailedHook = _default_failed
) -> list[M]:
    """Every rank's value of `local`, in rank order, on every rank; if any rank's `local` raised, one error on every
    rank naming every failing rank (module doc). Every rank calls this together."""

    def gathered(values: list[M]) -> list[M]:
        return values

    return _run(
        comm,
        local,
        lambda docs: [message.from_json(d) for d in docs],
        gathered,
        lambda values: [v.to_json() for v in values],
        lambda docs: [message.from_json(d) for d in docs],
        failed,
        None,
    )


def broadcast(
    comm: Comm, decide: Callable[[], R], result: type[R], *, on_failure: Callable[[], None] | None = None
) -> R:
    """The coordinator's value of `decide`, on every rank; if it raised, that error on every rank (module doc).
    Every rank calls this together."""
    return _run(
        comm,
        None,
        lambda _docs: [],
        lambda _values: decide(),
        lambda decision: decision.to_json(),
        result.from_json,
        _default_failed,
        on_failure,
    )


# -- the one implementation


def _run(
    comm: Comm,
    local: Callable[[], Any] | None,
    read_values: Callable[[list[Any]], list[Any]],
    decide: Callable[[list[Any]], Any],
    write_decision: Callable[[Any], Any],
    read_decision: Callable[[Any], Any],
    failed: FailedHook,
    on_failure: Callable[[], None] | None,
) -> Any:
    """Map (`local`, skipped when None), gather to the coordinator, decide there, broadcast the decision or the
    error. `read_values` decodes the gathered values, `write_decision` and `read_decision` the decision."""
    mine: Any = None
    error: BaseException | None = None
    if local is not None:
        try:
            mine = local()
        except BaseException as e:  # noqa: BLE001 -- reported to the coordinator, then raised on every rank
            error = e
    if comm.world_size == 1:
        return _alone(mine, error, local is not None, decide, failed, on_failure)
    gathered = None
    if local is not None:
        sent = (
            {"failed": RankFailure.of(comm.rank, error).to_json()} if error is not None else {"value": mine.to_json()}
        )
        gathered = comm.gather_bytes(json.dumps(sent).encode())
    if comm.rank != COORDINATOR:
        outcome = json.loads(comm.broadcast_bytes(None))
        if "error" in outcome:
            _raise(outcome["error"], error)
        assert error is None, "the coordinator decided although this rank failed"
        return read_decision(outcome["value"])
    messages = [json.loads(g) for g in gathered or []]
    failures = [RankFailure.from_json(m["failed"]) for m in messages if "failed" in m]
    decision: Any = None
    if failures:
        _undo(on_failure)  # (first: the error may say how the undoing went)
        shared = _described(failed(Failures(tuple(failures), comm.world_size)))
    else:
        try:
            decision = decide(read_values([m["value"] for m in messages]))
            shared = {"value": write_decision(decision)}
        except BaseException as e:  # noqa: BLE001 -- raised on every rank below
            error, shared = e, _described(e)
            _undo(on_failure)
    comm.broadcast_bytes(json.dumps(shared).encode())
    if "error" in shared:
        _raise(shared["error"], error)
    return decision


def _alone(
    mine: Any,
    error: BaseException | None,
    mapped: bool,
    decide: Callable[[list[Any]], Any],
    failed: FailedHook,
    on_failure: Callable[[], None] | None,
) -> Any:
    """`_run` in a world of one: nothing crosses a process, so nothing is encoded."""
    if error is not None:
        _undo(on_failure)
        if not isinstance(error, (UcpError, OSError)):
            raise error  # a bug or an interrupt: as it was, with its traceback
        raise failed(Failures((RankFailure.of(COORDINATOR, error),), 1)) from error
    try:
        return decide([mine] if mapped else [])
    except BaseException:
        _undo(on_failure)
        raise


def _undo(on_failure: Callable[[], None] | None) -> None:
    """Run the coordinator's `on_failure`; a failure of its own is logged, never raised: the error every rank is
    about to raise is the one to report, and no rank may be left waiting for the broadcast."""
    if on_failure is None:
        return
    try:
        on_failure()
    except Exception as e:  # noqa: BLE001
        log.error("undoing a failed step of the ranks' coordination failed too: %s", e)


def _described(error: BaseException) -> dict:
    return {"error": [type(error).__name__, str(error) or type(error).__name__]}


def _raise(described: Sequence[str], cause: BaseException | None) -> NoReturn:
    """Raise the coordinator's error (its ucp type by name; any other as a UcpError), chained to this rank's own."""
    kind, text = described
    raise (error_kind(kind) or UcpError)(text) from cause
