"""Client CPU per GiB that checksums cost on S3: botocore's defaults (a CRC-32 of every byte put, in zlib, and a
check of every whole-object GET) against what ucp does (its own CRC-32C as the put's checksum, no check on GET:
ucp checks every byte it reads against its own CRC-32C). Against moto's server on 127.0.0.1; CPU time of this
process (user + system), medians of `--repeats`.

    python scripts/s3_checksums.py [--mib-per-object 8] [--objects 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import sys
from pathlib import Path

import boto3
import crc32c
from botocore.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_io.s3_servers import MotoServer


def cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib-per-object", type=int, default=8)
    ap.add_argument("--objects", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    data = os.urandom(args.mib_per_object << 20)
    gib = args.objects * len(data) / 2**30
    server = MotoServer()
    try:
        ways = {
            "botocore defaults": ({}, lambda body: {}),
            "ucp (CRC-32C put, no GET check)": (
                {"response_checksum_validation": "when_required"},
                lambda body: {
                    "ChecksumAlgorithm": "CRC32C",
                    "ChecksumCRC32C": base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode(),
                },
            ),
        }
        results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in ways}
        for r in range(args.repeats):
            for w, (name, (config, extra)) in enumerate(ways.items()):
                client = boto3.client(
                    "s3",
                    endpoint_url=server.url,
                    aws_access_key_id="bench",
                    aws_secret_access_key="bench",
                    region_name="us-east-1",
                    config=Config(**config),
                )
                bucket = f"checksums-{r}-{w}"
                client.create_bucket(Bucket=bucket)
                start = cpu()
                for i in range(args.objects):
                    client.put_object(Bucket=bucket, Key=str(i), Body=data, **extra(data))
                put = cpu() - start
                start = cpu()
                for i in range(args.objects):
                    client.get_object(Bucket=bucket, Key=str(i), ChecksumMode="ENABLED")["Body"].read()
                get = cpu() - start
                results[name][0].append(put / gib)
                results[name][1].append(get / gib)
        print(
            f"{args.objects} objects of {args.mib_per_object} MiB, {args.repeats} repeats, CPU-seconds per GiB (median)"
        )
        base_put, base_get = (statistics.median(v) for v in results["botocore defaults"])
        for name, (puts, gets) in results.items():
            put, get = statistics.median(puts), statistics.median(gets)
            print(f"  {name:34s} put {put:.3f}  get {get:.3f}  ({put / base_put:.2f}x / {get / base_get:.2f}x)")
    finally:
        server.close()


if __name__ == "__main__":
    main()
