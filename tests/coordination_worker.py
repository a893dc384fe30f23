"""One rank of test_coordination.py: the ranks' coordination (ucp.protocol.coordination) over gloo, trial by trial.

    python -m tests.coordination_worker PLAN_JSON OUT_DIR

PLAN_JSON lists trials, each {"op": "all_reduce" | "all_gather" | "broadcast", "fail": {rank: [kind, reason]},
"decide_fails": [kind, reason] | null, "sizes": {rank: n}}: a rank in "fail" raises an exception of that kind in
its own step (a ucp type by name, an interop one, an OSError, a ValueError), the coordinator's decision raises
"decide_fails". Each rank writes OUT_DIR/rank{r}.json: per trial, what it returned or raised (type, message, the
type of its cause), and on the coordinator how often the decision and the undoing ran.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

import ucp.interop.errors  # noqa: F401 -- interop's error types exist in every rank, as in a real job
from ucp.errors import error_kind
from ucp.protocol import coordination
from ucp.protocol.comm import TorchComm


@dataclass(frozen=True)
class Value:
    """A rank's value: its rank and a payload of `n` numbers (ranks send values of different lengths)."""

    rank: int
    payload: list[int]

    def to_json(self) -> dict:
        return {"rank": self.rank, "payload": self.payload}

    @classmethod
    def from_json(cls, doc: Any) -> Value:
        return cls(int(doc["rank"]), [int(x) for x in doc["payload"]])


@dataclass(frozen=True)
class Total:
    """The coordinator's decision: the sum of every rank's payload, and the ranks in the order it got them."""

    total: int
    ranks: list[int]

    def to_json(self) -> list:
        return [self.total, self.ranks]

    @classmethod
    def from_json(cls, doc: Any) -> Total:
        return cls(int(doc[0]), [int(r) for r in doc[1]])


def exception(kind: str, reason: str) -> BaseException:
    if kind == "OSError":
        return OSError(28, reason)
    if kind == "ValueError":
        return ValueError(reason)
    found = error_kind(kind)
    assert found is not None, kind
    return found(reason)


def value_of(rank: int, n: int) -> Value:
    return Value(rank, [rank * 1000 + i for i in range(n)])


def trial(comm: TorchComm, plan: dict) -> dict:
    rank = comm.rank
    counts = {"decided": 0, "undone": 0}
    fails = plan["fail"].get(str(rank))

    def local() -> Value:
        if fails is not None:
            raise exception(*fails)
        return value_of(rank, plan["sizes"][str(rank)])

    def decide_total(values: list[Value]) -> Total:
        counts["decided"] += 1
        if plan["decide_fails"] is not None:
            raise exception(*plan["decide_fails"])
        return Total(sum(sum(v.payload) for v in values), [v.rank for v in values])

    def decide_alone() -> Total:
        return decide_total([value_of(rank, plan["sizes"][str(rank)])])

    def undo() -> None:
        counts["undone"] += 1

    result: dict = {}
    try:
        if plan["op"] == "all_reduce":
            got: Any = coordination.all_reduce(comm, local, decide_total, Value, Total, on_failure=undo)
            result["value"] = got.to_json()
        elif plan["op"] == "all_gather":
            got = coordination.all_gather(comm, local, Value)
            result["value"] = [v.to_json() for v in got]
        else:
            got = coordination.broadcast(comm, decide_alone, Total, on_failure=undo)
            result["value"] = got.to_json()
    except Exception as e:  # noqa: BLE001 -- what each rank raised is the result
        cause = e.__cause__
        result["raised"] = [type(e).__name__, str(e), type(cause).__name__ if cause is not None else None]
    if rank == 0:
        result |= counts
    return result


def main(plan_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    comm = TorchComm()
    with open(plan_file) as f:
        plans = json.load(f)
    results = [trial(comm, plan) for plan in plans]
    with open(os.path.join(out_dir, f"rank{comm.rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
