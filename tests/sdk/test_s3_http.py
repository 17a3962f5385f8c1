"""The lean S3 read path (silod.data.s3_http) behind ObjectStore: signatures identical to
botocore's, verified reads against a real S3-protocol server (moto), in forked children too,
and the failure mapping (missing, changed, transient) that the cache server relies on."""

from __future__ import annotations

import datetime
import http.server
import os
import select
import signal
import threading
from collections.abc import Iterator
from unittest import mock

import pytest

from silod.data import s3_http
from silod.data.store import ObjectChanged, ObjectMissing, ObjectStore, StoreError
from tests.cache_server.harness import moto_s3


def test_signature_is_botocores() -> None:
    import botocore.auth
    import botocore.config
    import botocore.credentials
    from botocore.awsrequest import AWSRequest

    creds = botocore.credentials.Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "session")
    now = datetime.datetime(2026, 11, 25, 12, 0, 0, tzinfo=datetime.timezone.utc)
    client = s3_http.S3Http("https://s3.example.com:8443/base", "eu-west-1")
    client._credentials = creds
    path = "/base/bucket/shards/a%20b/k~1.tar"
    mine = client._sign("GET", path, now)
    reference = AWSRequest(method="GET", url="https://s3.example.com:8443" + path)
    reference.context["client_config"] = botocore.config.Config(s3={"payload_signing_enabled": False})
    with mock.patch.object(botocore.auth, "get_current_datetime", return_value=now.replace(tzinfo=None)):
        botocore.auth.S3SigV4Auth(creds, "s3", "eu-west-1").add_auth(reference)
    assert mine["Authorization"] == reference.headers["Authorization"]
    assert mine["x-amz-security-token"] == "session"


@pytest.fixture(scope="module")
def bucket() -> Iterator[str]:
    import boto3

    with moto_s3() as endpoint:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="lean")
        s3.put_object(Bucket="lean", Key="data/one two.tar", Body=bytes(range(256)) * 40)
        yield endpoint


def test_verified_reads_through_the_lean_client(bucket: str) -> None:
    store = ObjectStore("s3://lean/data", {"endpoint_url": bucket})
    assert store.lean
    body = bytes(range(256)) * 40
    etag = store.current_tag("one two.tar")
    assert store.read("one two.tar", len(body), etag) == body
    # A sample of a shard: a ranged GET carrying If-Match.
    assert store.read("one two.tar#000000000300+100:s", 100, etag) == body[300:400]
    with pytest.raises(ObjectChanged, match=etag):
        store.read("one two.tar", len(body), "0123456789abcdef0123456789abcdef")
    with pytest.raises(ObjectMissing, match="absent.bin"):
        store.read("absent.bin")


def test_a_forked_child_reads_after_its_parent_did(bucket: str) -> None:
    """DataLoader workers are forked from the process that may already have read: the lean client
    must work there (obstore, whose tokio runtime hangs in such a child, was rejected for this)."""
    store = ObjectStore("s3://lean/data", {"endpoint_url": bucket})
    etag = store.current_tag("one two.tar")
    body = bytes(range(256)) * 40
    assert store.read("one two.tar", len(body), etag) == body
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the bytes read (or the error) through the pipe, nothing else
        try:
            os.close(reader)
            data = store.read("one two.tar#000000000300+100:s", 100, etag)
            os.write(writer, b"ok" if data == body[300:400] else b"wrong bytes")
        except BaseException as exc:  # noqa: BLE001 -- any failure must reach the parent
            os.write(writer, repr(exc).encode()[:500])
        finally:
            os._exit(0)
    os.close(writer)
    try:
        ready, _, _ = select.select([reader], [], [], 30)
        answer = os.read(reader, 1000) if ready else b"the child hung for 30 s"
    finally:
        os.close(reader)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert answer == b"ok"
    assert store.read("one two.tar", len(body), etag) == body  # and the parent still reads


def test_other_storage_options_keep_s3fs() -> None:
    assert not ObjectStore("s3://b/p", {"endpoint_url": "http://127.0.0.1:1", "anon": "true"}).lean
    assert not ObjectStore("s3://b/p", {"region": "eu-west-1"}).lean  # AWS itself: s3fs finds the endpoint


class _Flaky(http.server.BaseHTTPRequestHandler):
    """503 SlowDown for the first request, then the object; 403 for keys under ``denied/``."""

    calls = 0
    hang_up = False  # close the connection after the answer, although HTTP/1.1 keeps it alive
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_GET(self) -> None:  # noqa: N802 -- http.server's naming
        type(self).calls += 1
        if self.path.startswith("/b/denied/"):
            self._send(403, b"<Error><Code>AccessDenied</Code><Message>no</Message></Error>")
        elif self.path.startswith("/b/chunked/"):  # a body in chunks, then the end of the connection
            self.send_response(200)
            self.send_header("ETag", '"v1"')
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"3\r\npay\r\n4;ext=1\r\nload\r\n0\r\nx-trailer: 1\r\n\r\n")
            self.close_connection = True
        elif type(self).calls == 1:
            self._send(503, b"<Error><Code>SlowDown</Code><Message>later</Message></Error>")
        else:
            self._send(200, b"payload", {"ETag": '"v1"'})

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if type(self).hang_up:
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


def test_throttling_is_retried_dropped_connections_renewed_and_refusals_final() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sleeps: list[float] = []
        store = ObjectStore("s3://b", {"endpoint_url": f"http://127.0.0.1:{server.server_address[1]}"},
                            sleep=sleeps.append)
        assert store.read("k", 7, "v1") == b"payload"
        assert len(sleeps) == 1  # one 503, one retry
        # The server closed the kept-alive connection meanwhile: the next read reconnects at once.
        store._s3_http()._local.conn.sock.close()
        assert store.read("k", 7, "v1") == b"payload"
        with pytest.raises(StoreError, match="AccessDenied"):
            store.read("denied/k")
        assert len(sleeps) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_asyncio_reads_are_verified_like_blocking_ones(bucket: str) -> None:
    """The cache server reads lean s3:// datasets on its event loop (read_async): same checks."""
    import asyncio

    store = ObjectStore("s3://lean/data", {"endpoint_url": bucket})
    assert store.reads_async
    body = bytes(range(256)) * 40

    async def reads() -> None:
        etag = await store.current_tag_async("one two.tar")
        assert etag == store.current_tag("one two.tar")
        assert await store.read_async("one two.tar", len(body), etag) == body
        assert await store.read_async("one two.tar#000000000300+100:s", 100, etag) == body[300:400]
        with pytest.raises(ObjectChanged, match=f"store has '{etag}'"):  # 412, then a HEAD names the store's version
            await store.read_async("one two.tar", len(body), "0123456789abcdef0123456789abcdef")
        with pytest.raises(ObjectChanged, match="fewer bytes"):  # 416: the shard is shorter than the manifest says
            await store.read_async(f"one two.tar#{len(body) + 10:012d}+100:s", 100, etag)
        with pytest.raises(ObjectMissing, match="absent.bin"):
            await store.read_async("absent.bin")
        await store.aclose()

    asyncio.run(reads())
    file_store = ObjectStore("file:///tmp")
    assert not file_store.reads_async
    with pytest.raises(StoreError, match="in a thread"):
        asyncio.run(file_store.read_async("x"))


def test_asyncio_reads_retry_throttling_renew_dropped_connections_and_stop_at_refusals() -> None:
    import asyncio

    _Flaky.calls = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sleeps: list[float] = []

    async def no_wait(seconds: float) -> None:
        sleeps.append(seconds)

    store = ObjectStore("s3://b", {"endpoint_url": f"http://127.0.0.1:{server.server_address[1]}"},
                        async_sleep=no_wait)

    async def reads() -> None:
        assert await store.read_async("k", 7, "v1") == b"payload"
        assert len(sleeps) == 1  # one 503, one retry
        # The server closes the connection after answering without saying so: the next read on
        # the kept-alive connection finds it gone and reconnects at once, no backoff.
        _Flaky.hang_up = True
        assert await store.read_async("k", 7, "v1") == b"payload"
        _Flaky.hang_up = False
        assert await store.read_async("k", 7, "v1") == b"payload"
        with pytest.raises(StoreError, match="AccessDenied"):
            await store.read_async("denied/k")
        assert await store.read_async("chunked/k", 7, "v1") == b"payload"
        assert await store.read_async("k", 7, "v1") == b"payload"  # on a new connection
        assert len(sleeps) == 1
        await store.aclose()

    try:
        asyncio.run(reads())
    finally:
        server.shutdown()
        server.server_close()
