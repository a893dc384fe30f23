"""One process of a node sharing a disk cache (tests/test_loader_storage.py).

``keys DIR CAP SEED``: random gets and puts of 200 shared keys, whose values follow from the key, each value that
comes back checked. ``ranks DIR CAP SEED DATA OUT RANK``: rank RANK of 4 of a PretrainLoader through the cache;
its first 30 batches' input ids saved to OUT/rankRANK.npy for the test to compare.
"""

from __future__ import annotations

import hashlib
import random
import sys

import numpy as np


def value(key: int) -> bytes:
    n = 1024 + key * 97 % 15000
    block = hashlib.sha256(str(key).encode()).digest()
    return (block * (n // len(block) + 1))[:n]


def keys(directory: str, cap: int, seed: int) -> None:
    from dataloaders import DiskCache

    cache = DiskCache(directory, cap)
    rng = random.Random(seed)
    for _ in range(600):
        k = rng.randrange(200)
        got = cache.get(f"k{k}", len(value(k)))
        if got is None:
            cache.put(f"k{k}", value(k))
        elif got != value(k):
            raise SystemExit(f"key {k}: the cache returned other bytes")


def ranks(directory: str, cap: int, seed: int, data: str, out: str, rank: int) -> None:
    from dataloaders import PretrainLoader

    from .test_loader_storage import worker_loader_kw

    loader = PretrainLoader(data, **worker_loader_kw(seed), dp_rank=rank, dp_size=4, disk_cache=directory,
                            disk_cache_bytes=cap)  # fmt: skip
    rows = np.stack([next(loader)["input_ids"].numpy() for _ in range(30)])
    loader.close(wait=True)
    np.save(f"{out}/rank{rank}.npy", rows)


if __name__ == "__main__":
    mode, directory, cap, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "keys":
        keys(directory, cap, seed)
    else:
        ranks(directory, cap, seed, sys.argv[5], sys.argv[6], int(sys.argv[7]))
