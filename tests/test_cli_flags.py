"""Every flag of every `ucp` subcommand (and of `ucp bench` and `ucp bench reshard`), walked against every --from /
--to / --targets and against local and remote URLs: where the flag means nothing, the command refuses it in one line
naming it, with a non-zero exit, before it reads or writes anything; where it means something, it is not refused.

Where each flag applies is written below by hand (`APPLIES`), apart from the rules in the code, and the walk takes
the flags from the parsers themselves: a new flag that this table does not classify fails the test."""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench_io import __main__ as bench_main
from bench_io import reshard as bench_reshard
from ucp import cli
from ucp.cli_common import refuse_inapplicable
from ucp.errors import UcpError

Variant = dict[str, Any]
ALWAYS: Callable[[Variant], bool] = lambda v: True


def remote(url: str) -> bool:
    return url.startswith("s3://")


# subcommand -> flag -> where it applies, as a user reads the docs (the variant's --from/--to/--targets and URLs)
APPLIES: dict[str, dict[str, Callable[[Variant], bool]]] = {
    "inspect": {"--step": ALWAYS, "--json": ALWAYS, "--storage-option": lambda v: remote(v["url"])},
    "verify": {"--step": ALWAYS, "--storage-option": lambda v: remote(v["url"])},
    "demo": {"--dir": ALWAYS},
    "convert": {
        "--vocab-size": lambda v: v["from"] != "universal",  # (read from a Megatron checkpoint's args)
        "--iteration": lambda v: v["from"] != "universal",
        "--target-ep": lambda v: v["to"] == "torch_dist",
        "--target-layout": lambda v: v["to"] == "torch_dist",
        "--config": lambda v: v["from"] == "torch_dist",  # (a save without Megatron-LM's args)
        "--step": lambda v: "universal" in (v["from"], v["to"]),
        "--memory-budget": ALWAYS,
        "--workers": ALWAYS,
        "--no-progress": ALWAYS,
        "--storage-option": lambda v: (
            (v["from"] == "universal" and remote(v["src"])) or (v["to"] == "universal" and remote(v["dst"]))
        ),
    },
    "export": {
        "--dtype": lambda v: v["to"] in ("hf", "dcp"),
        "--step": ALWAYS,
        "--max-shard-size": lambda v: v["to"] == "hf",
        "--memory-budget": ALWAYS,
        "--workers": ALWAYS,
        "--no-progress": ALWAYS,
        "--storage-option": lambda v: remote(v["url"]),
    },
    "import": {
        "--step": ALWAYS,
        "--dtype": lambda v: v["from"] in ("hf", "dcp"),
        "--config": lambda v: v["from"] in ("dcp", "megatron-dist"),
        "--memory-budget": ALWAYS,
        "--workers": ALWAYS,
        "--no-progress": ALWAYS,
        "--storage-option": lambda v: remote(v["url"]),
    },
    "bench": {
        "--size": ALWAYS,
        "--repeats": ALWAYS,
        "--endpoint-url": lambda v: "s3" in v["targets"],
        "--bucket": lambda v: "s3" in v["targets"],
        "--s3-server": lambda v: "s3" in v["targets"],  # (the variants give no --endpoint-url)
        "--storage-option": lambda v: "s3" in v["targets"],
        "--methods": ALWAYS,
        "--dir": lambda v: "disk" in v["targets"],
        "--small-tensors": lambda v: v["procs"] == 1,
        # the small-tensor states run in one process, on local targets unless --small-tensors is given
        "--small-methods": lambda v: v["procs"] == 1 and v["targets"] != ["s3"],
        "--cache": lambda v: "disk" in v["targets"],  # (tmpfs has no page cache to drop, S3 none at all)
        "--io-threads": ALWAYS,
        "--seed": ALWAYS,
        "--json": ALWAYS,
        "--png": ALWAYS,
        "--quick": ALWAYS,
    },
    "bench reshard": {
        "--size": ALWAYS,
        "--save-layout": ALWAYS,
        "--load-layouts": ALWAYS,
        "--dir": lambda v: v["target"] == "disk",
        "--cache": lambda v: v["target"] == "disk",
        "--io-threads": ALWAYS,
        "--object-bytes": ALWAYS,
        "--inner-bytes": ALWAYS,
        "--pack-below": ALWAYS,
        "--seed": ALWAYS,
        "--no-verify": ALWAYS,
        "--json": ALWAYS,
        "--png": ALWAYS,
    },
}

# the flags that choose the variant (walked as its axes, not as flags)
AXES = {"--from", "--to", "--targets", "--procs", "--target"}

# a value each flag takes (None: a switch)
VALUES: dict[str, str | None] = {
    "--step": "3",
    "--s3-server": "moto",
    "--json": None,
    "--storage-option": "endpoint_url=http://127.0.0.1:9",
    "--dir": "somewhere",
    "--vocab-size": "512",
    "--iteration": "3",
    "--target-ep": "2",
    "--target-layout": "tp2",
    "--pack-below": "4096",
    "--memory-budget": "1GiB",
    "--workers": "2",
    "--no-progress": None,
    "--dtype": "bf16",
    "--max-shard-size": "1GiB",
    "--config": "config.json",
    "--size": "1MiB",
    "--repeats": "1",
    "--endpoint-url": "http://127.0.0.1:9",
    "--bucket": "a-bucket",
    "--methods": "raw",
    "--small-tensors": "10",
    "--small-methods": "raw",
    "--cache": "fadvise",
    "--io-threads": "4",
    "--seed": "1",
    "--png": "out.png",
    "--quick": None,
    "--save-layout": "tp2pp2",
    "--load-layouts": "tp1pp1",
    "--object-bytes": "1MiB",
    "--inner-bytes": "64KiB",
    "--no-verify": None,
}
BENCH_JSON = {"bench": "out.json", "bench reshard": "out.json"}  # (--json takes a file there, a switch elsewhere)


def parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out = {name: p for name, p in sub.choices.items() if name != "bench"}  # (bench parses its own arguments)
    out["bench"] = bench_main.build_parser()
    out["bench reshard"] = bench_reshard.build_parser()
    return out


def flags(parser: argparse.ArgumentParser) -> list[str]:
    """Each optional argument by its longest name, but the help and the variant's axes."""
    names = [max(a.option_strings, key=len) for a in parser._actions if a.option_strings]
    return [n for n in names if n not in ("--help", *AXES)]


def variants(command: str, tmp: Path) -> list[tuple[Variant, list[str]]]:
    """(variant, its argv) of every --from/--to/--targets a command takes, with local and remote URLs."""
    local, s3 = str(tmp / "local"), "s3://a-bucket/run"
    out: list[tuple[Variant, list[str]]] = []
    if command in ("inspect", "verify"):
        out = [({"url": url}, [command, url]) for url in (local, s3)]
    elif command == "demo":
        out = [({}, ["demo"])]
    elif command == "convert":
        for frm, to, src, dst in itertools.product(
            ("tp2pp2", "torch_dist", "universal"), ("tp4pp1", "torch_dist", "universal"), (local, s3), (local, s3)
        ):
            if src == dst:
                continue
            v = {"from": frm, "to": to, "src": src, "dst": dst}
            out.append((v, ["convert", src, dst if dst != local else str(tmp / "out"), "--from", frm, "--to", to]))
    elif command == "export":
        for to, url in itertools.product(("hf", "dcp", "megatron-dist"), (local, s3)):
            out.append(({"to": to, "url": url}, ["export", url, "--to", to, str(tmp / "out")]))
    elif command == "import":
        for frm, url in itertools.product(("hf", "dcp", "megatron-dist"), (local, s3)):
            out.append(({"from": frm, "url": url}, ["import", str(tmp / "src"), url, "--from", frm]))
    elif command == "bench":
        for targets, procs in itertools.product((["tmpfs"], ["disk"], ["s3"], ["tmpfs", "s3"], ["disk", "s3"]), (1, 2)):
            v = {"targets": targets, "procs": procs}
            out.append((v, ["bench", "--targets", ",".join(targets), "--procs", str(procs)]))
    elif command == "bench reshard":
        out = [({"target": t}, ["bench", "reshard", "--target", t]) for t in ("disk", "tmpfs")]
    return out


def with_flag(command: str, argv: list[str], flag: str) -> list[str]:
    value = BENCH_JSON.get(command) if flag == "--json" else VALUES[flag]
    return [*argv, flag] + ([] if value is None else [value])


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """Run `ucp ARGV` in this process: (exit status, its stderr's lines)."""
    capsys.readouterr()
    try:
        status = cli.main(argv)
    except SystemExit as e:  # (argparse's own errors)
        status = int(e.code or 0)
    return status, capsys.readouterr().err.strip().splitlines()


def applies(command: str, argv: list[str]) -> bool:
    """Whether the code takes the flags of `argv` for its command, by the same check `ucp` runs before a command."""
    if command == "bench":
        args = bench_main.build_parser().parse_args(argv[1:])
        rules, context = bench_main.RULES, bench_main._targets
    elif command == "bench reshard":
        args = bench_reshard.build_parser().parse_args(argv[2:])
        rules, context = bench_reshard.RULES, bench_reshard._target
    else:
        args = cli.build_parser().parse_args(argv)
        rules, context = getattr(args, "rules", ()), getattr(args, "context", str)
    try:
        refuse_inapplicable(args, rules, context)
    except UcpError:
        return False
    return True


def test_every_flag_of_every_command_is_classified() -> None:
    for command, parser in parsers().items():
        assert set(flags(parser)) == set(APPLIES[command]), command


def test_every_flag_is_refused_where_it_does_not_apply_and_taken_where_it_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    walked = refusals = 0
    for command, parser in parsers().items():
        for variant, argv in variants(command, tmp_path):
            for flag in flags(parser):
                full = with_flag(command, argv, flag)
                walked += 1
                if APPLIES[command][flag](variant):
                    assert applies(command, full), f"`ucp {' '.join(full)}`: {flag} applies there but is refused"
                    continue
                refusals += 1
                status, lines = refused(full, capsys)
                names = parser._option_string_actions[flag].option_strings  # (-o and --storage-option)
                assert status == 1 and len(lines) == 1, (full, status, lines)
                assert lines[0].startswith("ucp: error: ") and "applies only" in lines[0], (full, lines)
                assert any(name in lines[0] for name in names), (full, lines)
                assert not (tmp_path / "out").exists(), full  # refused before anything was written
    assert walked >= 400 and refusals >= 100, (walked, refusals)  # (413 and 101 when written)


def test_the_refusals_a_user_met(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cases of the report that asked for this, end to end."""
    for argv, says in (
        (
            ["import", "SRC", "URL", "--from", "hf", "--config", "c.json"],
            "--config c.json applies only with --from dcp",
        ),
        (
            ["export", "URL", "--to", "dcp", "OUT", "--max-shard-size", "1GiB"],
            "--max-shard-size 1073741824 applies only",
        ),
        (["convert", "URL", "OUT", "--from", "universal", "--to", "tp2", "--iteration", "3"], "--iteration"),
        (["convert", "A", "B", "--from", "tp2", "--to", "tp1", "--step", "4"], "--step 4 applies only"),
        (["inspect", str(tmp_path), "-o", "endpoint_url=http://x"], f"not to the local path {tmp_path}"),
        (["bench", "--targets", "tmpfs", "--bucket", "b"], "--bucket b applies only with the s3 target"),
        (["inspect", "s3://b/run", "-o", 'config_kwargs={"s3": 5}'], "config_kwargs.s3 is a mapping"),
        (
            ["bench", "--targets", "s3", "--endpoint-url", "http://a", "--bucket", "s3://b"],
            "--bucket s3://b: a bucket's name (and a prefix under it: BUCKET/PREFIX), not a URL",
        ),
        (
            ["bench", "--targets", "s3", "--endpoint-url", "http://a", "--bucket", "b", "-o", "endpoint_url=http://b"],
            "--endpoint-url http://a and -o endpoint_url=http://b name two endpoints",
        ),
        (["inspect", "s3://b/run", "-o", "config_kwargs=5"], "the storage option config_kwargs is a mapping"),
        (["inspect", "s3://b/run", "-o", "client_kwargs=x"], "the storage option client_kwargs is a mapping"),
        (["bench", "--targets", "disk", "--small-tensors", "0", "--small-methods", "raw"], "--small-methods"),
    ):
        status, lines = refused([a.replace("SRC", str(tmp_path / "s")) for a in argv], capsys)
        assert status == 1 and len(lines) == 1 and says in lines[0], (argv, lines)
    assert applies("bench", ["bench", "--targets", "s3", "--small-tensors", "10", "--small-methods", "raw"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["convert", "--help"],
        ["bench", "--help"],
        ["convert", "A", "B", "--from", "tp2", "--to", "tp1", "--step", "4"],
        ["bench", "--targets", "tmpfs", "--dir", "x"],
        ["inspect"],
    ],
)
def test_help_and_argument_errors_answer_without_importing_torch(argv: list[str]) -> None:
    """`ucp --help` and an argument error import nothing heavy (torch alone takes seconds on a busy machine): a child
    process that answers, then reports which of torch, zarr and numpy it imported. (How long they take is a figure
    of docs/BENCHMARKS.md, not a timed test.)"""
    probe = (
        "import sys, runpy; sys.argv = ['ucp', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('ucp', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('IMPORTED', sorted(m for m in ('torch', 'zarr', 'numpy') if m in sys.modules), file=sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120, check=False, env=os.environ
    )
    assert proc.stderr.strip().splitlines()[-1] == "IMPORTED []", proc.stderr[-2000:]


def test_every_public_name_resolves_and_every_error_class_is_public() -> None:
    """`ucp.X` for each name of `ucp.__all__` (imported on first use), and every error a caller may catch, the
    storage ones included (a job catches `ucp.StorageAuthError` as it catches `ucp.StepExistsError`)."""
    import inspect

    import ucp
    from ucp import errors

    for name in ucp.__all__:
        assert getattr(ucp, name) is not None, name
    error_classes = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.UcpError)}
    assert error_classes <= set(ucp.__all__), error_classes - set(ucp.__all__)
