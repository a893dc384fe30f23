"""`ucp bench` against remote storage as users meet it: every way the S3 target can be wrong (no credentials, wrong
credentials, a missing bucket, an unreachable endpoint, an HTTP server that is not S3) is one line and a non-zero
exit before anything is measured, and leaves the store as it was; a run that works leaves nothing outside its own
prefix (no method creates a bucket), and a run with nothing to measure exits non-zero."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import moto_only
from .launch import free_port
from .test_s3_errors import no_aws_environment, one_line

REPO = Path(__file__).resolve().parents[1]


def bench(*args: str, env: dict[str, str] | None = None, timeout: int = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ucp", "bench", "--quick", "--size", "1MiB", "--targets", "s3", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def store(options: dict[str, str]) -> dict[str, list[str]]:
    """Every bucket of the server with every key in it."""
    import s3fs

    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True, use_listings_cache=False)
    return {bucket: sorted(fs.find(bucket)) for bucket in sorted(fs.ls(""))}


@pytest.fixture
def not_s3() -> Iterator[str]:
    """An HTTP server on loopback that is not S3 (Python's file server, serving an empty directory)."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@moto_only  # (it lists every bucket of the server: on the run's shared radosgw, others make them)
def test_no_credentials(s3_bucket):
    bucket, options = s3_bucket
    before = store(options)
    result = bench("--endpoint-url", options["endpoint_url"], "--bucket", bucket, env=no_aws_environment())
    one_line(result, f"s3://{bucket}/bench_io-", "found none", "AWS_ACCESS_KEY_ID")
    assert store(options) == before


def test_wrong_credentials(moto_auth_server):
    wrong = ["-o", f"key={moto_auth_server['key']}", "-o", "secret=not-the-secret"]
    before = store(moto_auth_server)
    result = bench("--endpoint-url", moto_auth_server["endpoint_url"], "--bucket", "secured", *wrong)
    one_line(result, "s3://secured/bench_io-", "refused the credentials")
    assert "0 measurements" not in result.stderr
    assert store(moto_auth_server) == before


@moto_only
def test_a_missing_bucket_is_named_and_not_created(s3_bucket):
    _, options = s3_bucket
    before = store(options)
    args = ["--endpoint-url", options["endpoint_url"], "--bucket", "no-such-bucket", "--methods", "raw,ucp,dcp"]
    result = bench(*args, "-o", "key=testing", "-o", "secret=testing")
    one_line(result, "no-such-bucket", "does not exist")
    assert store(options) == before  # (dcp's writer used to create it)


@moto_only
def test_an_endpoint_without_a_bucket_is_refused(s3_bucket):
    _, options = s3_bucket
    before = store(options)
    one_line(bench("--endpoint-url", options["endpoint_url"]), "--bucket", "existing bucket")
    assert store(options) == before


def test_an_unreachable_endpoint():
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = bench("--endpoint-url", endpoint, "--bucket", "b", "-o", "key=k", "-o", "secret=s", timeout=120)
    one_line(result, endpoint, "cannot be reached")


def test_an_http_server_that_is_not_s3(not_s3):
    result = bench("--endpoint-url", not_s3, "--bucket", "bucket", "-o", "key=k", "-o", "secret=s")
    one_line(result, not_s3, "is not an S3 endpoint")
    assert "does not exist" not in result.stderr


@pytest.mark.slow  # (a whole run, six methods: tens of seconds)
@moto_only
def test_a_run_leaves_nothing_outside_its_prefix_and_its_columns_agree(s3_bucket, tmp_path):
    bucket, options = s3_bucket
    before = store(options)
    out = tmp_path / "r.json"
    args = ["--endpoint-url", options["endpoint_url"], "--bucket", bucket, "--small-tensors", "0", "--json", str(out)]
    options_given = ["-o", "key=testing", "-o", "secret=testing", "-o", "single_writer=true"]  # (ucp's own: not s3fs's)
    result = bench(*args, "--methods", "raw,ucp,ucp-async,dcp,dcp-async,copy", *options_given)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "by the probes" in result.stderr  # (how long it will take, said before it starts)
    assert store(options) == before  # every method's objects removed, no bucket made
    assert "secret=testing" not in out.read_text()  # (the results keep the options' names, not credentials)
    for m in json.loads(out.read_text())["medians"]:
        if m["blocking_vs_copy"] is not None:  # the ratio is the one of the two columns beside it
            assert m["blocking_vs_copy"] == pytest.approx(m["blocking_s"] / m["copy_s"]), m


def test_a_run_with_nothing_to_measure_fails():
    result = bench("--methods", "raw-crc")  # (raw-crc has no S3 support; the embedded server)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("ucp: error: nothing to measure: no method of --methods")


@pytest.mark.slow
def test_a_radosgw_daemon_that_dies_while_serving_is_named_with_its_exit_status():
    import os
    import signal

    from bench_io.s3_servers import Radosgw, radosgw_missing

    if (missing := radosgw_missing()) is not None:
        pytest.skip(missing)
    with Radosgw() as server:
        assert server.exited() is None
        os.kill(server.pids["radosgw"], signal.SIGKILL)
        server.procs["radosgw"].wait(30)
        gone = server.exited()
        assert gone is not None and gone.startswith("radosgw exited with -9"), gone
    assert not server.dir.exists()


def test_the_stale_cluster_sweep_removes_only_dead_clusters(tmp_path, monkeypatch):
    """A new Radosgw sweeps the directories of clusters whose starter was killed; it must leave a live cluster and
    anything that is not a cluster alone: the test run's keeper directory (old, with no pid files) once went, and
    the shared cluster with it mid-run (its keeper could no longer take its lock)."""
    import os
    import tempfile
    import time

    from bench_io.s3_servers import CLUSTER_PREFIX, STALE_AFTER_S, remove_stale_clusters

    from .radosgw import CLIENTS, run_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    def cluster(name: str, pid: str | None) -> Path:
        path = tmp_path / f"{CLUSTER_PREFIX}{name}"
        (path / "run").mkdir(parents=True)
        (path / "ceph.conf").write_text("[global]\n")
        if pid is not None:
            (path / "run" / "mon.a.pid").write_text(f"{pid}\n")
        return path

    keeper = run_dir()
    (keeper / CLIENTS).mkdir(parents=True)
    (keeper / "lock").touch()
    not_ours = tmp_path / f"{CLUSTER_PREFIX}notes"  # (a name alike, no ceph.conf)
    not_ours.mkdir()
    dead, alive, young = cluster("dead", dead_pid), cluster("alive", str(os.getpid())), cluster("young", dead_pid)
    stale = time.time() - STALE_AFTER_S - 60
    for path in (keeper, not_ours, dead, alive):
        os.utime(path, (stale, stale))
    remove_stale_clusters(tmp_path)
    assert keeper.exists() and not_ours.exists() and alive.exists() and young.exists()
    assert not dead.exists()
