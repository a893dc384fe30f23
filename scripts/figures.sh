#!/usr/bin/env bash
# Re-make every figure in docs/BENCHMARKS.md, one after another (run it on a quiet machine: ~30 minutes on 2 cores).
# Results go to docs/figures/ (JSON and PNG); the tables in BENCHMARKS.md are copied from what this prints.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/figures
mkdir -p "$out"
# Format v1 and the async data path: 1 GiB state, tmpfs and local disk, every method side by side (issues 2, 5).
python -m bench_io --size 1GiB --repeats 3 --targets tmpfs,disk \
    --methods raw,raw-crc,ucp,ucp-async,ucp-async-threads,torch,safetensors,dcp,dcp-async,copy \
    --json "$out/io-1gib.json" --png "$out/io-1gib.png" | tee "$out/io-1gib.txt"
# The ratios of issue 15: fewer methods, more repeats, and raw-objects (the format's objects written raw: its floor).
python -m bench_io --size 1GiB --repeats 5 --targets tmpfs --methods raw,raw-crc,raw-objects,ucp,safetensors,dcp \
    --small-tensors 0 --json "$out/io-tmpfs-5x.json" | tee "$out/io-tmpfs-5x.txt"
python -m bench_io --size 1GiB --repeats 3 --targets disk --methods raw,raw-crc,raw-objects,ucp,safetensors,dcp \
    --small-tensors 0 --json "$out/io-disk.json" | tee "$out/io-disk.txt"
# 20,000 small tensors against the same bytes in 4, on tmpfs and the disk.
python -m bench_io --size 64MiB --repeats 3 --targets tmpfs,disk --methods raw --small-tensors 20000 \
    --small-methods raw,raw-objects,ucp --json "$out/io-small.json" | tee "$out/io-small.txt"
python scripts/durability_probe.py --files 20000 --bytes 15500 --dir /var/tmp | tee "$out/durability.txt"
# The same against an S3 server (embedded moto on 127.0.0.1: per-request cost, not a real store's bandwidth).
python -m bench_io --size 256MiB --repeats 3 --targets s3 --small-tensors 0 --io-threads 64 \
    --methods raw,ucp,ucp-async,ucp-async-threads,torch,safetensors,dcp,dcp-async,copy \
    --json "$out/io-s3.json" --png "$out/io-s3.png" | tee "$out/io-s3.txt"
python -m bench_io --size 256MiB --repeats 3 --targets s3 --small-tensors 0 --io-threads 64 \
    --methods raw,raw-objects,ucp --json "$out/io-s3-objects.json" | tee "$out/io-s3-objects.txt"
# Resharding at load: a >= 2 GiB Mixtral-shaped state (the model is sized down to whole heads: ask a little more) saved as tp2pp2dp2zero1, loaded in other layouts (issue 3).
python -m bench_io reshard --size 2200MiB --json "$out/reshard-2gib.json" | tee "$out/reshard-2gib.txt"
# Async blocking time against a plain copy, alone on a quiet machine (issue 5).
python scripts/async_blocking.py | tee "$out/async-blocking.txt"
# Writer threads against a writer process (issue 5).
python -m bench_io gil --size 256MiB --repeats 2 --json "$out/gil.json" | tee "$out/gil.txt"
# Token loaders on object storage: an epoch of rank 0 of dp 8 on moto and radosgw beside MosaicML Streaming (needs
# mosaicml-streaming installed), then the first 100 batches, then what one ranged GET costs (issue 40.3).
python -m bench_io.dataloader_bench --size-mb 256 --targets moto,radosgw --repeats 5 --out "$out/dataloader-s3.json" \
    | tee "$out/dataloader-s3.txt"
python -m bench_io.dataloader_bench --size-mb 256 --targets moto,radosgw --repeats 5 --batches 100 \
    --loaders ucp,streaming --out "$out/dataloader-s3-100.json" | tee -a "$out/dataloader-s3.txt"
python -m bench_io.dataloader_bench --probe-ranges | tee -a "$out/dataloader-s3.txt"
# The trainer: checkpoint overhead, blocking time, time to the first step after a resume (issue 7).
python scripts/trainer_bench.py --out "$out/trainer.json" | tee "$out/trainer.txt"
# Weights-only cold start of an SFT/RL job against safetensors, local and S3 (issue 6).
python -m bench_io coldstart --size-gib 1 --s3 --repeats 5 | tee "$out/coldstart.txt"
# Elastic recovery: kill -> first new step from the hot tier, disk and S3, and the cost of a checkpoint every step (issue 12).
python scripts/recovery_bench.py --size-gib 1 --tiers hot,disk,s3 --overhead-steps 4 --overhead-target s3 \
    --json "$out/recovery-1gib.json" | tee "$out/recovery-1gib.txt"
