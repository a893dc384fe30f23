"""What the benchmarks' command lines share (`python -m bench_io` and its subcommands): sizes and comma lists as
argument types."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
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


def at_least(low: int) -> Any:
    """An int argument of at least `low` (a count of repeats, threads, tensors): refused by argparse in one line,
    not minutes into a run."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """A float argument above zero (a size in GiB, a number of seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def positive_size(text: str) -> int:
    """`parse_size`, above zero bytes."""
    value = parse_size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {text!r}")
    return value


def output_file(text: str) -> str:
    """A file the run writes its figures to: its directory must exist before the run, not after it."""
    parent = Path(text).expanduser().resolve().parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory {parent}")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory")
    return text


def counts(low: int) -> Any:
    """A comma list of ints, each at least `low` ('16,32')."""
    one = at_least(low)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of numbers")
        return [one(x) for x in items]

    return parse
