"""The ranks' coordination (ucp.protocol.coordination): map on every rank, decide on the coordinator, every rank gets the
decision or one error naming every failing rank, of the failure's own type. Real processes over gloo, fixed cases
and random ones (which ranks fail, with which error, the decision failing too, values of different lengths); a world
of one (LocalComm); and the typed messages of the save session and the hot tier, through JSON and back."""

from __future__ import annotations

import json
import logging
import random

import pytest

from ucp.distributed.tiers import (
    Candidates,
    Checked,
    Directory,
    Holdings,
    NodeMap,
    NodePlace,
    Published,
    RootId,
)
from ucp.errors import FormatError, IntegrityError, StepExistsError, StorageError, UcpError, error_kind
from ucp.protocol import coordination
from ucp.protocol.comm import LocalComm
from ucp.protocol.session import Begun, Committed, RankWrites

from .coordination_worker import Total, Value, exception, value_of
from .helpers import DRAW
from .launch import spawn

WORLD = 3
KINDS = ["IntegrityError", "FormatError", "InteropError", "StepExistsError", "OSError", "ValueError"]


def draw_trial(rng: random.Random) -> dict:
    op = rng.choice(["all_reduce", "all_reduce", "all_gather", "broadcast"])
    fail = {}
    if op != "broadcast":
        fail = {str(r): [rng.choice(KINDS), f"trouble {rng.randrange(1000)} on rank {r}"] for r in range(WORLD)}
        fail = {r: f for r, f in fail.items() if rng.random() < 0.35}
    decide_fails = [rng.choice(KINDS), f"the decision failed ({rng.randrange(1000)})"] if rng.random() < 0.3 else None
    sizes = {str(r): rng.choice([0, 1, rng.randrange(2, 50_000)]) for r in range(WORLD)}
    return {"op": op, "fail": fail, "decide_fails": decide_fails if op != "all_gather" else None, "sizes": sizes}


def fixed(op: str, fail: dict | None = None, decide_fails: list | None = None) -> dict:
    return {"op": op, "fail": fail or {}, "decide_fails": decide_fails, "sizes": {str(r): 10 * r for r in range(WORLD)}}


FIXED = [
    fixed("all_reduce"),
    fixed("all_gather"),
    fixed("broadcast"),
    # every rank fails, each its own way: the first failing rank's type, every rank and reason named
    fixed(
        "all_reduce",
        {
            "0": ["FormatError", "rank 0's bad metadata"],
            "1": ["InteropError", "rank 1's source"],
            "2": ["OSError", "x"],
        },
    ),
    fixed("all_reduce", {"0": ["OSError", "the coordinator's disk is full"]}),  # the coordinator alone fails
    fixed("all_reduce", decide_fails=["StepExistsError", "step 3 is already committed"]),  # its decision fails
    fixed("broadcast", decide_fails=["ValueError", "a bug in the decision"]),  # not a ucp error: by its message
    fixed("all_gather", {"2": ["InteropError", "refused by rank 2's source"]}),  # a type from outside the core
    fixed("all_gather", {"1": ["ValueError", "a bug on rank 1"], "2": ["IntegrityError", "bad bytes on rank 2"]}),
]


def ucp_kind(kind: str) -> str:
    return kind if error_kind(kind) is not None else "UcpError"


def expected(plan: dict, rank: int) -> dict:
    """What `rank` returns or raises in `plan`, and (rank 0) how often the decision and the undoing ran."""
    failing = sorted(int(r) for r in plan["fail"])
    errors = {r: exception(*plan["fail"][str(r)]) for r in failing}
    own_cause = type(errors[rank]).__name__ if rank in errors else None
    out: dict = {}
    if failing:
        first = errors[failing[0]]
        if len(failing) == 1:
            text = f"rank {failing[0]} failed: {first}"
        else:
            text = f"ranks {', '.join(map(str, failing))} failed: " + "; ".join(
                f"rank {r}: {type(errors[r]).__name__}: {errors[r]}" for r in failing
            )
        out["raised"] = [ucp_kind(type(first).__name__), text, own_cause]
    elif plan["decide_fails"] is not None:
        error = exception(*plan["decide_fails"])
        cause = type(error).__name__ if rank == 0 else None
        out["raised"] = [ucp_kind(type(error).__name__), str(error), cause]
    elif plan["op"] == "all_gather":
        out["value"] = [value_of(r, plan["sizes"][str(r)]).to_json() for r in range(WORLD)]
    elif plan["op"] == "all_reduce":
        values = [value_of(r, plan["sizes"][str(r)]) for r in range(WORLD)]
        out["value"] = Total(sum(sum(v.payload) for v in values), list(range(WORLD))).to_json()
    else:
        out["value"] = Total(sum(value_of(0, plan["sizes"]["0"]).payload), [0]).to_json()
    if rank == 0:  # (all_gather has no decision of the caller's, nor anything to undo)
        out["decided"] = 0 if failing or plan["op"] == "all_gather" else 1
        out["undone"] = 1 if (failing or plan["decide_fails"] is not None) and plan["op"] != "all_gather" else 0
    return out


def test_every_rank_gets_the_decision_or_one_error_naming_every_failing_rank(tmp_path):
    rng = random.Random(DRAW.randrange(1 << 30))
    plans = FIXED + [draw_trial(rng) for _ in range(30)]
    (tmp_path / "plan.json").write_text(json.dumps(plans))
    out = tmp_path / "out"
    out.mkdir()
    spawn(["-m", "tests.coordination_worker", str(tmp_path / "plan.json"), str(out)], world=WORLD, timeout=180)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for number, plan in enumerate(plans):
        for rank in range(WORLD):
            assert results[rank][number] == expected(plan, rank), (number, plan, rank)
    # the draws covered what matters (the fixed cases do in any case)
    outcomes = [results[1][n] for n in range(len(plans))]
    assert any("value" in o for o in outcomes) and any("raised" in o for o in outcomes)


# -- a world of one


def test_alone_the_decision_of_the_one_value_is_returned():
    comm = LocalComm()
    decided: list[list[Value]] = []

    def decide(values: list[Value]) -> Total:
        decided.append(values)
        return Total(sum(values[0].payload), [values[0].rank])

    value = value_of(0, 7)
    assert coordination.all_reduce(comm, lambda: value, decide, Value, Total) == Total(sum(value.payload), [0])
    assert decided == [[value]] and decided[0][0] is value  # nothing is encoded in a world of one
    assert coordination.all_gather(comm, lambda: value, Value) == [value]
    assert coordination.broadcast(comm, lambda: Total(5, [0]), Total) == Total(5, [0])


@pytest.mark.parametrize("error", [IntegrityError("bad bytes"), OSError(28, "No space left on device")])
def test_alone_a_ucp_or_os_failure_is_worded_by_the_caller_and_undone(error):
    comm = LocalComm()
    undone: list[bool] = []

    def failing() -> Value:
        raise error

    def decide(values: list[Value]) -> Total:
        raise AssertionError("no decision after a failure")

    with pytest.raises(UcpError) as raised:
        coordination.all_reduce(
            comm,
            failing,
            decide,
            Value,
            Total,
            failed=lambda f: f.error("step 9 was not saved", default=StorageError),
            on_failure=lambda: undone.append(True),
        )
    assert type(raised.value) is (IntegrityError if isinstance(error, UcpError) else StorageError)
    assert str(raised.value) == f"step 9 was not saved: {error}"  # (no rank named in a world of one)
    assert raised.value.__cause__ is error and undone == [True]


def test_alone_a_bug_or_a_failed_decision_is_raised_as_itself_and_undone():
    comm = LocalComm()
    undone: list[bool] = []
    bug = KeyError("a bug")

    def failing() -> Value:
        raise bug

    with pytest.raises(KeyError) as raised:
        coordination.all_reduce(
            comm, failing, lambda v: Total(0, []), Value, Total, on_failure=lambda: undone.append(1)
        )
    assert raised.value is bug and undone == [1]

    refused = StepExistsError("step 2 is already committed")

    def decide(values: list[Value]) -> Total:
        raise refused

    with pytest.raises(StepExistsError) as raised_too:
        coordination.all_reduce(comm, lambda: value_of(0, 1), decide, Value, Total, on_failure=lambda: undone.append(2))
    assert raised_too.value is refused and undone == [1, 2]


def test_a_failed_undoing_is_logged_and_the_failure_raised(caplog):
    def undo() -> None:
        raise OSError("cannot remove the attempt")

    def decide() -> Total:
        raise FormatError("bad manifest")

    with caplog.at_level(logging.ERROR, logger="ucp"), pytest.raises(FormatError, match="bad manifest"):
        coordination.broadcast(LocalComm(), decide, Total, on_failure=undo)
    assert "cannot remove the attempt" in caplog.text


def test_failures_name_every_failing_rank_in_order():
    failures = coordination.Failures(
        (coordination.RankFailure(1, "OSError", "disk full"), coordination.RankFailure(4, "IntegrityError", "bad")), 8
    )
    assert failures.kind() is UcpError and failures.kind(StorageError) is StorageError
    error = failures.error("step 3 was not saved", default=StorageError)
    assert type(error) is StorageError
    assert (
        str(error) == "step 3 was not saved: ranks 1, 4 failed: rank 1: OSError: disk full; rank 4: IntegrityError: bad"
    )
    one = coordination.Failures((coordination.RankFailure(2, "InteropError", "refused"),), 8)
    assert type(one.error()).__name__ == "InteropError" and str(one.error()) == "rank 2 failed: refused"


# -- the typed messages


def roundtrip(message):
    return type(message).from_json(json.loads(json.dumps(message.to_json())))


def test_the_messages_of_the_save_session_and_the_hot_tier_cross_as_json_unchanged():
    rng = random.Random(DRAW.randrange(1 << 30))
    for _ in range(20):
        objects = {
            f"step_00000001/attempt-x/a{i}/c/{i}": (rng.randrange(1 << 40), rng.randrange(1 << 32))
            for i in range(rng.randrange(5))
        }
        packed = {
            f"model/p{i}": [
                [
                    n,
                    f"pack-r{rng.randrange(8)}-{n}",
                    rng.randrange(1 << 30),
                    rng.randrange(1 << 20),
                    rng.randrange(1 << 32),
                ]
                for n in range(rng.randrange(1, 4))
            ]
            for i in range(rng.randrange(4))
        }
        n = rng.randrange(0, 200)
        messages = [
            Begun(f"attempt-{rng.randrange(1 << 60):x}"),
            RankWrites(objects, packed),
            Committed(rng.randrange(1 << 40), "attempt-y"),
            NodePlace(f"host{rng.randrange(9)}", f"/dev/shm/node-{rng.randrange(9)}"),
            Holdings(sorted(rng.sample(range(1000), rng.randrange(4))), rng.choice([None, rng.randrange(1000)])),
            NodeMap([rng.randrange(9) for _ in range(n)]),
            Candidates(
                [(rng.randrange(1 << 40), sorted(rng.sample(range(1 << 20), rng.randrange(1, 4)))) for _ in range(3)],
                rng.choice([None, 7]),
            ),
            RootId(rng.choice([None, f"{rng.randrange(1 << 128):032x}"])),
            Checked(sorted(rng.sample(range(1 << 31), n)), [f"damaged {i}" for i in range(rng.randrange(3))]),
            Directory.of([rng.sample(range(1 << 20), rng.randrange(4)) for _ in range(n)], ["damaged x"]),
            Published(
                bytes(rng.randrange(256) for _ in range(rng.randrange(64))), '{"é": 1}'.encode() * rng.randrange(3)
            ),
        ]
        for message in messages:
            if isinstance(message, RankWrites):  # (its sums stay the [size, crc] pairs JSON gives: rank 0 takes many)
                assert json.loads(json.dumps(roundtrip(message).to_json())) == json.loads(json.dumps(message.to_json()))
                assert all(list(v) == list(message.objects[k]) for k, v in roundtrip(message).objects.items())
                continue
            assert roundtrip(message) == message, message


def test_several_ranks_writes_are_merged_one_rank_s_taken_as_recorded():
    prefix = "step_00000003/attempt-x"
    a = RankWrites.of(prefix, {f"{prefix}/k/a": (1, 2)}, {"p": [[0, "pack-r0-0", 0, 8, 5]]})
    b = RankWrites.of(
        prefix, {f"{prefix}/k/b": (3, 4)}, {"p": [[1, "pack-r1-0", 0, 8, 6]], "q": [[0, "pack-r1-0", 64, 8, 7]]}
    )
    assert a.objects == {"k/a": (1, 2)}  # (what crosses: keys below the attempt's directory)
    objects, packed = RankWrites.merged([a, b])
    assert objects == {"k/a": (1, 2), "k/b": (3, 4)}
    assert packed == {"p": [[0, "pack-r0-0", 0, 8, 5], [1, "pack-r1-0", 0, 8, 6]], "q": [[0, "pack-r1-0", 64, 8, 7]]}
    assert RankWrites.merged([a])[1] is a.packed
