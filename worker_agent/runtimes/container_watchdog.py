"""Kills this agent's containers when the agent dies: run as
``python -S container_watchdog.py AGENT_PID DOCKER_HOST NODE WORK_DIR`` (standard library only).

A container is the Engine's child, not the agent's: unlike a rank process it does not die with a
killed agent. This process is the agent's child and asks the kernel for SIGTERM when the agent
dies (PR_SET_PDEATHSIG); it then SIGKILLs every running container labelled with the agent's node
and work_dir, as the machine's death would, so that no rank runs on unsupervised while the
scheduler requeues its job elsewhere. (The next agent on the work_dir removes them.) The agent
ends it with SIGKILL when it closes, after its ranks have ended. Killed together with the agent
(a SIGKILL to both, a cgroup kill), it cannot act: the containers then run until the next agent
starts and stops them.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import signal
import socket
import sys
import urllib.parse

PR_SET_PDEATHSIG = 1


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _connection(docker_host: str, timeout: float = 10.0) -> http.client.HTTPConnection:
    url = urllib.parse.urlsplit(docker_host)
    if url.scheme == "unix":
        return _UnixConnection(url.path, timeout)
    return http.client.HTTPConnection(url.hostname or "localhost", url.port or 2375, timeout=timeout)


def _call(docker_host: str, method: str, path: str) -> bytes:
    conn = _connection(docker_host)
    try:
        conn.request(method, path)
        return conn.getresponse().read()
    finally:
        conn.close()


def kill_containers(docker_host: str, node: str, work_dir: str) -> list[str]:
    """SIGKILL the running containers of this node's agent; their ids."""
    filters = json.dumps({"label": [f"silod.node={node}", f"silod.work_dir={work_dir}"], "status": ["running"]})
    found = json.loads(_call(docker_host, "GET", "/containers/json?filters=" + urllib.parse.quote(filters)) or b"[]")
    killed = []
    for container in found:
        try:
            _call(docker_host, "POST", f"/containers/{container['Id']}/kill?signal=SIGKILL")
            killed.append(container["Id"])
        except OSError:
            pass
    return killed


def main(argv: list[str]) -> int:
    agent_pid, docker_host, node, work_dir = int(argv[1]), argv[2], argv[3], argv[4]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by sigtimedwait, not a handler
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is None or prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        print("silod container watchdog: prctl(PR_SET_PDEATHSIG) failed", file=sys.stderr)
        return 1
    # Until the agent is gone: its death signal wakes this at once (the kernel has reparented this
    # process by then); the timeout covers an agent that died before prctl, and a SIGTERM from
    # anyone else while the agent lives changes nothing.
    while os.getppid() == agent_pid:
        signal.sigtimedwait([signal.SIGTERM], 5.0)
    try:
        killed = kill_containers(docker_host, node, work_dir)
    except (OSError, ValueError) as exc:
        print(f"silod container watchdog: cannot kill the agent's containers: {exc}", file=sys.stderr)
        return 1
    print(f"silod container watchdog: agent {agent_pid} died; killed {len(killed)} container(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
