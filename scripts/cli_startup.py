"""How long `ucp --help` and an argument error take, a user's wait from the shell, against another revision's.

    git archive REV | tar -x -C /tmp/base     # the baseline: another revision's tree
    python scripts/cli_startup.py --baseline /tmp/base [--repeats 7]

Each command runs as a new process (`python -m ucp ...`, the interpreter's start included) with this checkout and
with the baseline's on PYTHONPATH, the two alternating, `--repeats` times; the table gives medians and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {
    "ucp --help": ["--help"],
    "ucp convert ... (an argument error)": ["convert", "A", "B", "--from", "tp2", "--to", "tp1", "--vocab-size", "x"],
    "ucp bench --help": ["bench", "--help"],
}


def seconds(tree: Path, argv: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ucp", *argv], env=env, capture_output=True, check=False, cwd=tree)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True, help="a tree of another revision (git archive REV)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            for which, tree in (("baseline", args.baseline), ("this", REPO)):
                times.setdefault((name, which), []).append(seconds(tree, argv))
    print(f"medians of {args.repeats}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| command | baseline | this checkout | ratio |\n|---|---|---|---|")
    for name in COMMANDS:
        before, after = (statistics.median(times[(name, w)]) for w in ("baseline", "this"))
        print(f"| `{name}` | {before:.2f} s | {after:.2f} s | {before / after:.0f}x |")


if __name__ == "__main__":
    main()
