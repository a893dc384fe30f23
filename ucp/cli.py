"""The `ucp` command line: inspect and verify checkpoints, run the IO benchmark.

Nothing heavy is imported before a command runs (each imports what it needs), so that `ucp --help` and an argument
error answer at once. A flag given where it means nothing (a storage option with a local path, a DCP-only option
with another format) is refused in one line naming it, before anything is read or written (`ucp.cli_common`, which
the benchmarks' command line shares).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .cli_common import add_storage_option, parse_storage_options, run_command, storage_option_applies
from .errors import UcpError


def _add_location(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="checkpoint root (local path, file://, memory://, s3://...) or a step directory in it")
    p.add_argument("--step", default="latest", help="step to read (default: the latest committed step)")
    add_storage_option(p)


def _open(args: argparse.Namespace):
    from .engine.checkpoint import open_checkpoint

    step = args.step if args.step == "latest" else _int_step(args.step)
    return open_checkpoint(args.url, step, storage_options=parse_storage_options(args.storage_option))


def _int_step(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UcpError(f"--step takes a number or 'latest', got {text!r}") from None


def cmd_inspect(args: argparse.Namespace) -> int:
    from .engine.inspection import describe, format_table

    info = describe(_open(args))
    print(json.dumps(info, indent=1) if args.json else format_table(info))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .engine.inspection import verify

    report = verify(_open(args))
    for problem in report.problems:
        print(f"DAMAGED  {problem}")
    status = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    print(f"step {report.step}: {report.atoms} atoms, {report.chunks} data objects (chunks, packs) checked: {status}")
    return 0 if report.ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args.dir)


_LOCATION_RULES: dict[str, Any] = {
    "rules": (storage_option_applies(lambda args: args.url),),
    "context": lambda args: args.url,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ucp", description="Universal checkpoints: inspect, verify, convert, export, import, demo, benchmark."
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="on an error, print its traceback (with its cause) after the one-line message",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="show a step: format version, layout, atoms and totals")
    _add_location(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_inspect, **_LOCATION_RULES)

    p = sub.add_parser(
        "verify",
        help="re-read every object (each pack whole, with every packed atom's checksum), check every checksum, each "
        "object's size and checksum against its commit's record, the state tree every load rebuilds, and every "
        "atom's, pack's, group's and the root's zarr.json (exit 1 if anything is damaged)",
    )
    _add_location(p)
    p.set_defaults(func=cmd_verify, **_LOCATION_RULES)

    p = sub.add_parser("demo", help="save a small model's training state, load it back, inspect the checkpoint")
    p.add_argument("--dir", default="ucp-demo", help="checkpoint root to write (default: ./ucp-demo)")
    p.set_defaults(func=cmd_demo)

    from .interop.cli import register as register_interop

    register_interop(sub)

    sub.add_parser("bench", help="IO benchmark: the same as python -m bench_io (ucp bench --help)", add_help=False)
    return parser


def _bench(args: argparse.Namespace) -> int:
    from bench_io.__main__ import main as bench_main  # (bench_io parses its own arguments)

    return bench_main(args.bench_argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verbose = 1 if argv[:1] in (["-v"], ["--verbose"]) else 0
    if argv[verbose : verbose + 1] == ["bench"]:  # bench_io parses its own arguments; its errors are ours (below)
        args = argparse.Namespace(func=_bench, bench_argv=argv[verbose + 1 :], verbose=bool(verbose))
    else:
        args = build_parser().parse_args(argv)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
