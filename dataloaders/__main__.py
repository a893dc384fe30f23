"""``python -m dataloaders prepare INPUT... --out URL``: tokenize text / JSONL (or take token ids: ``--tokenized``)
into MMIDIDX shards.
``python -m dataloaders info URL``: print a dataset's manifest."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import DataLoaderError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dataloaders", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize text files or JSONL (or take token ids) into MMIDIDX shards")
    p.add_argument(
        "inputs", nargs="+",
        help="text files (one document each) or .jsonl/.json files (JSON Lines: one per line); with --tokenized, "
        ".jsonl files of integer lists (or objects whose --text-key field is one) and .npy integer arrays (a "
        "document per row)",
    )  # fmt: skip
    p.add_argument("--out", required=True, help="output directory URL (local path, s3://bucket/prefix, ...)")
    p.add_argument("--tokenizer", default="byte", help="'byte' (default) or the path of a tokenizer.json")
    p.add_argument("--tokenized", action="store_true", help="the inputs are token ids already (no tokenizer)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="with --tokenized: ids must be below it (default: the largest id + 1)")  # fmt: skip
    p.add_argument("--eos-id", type=int, default=None, help="with --tokenized: append this id to each document")
    p.add_argument("--text-key", default="text", help="JSONL field holding the text (default: text)")
    p.add_argument("--shard-tokens", type=int, default=None, help="start a new shard after this many tokens")
    p.add_argument("--no-eos", action="store_true", help="do not append the end-of-document token")
    p.add_argument("--storage-options", default="{}", help="JSON dict of fsspec storage options")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    i = sub.add_parser("info", help="print the manifest of a dataset (directory or shard prefixes)")
    i.add_argument("sources", nargs="+")
    i.add_argument("--storage-options", default="{}")
    i.add_argument("--verify", action="store_true",
                   help="read every shard's .bin and check it against the CRC-32C its manifest recorded")  # fmt: skip
    args = parser.parse_args(argv)
    if args.cmd == "prepare":
        if args.tokenized and args.tokenizer != "byte":
            parser.error("--tokenized inputs are token ids already: they take no --tokenizer")
        if not args.tokenized and (args.vocab_size is not None or args.eos_id is not None):
            parser.error("--vocab-size and --eos-id go with --tokenized")
    try:
        opts = json.loads(args.storage_options)
    except (ValueError, RecursionError) as e:
        print(f"error: --storage-options is not JSON: {str(e)[:200]}", file=sys.stderr)
        return 2
    if not isinstance(opts, dict):
        print(f"error: --storage-options must be a JSON object, got {args.storage_options[:80]!r}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "prepare":
            from .tokenize import DEFAULT_SHARD_TOKENS, TokenIds, load_tokenizer, prepare

            res = prepare(
                args.inputs,
                args.out,
                TokenIds(args.vocab_size, args.eos_id) if args.tokenized else load_tokenizer(args.tokenizer),
                text_key=args.text_key,
                shard_tokens=DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
                append_eos=not args.no_eos,
                storage_options=opts,
                progress=not args.quiet,
            )
            m = res.manifest
            print(
                f"wrote {len(m.shards)} shard(s), {res.num_documents} documents, {m.num_tokens} tokens "
                f"to {res.out} (manifest {m.hash})"
            )
        else:
            from .corpus import open_corpus

            corpus = open_corpus(args.sources, opts)
            if args.verify:
                n = corpus.verify()
                print(f"verified {n} of {len(corpus.shards)} shard(s) against their CRC-32C", file=sys.stderr)
            print(json.dumps(corpus.manifest.to_json(), indent=1))
    except DataLoaderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
