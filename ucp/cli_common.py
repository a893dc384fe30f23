"""What ucp's command lines share (`ucp`'s commands, and `python -m bench_io` / `ucp bench`): fsspec storage options
given as flags, flags that apply only somewhere, and a parsed command run with its errors reported in one line.

A flag given where it means nothing (a storage option with a local path, a DCP-only option with another format) is
refused in one line naming it, before anything is read or written: `Applies` says where each such flag applies, and
`refuse_inapplicable` checks every parsed command against its own (`run_command` does, before the command runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import UcpError

# Options that are strings whatever they look like: a secret or a profile may well be all digits, or start with one.
STRING_OPTIONS = frozenset({"key", "secret", "token", "profile", "endpoint_url", "region_name", "username", "password"})


def parse_storage_options(pairs: list[str]) -> dict[str, Any]:
    """`-o KEY=VALUE` pairs as fsspec storage options: a value that is a JSON document (`8`, `true`, `{"a": 1}`) is
    taken as one, any other as a string, and the options of STRING_OPTIONS always as strings."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UcpError(f"--storage-option takes KEY=VALUE, got {pair!r}")
        options[key] = value if key in STRING_OPTIONS else _json_or_text(value)
    return options


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def add_storage_option(
    p: argparse.ArgumentParser,
    help: str = "fsspec storage option, e.g. endpoint_url=http://127.0.0.1:9000 (S3 also reads the AWS_* variables)",
) -> None:
    """`-o/--storage-option KEY=VALUE`, repeatable, as every command that opens a URL takes it (parse_storage_options)."""
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE", help=help)


def is_remote(url: str) -> bool:
    """Whether `url` names a store that storage options configure (s3://, memory://, ...), not a local path."""
    return "://" in url and not url.startswith("file://")


@dataclass(frozen=True)
class Applies:
    """Where a flag means something. A flag given (a value other than None, [] or False) while `when` is false for
    the parsed arguments is refused: "FLAG applies only WHERE, not CONTEXT", CONTEXT being the rule's own (`context`,
    when it returns a string) or the command's (its --from/--to, its URL)."""

    flag: str
    dest: str
    when: Callable[[argparse.Namespace], bool]
    where: str
    context: Callable[[argparse.Namespace], str | None] = lambda args: None


def storage_option_applies(*urls: Callable[[argparse.Namespace], str | None]) -> Applies:
    """`-o` applies where a URL that the command opens with the storage options (each of `urls` gives one, or None
    where that side is not opened with them) names a remote store."""

    def opened(args: argparse.Namespace) -> list[str]:
        return [u for u in (url(args) for url in urls) if u is not None]

    return Applies(
        "-o/--storage-option",
        "storage_option",
        lambda args: any(is_remote(u) for u in opened(args)),
        "to a remote store's URL (s3://..., or another fsspec URL)",
        lambda args: f"to the local path {' and '.join(opened(args))}" if opened(args) else None,
    )


def refuse_inapplicable(
    args: argparse.Namespace, rules: Sequence[Applies], context: Callable[[argparse.Namespace], str]
) -> None:
    """Raise a UcpError naming the first flag given in `args` (with its value) where its rule says it means nothing."""
    for rule in rules:
        value = getattr(args, rule.dest, None)
        if value not in (None, [], False) and not rule.when(args):
            given = "" if value is True else " " + " ".join(map(str, value if isinstance(value, list) else [value]))
            raise UcpError(f"{rule.flag}{given} applies only {rule.where}, not {rule.context(args) or context(args)}")


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed command (`args.func(args)`) as every command of ours runs: its flags checked against its rules
    (`args.rules`, `args.context`), a UcpError one line on stderr and exit status 1 (with `args.verbose`, the traceback
    too, and what the library logs), a closed pipe on stdout the reader's choice."""
    if args.verbose:  # what the library logs (the `ucp` logger: silent by default), on stderr
        import logging

        logging.basicConfig(format="ucp: %(levelname)s %(message)s", level=logging.WARNING)
        logging.getLogger("ucp").setLevel(logging.INFO)
    try:
        refuse_inapplicable(args, getattr(args, "rules", ()), getattr(args, "context", lambda args: ""))
        return args.func(args)
    except UcpError as e:
        print(f"ucp: error: {e}", file=sys.stderr)
        if args.verbose:
            import traceback

            traceback.print_exception(e)
        return 1
    except BrokenPipeError:  # `ucp inspect ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit's flush)
        return 0
