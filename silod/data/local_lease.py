"""The reader's end of the cache server's local lease socket (cache_server/local_socket.py).

Blocking Unix-socket connections, opened after fork like the gRPC channel (one per thread that
calls at the same time): one ``LeaseRequest`` out, one ``LeaseResponse`` back, without gRPC's
per-call cost. Any trouble with the socket itself raises :class:`SocketTrouble` and the caller
goes back to gRPC; a refusal by the server raises :class:`LeaseRefused` with the status code
gRPC would have given.
"""

from __future__ import annotations

import socket
import struct
import threading

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
    """Thread-safe: each call takes an idle connection or opens one (a job that reads ahead in a
    thread of its own leases from two threads at once, as it may over gRPC)."""

    def __init__(self, path: str, token: str = "", timeout_s: float = 30.0) -> None:
        self.path = path
        self._token = token.encode()
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = [self._connect()]  # connect now: a refused token shows here

    def lease(self, request_bytes: bytes) -> bytes:
        """The serialized ``LeaseResponse`` to a serialized ``LeaseRequest``."""
        return self._call(KIND_LEASE, request_bytes, self._timeout_s)

    def release(self, request_bytes: bytes, timeout_s: float = 1.0) -> None:
        """Release a lease (a serialized ``ReleaseLeaseRequest``); a process that exits waits at
        most ``timeout_s`` for it."""
        self._call(KIND_RELEASE, request_bytes, timeout_s)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout_s)
        try:
            sock.connect(self.path)
            _exchange(sock, self.path, KIND_HELLO, self._token)
        except OSError as exc:
            sock.close()
            raise SocketTrouble(f"connect to {self.path}: {exc}", isinstance(exc, TimeoutError)) from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _call(self, kind: int, payload: bytes, timeout_s: float) -> bytes:
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            sock = self._connect()
        try:
            sock.settimeout(timeout_s)
            answer = _exchange(sock, self.path, kind, payload)
        except LeaseRefused:
            self._give_back(sock)  # the server answered: the connection is fine
            raise
        except BaseException:
            sock.close()  # mid-frame: never reuse it
            raise
        self._give_back(sock)
        return answer

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)


def _exchange(sock: socket.socket, path: str, kind: int, payload: bytes) -> bytes:
    try:
        # MSG_NOSIGNAL: a server gone away is an EPIPE error here, not a SIGPIPE that kills a
        # process whose SIGPIPE is not ignored (Python ignores it, but not every job does).
        sock.sendall(HEADER.pack(len(payload) + 1) + bytes((kind,)) + payload, socket.MSG_NOSIGNAL)
        (length,) = HEADER.unpack(_recv(sock, path, HEADER.size))
        if not 1 <= length <= MAX_ANSWER_BYTES:
            raise SocketTrouble(f"answer of {length:,} bytes from {path}")
        answer = _recv(sock, path, length)
    except OSError as exc:  # timeouts included
        raise SocketTrouble(f"{path}: {exc or type(exc).__name__}", isinstance(exc, TimeoutError)) from None
    status, body = answer[0], answer[1:]
    if status != OK:
        code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
        raise LeaseRefused(code, body.decode(errors="replace"))
    return body


def _recv(sock: socket.socket, path: str, size: int) -> bytes:
    data = sock.recv(size, socket.MSG_WAITALL)
    if len(data) == size:
        return data
    parts, got = [data], len(data)  # MSG_WAITALL may return early (a signal)
    while got < size:
        more = sock.recv(size - got)
        if not more:
            raise SocketTrouble(f"{path}: closed by the cache server")
        parts.append(more)
        got += len(more)
    return b"".join(parts)
