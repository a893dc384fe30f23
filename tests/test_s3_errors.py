"""S3 failures as users meet them, against each S3 server (moto and radosgw): each is one UcpError subclass that names the URL and the
cause (the original exception as its cause), one line from the CLI with a non-zero exit, and nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import ucp
from ucp.errors import BucketNotFoundError, StorageAuthError, StorageUnreachableError

from .launch import free_port


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ucp", *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def one_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("ucp: error: "), result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def no_aws_environment() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return env | {
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def test_a_wrong_secret(auth_server, monkeypatch):
    options, bucket = auth_server
    url = f"s3://{bucket}/run"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    ucp.save({"w": torch.ones(4)}, url, storage_options=options)
    wrong = {**options, "secret": "not-the-secret"}
    with pytest.raises(StorageAuthError, match=f"{url}.*refused the credentials") as failure:
        ucp.load(url, storage_options=wrong)
    assert failure.value.__cause__ is not None
    with pytest.raises(StorageAuthError):
        ucp.save({"w": torch.zeros(4)}, url, step=9, storage_options=wrong)
    assert ucp.CheckpointManager(url, storage_options=options).steps() == [0]
    one_line(
        cli(
            "inspect",
            url,
            "-o",
            f"endpoint_url={options['endpoint_url']}",
            "-o",
            f"key={options['key']}",
            "-o",
            "secret=not-the-secret",
        ),
        url,
        "refused the credentials",
    )


def test_no_credentials_at_all(auth_server):
    options, bucket = auth_server
    env = no_aws_environment()
    one_line(
        cli("inspect", f"s3://{bucket}/run", "-o", f"endpoint_url={options['endpoint_url']}", env=env),
        f"s3://{bucket}/run",
        "found none",
        "AWS_ACCESS_KEY_ID",
    )


def test_a_missing_bucket(s3_bucket):
    _, options = s3_bucket
    with pytest.raises(BucketNotFoundError, match="'no-such-bucket' does not exist"):
        ucp.load("s3://no-such-bucket/run", storage_options=options)
    with pytest.raises(BucketNotFoundError, match="bucket does not exist"):
        ucp.save({"w": torch.ones(2)}, "s3://no-such-bucket/run", storage_options=options)
    one_line(
        cli("inspect", "s3://no-such-bucket/run", "-o", f"endpoint_url={options['endpoint_url']}"),
        "no-such-bucket",
        "does not exist",
    )


def test_an_unreachable_endpoint(s3_bucket):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(StorageUnreachableError, match="cannot be reached, after the client's retries"):
        ucp.load("s3://bucket/run", storage_options={"endpoint_url": endpoint, "key": "k", "secret": "s"})
    assert time.monotonic() - start < 60
    one_line(cli("inspect", "s3://bucket/run", "-o", f"endpoint_url={endpoint}"), endpoint, "cannot be reached")


def test_verbose_shows_the_traceback_and_a_closed_pipe_is_quiet(tmp_path):
    out = cli("-v", "inspect", str(tmp_path / "nothing"))
    assert out.returncode == 1 and "Traceback" in out.stderr and out.stderr.startswith("ucp: error: ")
    ucp.save({"model": {f"w{i}": torch.ones(2) for i in range(200)}}, str(tmp_path / "ckpt"))
    pipe = subprocess.run(
        f"{sys.executable} -m ucp inspect {tmp_path / 'ckpt'} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert pipe.stdout.startswith("checkpoint") and "Traceback" not in pipe.stderr and "Error" not in pipe.stderr, (
        pipe.stderr
    )
