"""Network namespaces joined by one bridge, addresses from 198.18.0.0/15 (reserved for tests).

Every name this module makes starts with the lab's prefix, so :func:`remove_leftovers` can
clean up after a crashed run by name alone. Host names resolve through ``/etc/netns/<ns>/hosts``,
which ``ip netns exec`` bind-mounts over ``/etc/hosts`` for every process it starts.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PREFIX = "sdlab"
SUBNET = ipaddress.ip_network("198.18.0.0/24")
BRIDGE_ADDRESS = SUBNET.network_address + 1   # the root namespace's own address: tests and a person reach the lab


class NetnsError(RuntimeError):
    pass


def available() -> str:
    """'' if this process can make namespaces, else why not (the tests skip with this reason)."""
    import os

    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{PREFIX}probe{os.getpid()}"  # per process: two test workers may probe at once
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    _ip("netns", "del", probe, check=False)
    return ""


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Host:
    name: str        # host name other hosts resolve (the compose service name)
    netns: str       # namespace name
    address: str     # its address on the bridge
    veth: str        # the root-namespace end of its link: down/up here pulls its cable


class Network:
    """The bridge plus one namespace per host; ``close()`` removes all of them."""

    def __init__(self, names: list[str], prefix: str = PREFIX):
        if len(names) > SUBNET.num_addresses - 3:
            raise NetnsError(f"at most {SUBNET.num_addresses - 3} hosts")
        self.prefix = prefix
        self.bridge = f"{prefix}-br"
        self.hosts: dict[str, Host] = {}
        for i, name in enumerate(names):
            self.hosts[name] = Host(name, f"{prefix}-{name}", str(SUBNET.network_address + 2 + i), f"{prefix}v{i}")

    def create(self) -> None:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{BRIDGE_ADDRESS}/{SUBNET.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts.values())
            for h in self.hosts.values():
                _ip("netns", "add", h.netns)
                peer = h.veth + "p"
                _ip("link", "add", h.veth, "type", "veth", "peer", "name", peer)
                _ip("link", "set", peer, "netns", h.netns)
                _ip("link", "set", h.veth, "master", self.bridge)
                _ip("link", "set", h.veth, "up")
                _ip("-n", h.netns, "link", "set", "lo", "up")
                _ip("-n", h.netns, "link", "set", peer, "name", "eth0")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/{SUBNET.prefixlen}", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                etc = Path("/etc/netns") / h.netns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts_file)
        except BaseException:
            self.close()
            raise

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[host].netns]

    def link(self, host: str, up: bool) -> None:
        """Pull (``up=False``) or plug back a host's cable: its only link to every other host."""
        _ip("link", "set", self.hosts[host].veth, "up" if up else "down")

    def close(self) -> None:
        remove_leftovers(self.prefix)


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace, link and /etc/netns entry whose name starts with ``prefix``."""
    removed = []
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(prefix):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix):
                _ip("link", "del", name, check=False)
                removed.append(name)
    etc = Path("/etc/netns")
    if etc.is_dir():
        for d in etc.iterdir():
            if d.name.startswith(prefix):
                shutil.rmtree(d, ignore_errors=True)
    return removed


def _kill_namespace_processes(netns: str) -> None:
    import os
    import signal

    pids = _ip("netns", "pids", netns, check=False).split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
