"""The `convert`, `export` and `import` subcommands; `register(subparsers)` adds them to the `ucp` parser
(ucp/cli.py).

    ucp convert SRC DST --from tp8pp4 --to tp4pp8      Megatron torch checkpoint, resharded through atoms
    ucp convert SRC URL --from tp2pp2 --to universal   Megatron -> ucp
    ucp convert URL DST --from universal --to tp4      ucp -> Megatron
    ucp convert SRC DST --from torch_dist --to tp4pp8  Megatron torch_dist (dist_checkpointing) -> torch format
    ucp convert SRC DST --from tp2pp2 --to torch_dist  (and universal <-> torch_dist): torch_dist loads in any layout
    ucp export URL --to hf DIR [--dtype bf16]          ucp -> Hugging Face Mixtral (safetensors)
    ucp export URL --to dcp DIR                        ucp -> torch.distributed.checkpoint
    ucp export URL --to megatron-dist DIR              ucp -> Megatron torch_dist (as convert --to torch_dist)
    ucp export URL --to vllm DIR                       the directory vLLM starts from (no weights: they stay in URL)
    ucp import DIR URL [--from hf|dcp|megatron-dist]   Hugging Face (or DCP, Megatron torch_dist) -> ucp

A flag that means nothing for the chosen --from/--to (`--config` with --from hf, `--max-shard-size` with --to dcp,
`--iteration` with --from universal, `--step` between two Megatron layouts, `-o` with local paths) is refused in one
line naming it (the `Applies` rules of each command, checked by ucp.cli_common.run_command before the command
runs). The converters are imported by the command that runs them, not here: `ucp --help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..cli_common import Applies, add_storage_option, parse_storage_options, storage_option_applies
from .megatron.save import TORCH_DIST, UNIVERSAL
from .staging import check_apart, local_output

MEGATRON_DIST = "megatron-dist"  # Megatron-LM's torch_dist format, as export/import name it
VLLM = "vllm"  # the model directory vLLM serves a ucp checkpoint from (ucp.interop.vllm.source.model_dir)


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, OverflowError):  # (OverflowError: "infGiB")
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB)") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return size


def _number(text: str) -> int:
    """A step or iteration number: a non-negative integer (step_-0000001 is nothing any reader can name)."""
    try:
        number = int(text)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return number


def _step(text: str) -> int | str:
    if text == "latest":
        return text
    try:
        return _number(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer or 'latest', got {text!r}") from None


def _common(p: argparse.ArgumentParser) -> None:
    add_storage_option(p, "fsspec storage option for a ucp URL, e.g. endpoint_url=http://127.0.0.1:9000")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _streaming(p: argparse.ArgumentParser) -> None:
    """The options of every conversion: tensors stream through within a memory budget, many reads and writes at once."""
    p.add_argument("--memory-budget", type=_bytes, help="peak tensor memory (default 4GiB)")
    p.add_argument("--workers", type=_at_least_one, help="parallel reads and writes (default 8)")


def _at_least_one(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _streaming_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The options every converter takes the same way (`_streaming` and `_common` add them to each parser); the
    converters' own defaults where none is given."""
    given = {"memory_budget": args.memory_budget, "workers": args.workers}
    return {
        "storage_options": parse_storage_options(args.storage_option),
        "progress": not args.no_progress,
        **{key: value for key, value in given.items() if value is not None},
    }


def _print_dropped(report: Any) -> None:
    """The line saying what a conversion (ucp.interop.megatron.convert.ConvertReport) did not carry, if anything."""
    if report.dropped:
        print(f"not carried: {', '.join(report.dropped)}")


def cmd_convert(args: argparse.Namespace) -> int:
    from .megatron.convert import ConvertOptions, convert

    check_apart(args.src, args.dst)
    if args.to != UNIVERSAL:  # (Megatron's files: a local directory; a ucp checkpoint goes to any URL)
        local_output(args.dst)
    options = ConvertOptions(
        from_layout=args.from_,
        to_layout=args.to,
        step=args.step,
        iteration=args.iteration,
        vocab_size=args.vocab_size,
        target_ep=args.target_ep,
        target_layout=args.target_layout,
        model_config=args.config,
        **_streaming_kwargs(args),
    )
    report = convert(args.src, args.dst, options)
    written = f"{report.bytes_written / 2**20:.1f} MiB written"
    files = f"{report.files} file{'' if report.files == 1 else 's'}"
    if args.to == UNIVERSAL:  # atoms in a ucp checkpoint: no files to count
        summary = f"{written} to {args.dst}"
    elif args.to == TORCH_DIST:  # one copy of each tensor, however many ranks hold it
        summary = f"{files}, {written}"
    else:
        summary = f"{files}, {written} (a tensor that several ranks hold is in each of their files)"
    print(f"converted {report.atoms} atoms from {args.from_} to {args.to}: {summary}")
    _print_dropped(report)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    check_apart(args.url, args.dir)
    local_output(args.dir)  # (before anything is read)
    if args.to == VLLM:
        from .vllm.source import model_dir

        storage_options = parse_storage_options(args.storage_option)
        where = model_dir(args.url, args.step, dir=args.dir, storage_options=storage_options)
        print(f"wrote {where} for step {_served_step(where)} of {args.url}: vllm serve {where} --load-format ucp")
        return 0
    if args.to == MEGATRON_DIST:
        from .megatron.convert import ConvertOptions, convert

        step = None if args.step == "latest" else args.step
        options = ConvertOptions(from_layout=UNIVERSAL, to_layout=TORCH_DIST, step=step, **_streaming_kwargs(args))
        converted = convert(args.url, args.dir, options)
        print(
            f"wrote {converted.atoms} atoms ({converted.bytes_written / 2**20:.1f} MiB) as Megatron torch_dist to {args.dir}"
        )
        _print_dropped(converted)
        return 0
    if args.to == "hf":
        from .hf import export_hf

        report = export_hf(
            args.url,
            args.dir,
            dtype=args.dtype,
            step=args.step,
            **({} if args.max_shard_size is None else {"max_shard_bytes": args.max_shard_size}),
            **_streaming_kwargs(args),
        )
        print(
            f"wrote {report.tensors} tensors in {report.files} safetensors files "
            f"({report.bytes_written / 2**20:.1f} MiB) to {args.dir}"
        )
    else:
        from .dcp import export_dcp

        dcp_report = export_dcp(
            args.url,
            args.dir,
            dtype=args.dtype,
            step=args.step,
            **_streaming_kwargs(args),
        )
        print(
            f"wrote {dcp_report.tensors} tensors ({dcp_report.bytes_written / 2**20:.1f} MiB) as a DCP checkpoint "
            f"to {args.dir}"
        )
    return 0


def _served_step(model_dir: Any) -> int:
    from .vllm.source import Pointer

    return Pointer.read(model_dir).step


def cmd_import(args: argparse.Namespace) -> int:
    check_apart(args.src, args.url)
    if args.from_ == MEGATRON_DIST:
        from .megatron.convert import ConvertOptions, convert

        options = ConvertOptions(
            from_layout=TORCH_DIST,
            to_layout=UNIVERSAL,
            step=args.step,
            model_config=args.config,
            **_streaming_kwargs(args),
        )
        converted = convert(args.src, args.url, options)
        print(f"imported {converted.atoms} atoms ({converted.bytes_written / 2**20:.1f} MiB) into {args.url}")
        _print_dropped(converted)
        return 0
    step = 0 if args.step is None else args.step
    if args.from_ == "hf":
        from .hf import import_hf

        report: Any = import_hf(
            args.src,
            args.url,
            step=step,
            dtype=args.dtype,
            **_streaming_kwargs(args),
        )
    else:
        from .dcp import import_dcp

        report = import_dcp(
            args.src,
            args.url,
            config=args.config,
            step=step,
            dtype=args.dtype,
            **_streaming_kwargs(args),
        )
    print(f"imported {report.atoms} atoms ({report.bytes_read / 2**20:.1f} MiB) as step {report.step} of {args.url}")
    return 0


def register(subparsers: Any) -> None:
    """Add `convert`, `export` and `import` to an argparse subparsers object."""
    p = subparsers.add_parser(
        "convert", help="reshard a Megatron-LM checkpoint (torch or torch_dist format), or convert it to/from ucp"
    )
    p.add_argument(
        "src",
        help="Megatron checkpoint directory (holds latest_checkpointed_iteration.txt) or one of its iter_NNNNNNN "
        "directories, or a ucp URL",
    )
    p.add_argument("dst", help="output directory, or a ucp URL with --to universal")
    p.add_argument(
        "--from",
        dest="from_",
        required=True,
        metavar="LAYOUT",
        help="layout of SRC's torch-format rank files (e.g. tp8pp4, tp2ep2), 'torch_dist' (Megatron's "
        "dist_checkpointing format: no layout needed) or 'universal' (a ucp checkpoint)",
    )
    p.add_argument(
        "--to",
        required=True,
        metavar="LAYOUT",
        help="layout of the torch-format rank files to write (e.g. tp4pp8), 'torch_dist' or 'universal'",
    )
    p.add_argument(
        "--vocab-size",
        type=_at_least_one,
        default=None,
        help="true vocabulary size, when the Megatron args only know the padded one",
    )
    p.add_argument(
        "--target-ep",
        type=int,
        default=None,
        metavar="N",
        help="with --to torch_dist: the expert-parallel size of the job that will load it, whose distributed "
        "optimizer entry differs with EP > 1 (a dense and an expert optimizer) (default: as the source was saved)",
    )
    p.add_argument(
        "--target-layout",
        default=None,
        metavar="LAYOUT",
        help="with --to torch_dist: the layout (tp{T}[pp{P}][vpp{V}][ep{E}]) of the job that will load it; its "
        "distributed optimizer is then written in Megatron-LM's default form (dp_reshardable) for that layout, "
        "which loads with any DP (default: a form any layout loads, fully_reshardable)",
    )
    p.add_argument("--iteration", type=_number, default=None, help="Megatron iteration to read (default: the latest)")
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="with --from torch_dist saved without Megatron-LM's args: the model's shape, as its Hugging Face "
        "config.json or a JSON object of the job's Megatron-LM arguments",
    )
    p.add_argument(
        "--step", type=_number, default=None, help="ucp step to write or read (default: the iteration / latest)"
    )
    _streaming(p)
    _common(p)
    megatron_source = "with a Megatron source (--from LAYOUT or torch_dist)"
    p.set_defaults(
        func=cmd_convert,
        context=lambda args: f"--from {args.from_} --to {args.to}",
        rules=(
            Applies("--iteration", "iteration", lambda args: args.from_ != UNIVERSAL, megatron_source),
            Applies("--vocab-size", "vocab_size", lambda args: args.from_ != UNIVERSAL, megatron_source),
            Applies(
                "--step",
                "step",
                lambda args: UNIVERSAL in (args.from_, args.to),
                "with --from universal or --to universal (the ucp step to read or write; a Megatron checkpoint "
                "keeps its iteration)",
            ),
            Applies("--target-ep", "target_ep", lambda args: args.to == TORCH_DIST, "with --to torch_dist"),
            Applies("--target-layout", "target_layout", lambda args: args.to == TORCH_DIST, "with --to torch_dist"),
            Applies(
                "--config",
                "config",
                lambda args: args.from_ == TORCH_DIST,
                "with --from torch_dist (a save without Megatron-LM's args)",
            ),
            storage_option_applies(
                lambda args: args.src if args.from_ == UNIVERSAL else None,
                lambda args: args.dst if args.to == UNIVERSAL else None,
            ),
        ),
    )

    p = subparsers.add_parser("export", help="write a ucp checkpoint in another framework's format")
    p.add_argument("url", help="ucp checkpoint root (local path, s3://...) or a step directory")
    p.add_argument(
        "--to",
        required=True,
        choices=("hf", "dcp", MEGATRON_DIST, VLLM),
        help="hf: Hugging Face safetensors; dcp: torch DCP; megatron-dist: Megatron-LM's torch_dist format "
        "(as `ucp convert URL DIR --from universal --to torch_dist`); vllm: the directory `vllm serve DIR "
        "--load-format ucp` starts from (config.json and the checkpoint's URL and step; the weights are read from "
        "URL when the engine starts)",
    )
    p.add_argument("dir", help="output directory (must not exist, or be empty; not inside the checkpoint)")
    p.add_argument("--dtype", default=None, help="cast parameters: bf16, fp16, fp32 (default: as stored)")
    p.add_argument("--step", type=_step, default="latest", help="step to export (default: latest)")
    p.add_argument("--max-shard-size", type=_bytes, help="with --to hf: the largest safetensors file (default 1GiB)")
    _streaming(p)
    _common(p)
    p.set_defaults(
        func=cmd_export,
        context=lambda args: f"--to {args.to}",
        rules=(
            Applies(
                "--dtype",
                "dtype",
                lambda args: args.to in ("hf", "dcp"),
                "with --to hf or dcp (a Megatron torch_dist checkpoint is written in the stored dtypes; vLLM's "
                "engine casts as its own --dtype says)",
            ),
            Applies("--max-shard-size", "max_shard_size", lambda args: args.to == "hf", "with --to hf"),
            Applies(
                "--memory-budget",
                "memory_budget",
                lambda args: args.to != VLLM,
                "with --to hf, dcp or megatron-dist (--to vllm writes no tensors)",
            ),
            Applies(
                "--workers",
                "workers",
                lambda args: args.to != VLLM,
                "with --to hf, dcp or megatron-dist (--to vllm writes no tensors)",
            ),
            Applies(
                "--no-progress",
                "no_progress",
                lambda args: args.to != VLLM,
                "with --to hf, dcp or megatron-dist (--to vllm writes no tensors)",
            ),
            storage_option_applies(lambda args: args.url),
        ),
    )

    p = subparsers.add_parser("import", help="turn another framework's checkpoint into a ucp checkpoint")
    p.add_argument("src", help="Hugging Face directory (config.json + safetensors) or DCP directory")
    p.add_argument("url", help="ucp checkpoint root to write")
    p.add_argument(
        "--from",
        dest="from_",
        choices=("hf", "dcp", MEGATRON_DIST),
        default="hf",
        metavar="FORMAT",
        help="hf, dcp or megatron-dist (Megatron-LM's torch_dist, as `ucp convert SRC URL --from torch_dist --to "
        "universal`) (default hf)",
    )
    p.add_argument(
        "--step", type=_number, default=None, help="step number to write (default 0; megatron-dist: the iteration)"
    )
    p.add_argument(
        "--dtype", default=None, help="with --from hf or dcp: cast parameters: bf16, fp16, fp32 (default: as stored)"
    )
    p.add_argument(
        "--config",
        default=None,
        help="with --from dcp: the model's Hugging Face config.json (default: SRC/config.json); with --from "
        "megatron-dist saved without Megatron-LM's args: its Hugging Face config.json or a JSON object of the job's "
        "Megatron-LM arguments",
    )
    _streaming(p)
    _common(p)
    p.set_defaults(
        func=cmd_import,
        context=lambda args: f"--from {args.from_}",
        rules=(
            Applies(
                "--dtype",
                "dtype",
                lambda args: args.from_ != MEGATRON_DIST,
                "with --from hf or dcp (a Megatron torch_dist checkpoint is imported as stored)",
            ),
            Applies(
                "--config",
                "config",
                lambda args: args.from_ in ("dcp", MEGATRON_DIST),
                "with --from dcp or megatron-dist",
            ),
            storage_option_applies(lambda args: args.url),
        ),
    )
