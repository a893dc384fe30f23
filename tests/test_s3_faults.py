"""An object store that refuses writes: after s3fs's and botocore's retries, a save fails with a StorageError that
names the step (not s3fs's bare OSError 121), removes what its attempt wrote, and leaves the committed steps alone.
A proxy in front of the S3 server (moto) answers 503 SlowDown to every PUT of a chunk object."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
import torch

import ucp
from ucp.format import step_dirname
from ucp.storage import open_storage

from .helpers import assert_same_state


class RefusingProxy(BaseHTTPRequestHandler):
    upstream: str = ""
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.command == "PUT" and "/c." in self.path:
            payload = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        target = urlsplit(self.upstream)
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(self.command, self.path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        self.send_response(response.status)
        for k, v in response.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _forward

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def refusing_endpoint(s3_server):
    handler = type("Handler", (RefusingProxy,), {"upstream": s3_server})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_a_store_that_refuses_writes_fails_the_save_naming_the_step(s3_bucket, refusing_endpoint):
    bucket, options = s3_bucket
    url = f"s3://{bucket}/refused"
    state = {"model": {"w": torch.randn(64, 64)}}
    ucp.save(state, url, step=1, storage_options=options)
    refused = {
        **options,
        "endpoint_url": refusing_endpoint,
        "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 10},
    }
    with pytest.raises(ucp.StorageError) as failure:
        ucp.save({"model": {"w": torch.randn(64, 64)}}, url, step=2, storage_options=refused)
    message = str(failure.value)
    assert "step 2 was not saved" in message and f"{step_dirname(2)}/attempt-" in message and "\n" not in message, (
        message
    )
    assert ucp.CheckpointManager(url, storage_options=options).steps() == [1]
    assert open_storage(url, options).listdir(step_dirname(2)) == [], "the failed attempt was not removed"
    assert_same_state(state, ucp.load(url, storage_options=options))
