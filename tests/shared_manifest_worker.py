"""One rank of test_shared_manifest.py: a step's manifest opened for all the ranks at once (open_shared) over gloo.

    python -m tests.shared_manifest_worker ROOT PATHS_JSON OUT_DIR

PATHS_JSON gives each rank the atom paths it reads. Each rank records every object it read from storage, which
index parts it holds, and a digest of each atom it then read (or what it raised), in OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from ucp.distributed import open_shared
from ucp.protocol.comm import TorchComm
from ucp.storage import LocalStorage


class Recording(LocalStorage):
    """Local files, each read recorded by key."""

    def __init__(self, root: str):
        super().__init__(root)
        self.keys: list[str] = []

    def read(self, key: str, start: int = 0, end: int | None = None) -> memoryview:
        self.keys.append(key)
        return super().read(key, start, end)

    def read_into(self, key: str, offset: int, buffers) -> int:  # type: ignore[no-untyped-def]
        self.keys.append(key)
        return super().read_into(key, offset, buffers)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"").hexdigest()


def main(root: str, paths_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    comm = TorchComm()
    with open(paths_file) as f:
        mine = json.load(f)[comm.rank]
    storage = Recording(root)
    result: dict = {}
    try:
        reader = open_shared(storage, comm, paths=lambda _: mine)
        result["read"] = list(storage.keys)
        result["held"] = [n for n in range(len(reader.manifest.entries)) if reader.manifest.has_part(n)]
        result["digests"] = {p: digest(t) for p, t in reader.read_atoms(mine).items()}
    except Exception as e:  # noqa: BLE001 -- what each rank raised is the result
        result["raised"] = [type(e).__name__, str(e)]
    with open(os.path.join(out_dir, f"rank{comm.rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
