"""The reader's end of the cache server's local lease socket (cache_server/local_socket.py).

A blocking Unix socket per process, opened after fork like the gRPC channel: one
``LeaseRequest`` out, one ``LeaseResponse`` back, without gRPC's per-call cost. Any trouble
with the socket itself raises :class:`SocketTrouble` and the caller goes back to gRPC; a refusal
by the server raises :class:`LeaseRefused` with the status code gRPC would have given.
"""

from __future__ import annotations

import socket
import struct

import grpc

HEADER = struct.Struct(">I")
KIND_HELLO, KIND_LEASE, KIND_RELEASE = 0, 1, 2
OK = 0
MAX_ANSWER_BYTES = 256 << 20
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SocketTrouble(Exception):
    """The socket failed (refused, reset, closed, timed out): use gRPC instead."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class LeaseRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class LocalLeaseClient:
    def __init__(self, path: str, token: str = "", timeout_s: float = 30.0) -> None:
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise SocketTrouble(f"connect to {path}: {exc}") from None
        self._sock = sock
        try:
            self._exchange(KIND_HELLO, token.encode())
        except BaseException:
            self.close()
            raise

    def lease(self, request_bytes: bytes) -> bytes:
        """The serialized ``LeaseResponse`` to a serialized ``LeaseRequest``."""
        return self._exchange(KIND_LEASE, request_bytes)

    def release(self, request_bytes: bytes) -> None:
        """Release a lease (a serialized ``ReleaseLeaseRequest``)."""
        self._exchange(KIND_RELEASE, request_bytes)

    def close(self) -> None:
        self._sock.close()

    def _exchange(self, kind: int, payload: bytes) -> bytes:
        try:
            # MSG_NOSIGNAL: a server gone away is an EPIPE error here, not a SIGPIPE that kills a
            # process whose SIGPIPE is not ignored (Python ignores it, but not every job does).
            self._sock.sendall(HEADER.pack(len(payload) + 1) + bytes((kind,)) + payload, socket.MSG_NOSIGNAL)
            (length,) = HEADER.unpack(self._recv(HEADER.size))
            if not 1 <= length <= MAX_ANSWER_BYTES:
                raise SocketTrouble(f"answer of {length:,} bytes from {self.path}")
            answer = self._recv(length)
        except OSError as exc:  # timeouts included
            raise SocketTrouble(f"{self.path}: {exc or type(exc).__name__}", isinstance(exc, TimeoutError)) from None
        status, body = answer[0], answer[1:]
        if status != OK:
            code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
            raise LeaseRefused(code, body.decode(errors="replace"))
        return body

    def _recv(self, size: int) -> bytes:
        data = self._sock.recv(size, socket.MSG_WAITALL)
        if len(data) == size:
            return data
        parts, got = [data], len(data)  # MSG_WAITALL may return early (a signal)
        while got < size:
            more = self._sock.recv(size - got)
            if not more:
                raise SocketTrouble(f"{self.path}: closed by the cache server")
            parts.append(more)
            got += len(more)
        return b"".join(parts)
