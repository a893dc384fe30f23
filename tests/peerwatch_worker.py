"""One rank of a peer-watch ring (trainer/peerwatch.py) for tests/test_trainer_devices.py: `python -m
tests.peerwatch_worker RANK WORLD PORT OUT_DIR`. It joins the ring through a TCPStore (rank 0 hosts it), writes
`ready<rank>`, then `lost<rank>` when its watch says a peer is gone; a rank that finds `stop` in OUT_DIR stops
its watch and writes `stopped<rank>`."""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import torch.distributed as dist

from trainer.peerwatch import PeerWatch


def main(rank: int, world: int, port: int, out: Path) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    watch = PeerWatch(store, "test", rank, world, "127.0.0.1", lambda: (out / f"lost{rank}").write_text("lost"))
    (out / f"ready{rank}").write_text("ready")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not watch.lost:
        if (out / "stop").exists():
            watch.stop()
            (out / f"stopped{rank}").write_text("stopped")
            break
        time.sleep(0.01)
    time.sleep(1)  # (rank 0 hosts the store: the others are done with it by now)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
