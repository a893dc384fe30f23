"""S3 through s3fs, against a real S3 server (moto) on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys

import torch

import ucp

from .helpers import assert_same_state
from .test_format import SMALL_CHUNKS, every_dtype_state


def test_save_load_with_storage_options(s3_bucket):
    bucket, options = s3_bucket
    state = every_dtype_state()
    url = f"s3://{bucket}/run1"
    ucp.save(state, url, step=5, storage_options=options, options=SMALL_CHUNKS)
    assert_same_state(dict(state, tuple=[1, 2, 3]), ucp.load(url, storage_options=options))


def test_environment_variables_are_enough(s3_bucket):
    bucket, _ = s3_bucket  # the fixture set AWS_ENDPOINT_URL and the credentials
    url = f"s3://{bucket}/env"
    ucp.save({"w": torch.arange(10.0)}, url)
    assert torch.equal(ucp.load(url)["w"], torch.arange(10.0))


def test_manager_on_s3(s3_bucket):
    bucket, options = s3_bucket
    manager = ucp.CheckpointManager(f"s3://{bucket}/managed", keep_last=2, storage_options=options)
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((4,), float(step))})
    assert manager.steps() == [2, 3]
    assert torch.equal(manager.restore()["w"], torch.full((4,), 3.0))


def test_cli_inspect_and_verify_on_s3(s3_bucket):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/cli"
    ucp.save({"model": {"w": torch.ones(3, 3)}}, url, storage_options=options)
    args = ["-o", f"endpoint_url={options['endpoint_url']}"]
    out = subprocess.run(
        [sys.executable, "-m", "ucp", "inspect", url, *args], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "model/w" in out.stdout and "3x3" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "ucp", "verify", url, *args], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and ": ok" in out.stdout


def test_every_object_is_put_with_its_crc32c_and_read_without_a_second_check(s3_bucket):
    """Each put carries the object's CRC-32C (S3 checks the upload and keeps it; botocore adds no CRC-32 of its
    own), and botocore does not check whole-object checksums on reads (ucp checks every byte itself)."""
    import base64

    import boto3
    import crc32c

    from ucp.storage import open_storage

    bucket, options = s3_bucket
    url = f"s3://{bucket}/sums"
    ucp.save({"w": torch.randn(300, 70), "b": torch.arange(5)}, url, step=1, storage_options=options)
    client = boto3.client("s3", endpoint_url=options["endpoint_url"])
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="sums/")["Contents"]]
    assert len(keys) > 5
    for key in keys:
        head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert head.get("ChecksumCRC32C") == base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode(), key
        assert "ChecksumCRC32" not in head, key  # (botocore computed no checksum of its own)
    storage = open_storage(url, options)
    assert storage.fs.config_kwargs["response_checksum_validation"] == "when_required"
    assert torch.equal(ucp.load(url, storage_options=options)["b"], torch.arange(5))


def test_an_s3_store_declares_whole_object_reads_exclusive_creates_and_a_writer_process(s3_bucket):
    from ucp.storage import FSSPEC_IO_THREADS, Capabilities, open_storage

    bucket, options = s3_bucket
    assert open_storage(f"s3://{bucket}/caps", options).capabilities == Capabilities(
        io_threads=FSSPEC_IO_THREADS, whole_object_reads=True, exclusive_creates=True, writer_process=True
    )
