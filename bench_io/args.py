"""What the benchmarks' command lines share (`python -m bench_io` and its subcommands): sizes and comma lists as
argument types."""

from __future__ import annotations

import argparse
import re
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_size(text: str) -> int:
    """'1GiB', '256MiB', '512M' (decimal), '1.5g', '4096' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 256MiB, 500MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def parse_list(choices: list[str]) -> Any:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return list(dict.fromkeys(items))

    return parse
