"""The Docker Engine the tests start (tests/support/docker_engine.py) lives beside the multi-host
lab: dockerd sets iptables' FORWARD policy to DROP, and with br_netfilter the frames the lab
bridges between its namespaces (198.18.0.0/24) pass FORWARD. Two namespaces on a bridge of their
own, addressed in the lab's subnet as the lab's hosts are, still talk while the daemon runs; the
daemon's bridge and networks take addresses from 198.19.0.0/16 only."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from silod.lab import netns
from tests.support.docker_engine import LAB_SUBNET, POOL, Engine, docker_engine, forward_policy, forward_rules

pytestmark = pytest.mark.timeout(600)  # the first test of a fresh machine installs Docker (apt-get)
__all__ = ["docker_engine"]  # the fixture, used by name below

PREFIX = f"sddk{os.getpid() % 100000}"  # never the lab's prefix: neither removes the other's links


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    """Two namespaces on a bridge of their own at 198.18.0.250 and .251 (no address in the root
    namespace, so no route of the lab's is touched)."""
    bridge, hosts = f"{PREFIX}br", (f"{PREFIX}a", f"{PREFIX}b")
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i, ns in enumerate(hosts):
            _ip("netns", "add", ns)
            _ip("link", "add", f"{ns}v", "type", "veth", "peer", "name", f"{ns}p")
            _ip("link", "set", f"{ns}p", "netns", ns)
            _ip("link", "set", f"{ns}v", "master", bridge)
            _ip("link", "set", f"{ns}v", "up")
            _ip("-n", ns, "addr", "add", f"198.18.0.{250 + i}/24", "dev", f"{ns}p")
            _ip("-n", ns, "link", "set", f"{ns}p", "up")
        yield hosts
    finally:
        netns.remove_leftovers(PREFIX)


def test_the_labs_bridged_traffic_passes_while_dockerd_runs(docker_engine: Engine, two_hosts) -> None:  # type: ignore[no-untyped-def]
    if not docker_engine.pid:
        pytest.skip("a Docker daemon the tests did not start runs here: its firewall rules are its operator's")
    assert forward_policy() == "DROP"  # dockerd's: what would cut the lab off
    assert any(LAB_SUBNET in rule and "silod-tests-lab" in rule and "ACCEPT" in rule for rule in forward_rules())
    server, client = two_hosts
    listener = subprocess.Popen(
        ["ip", "netns", "exec", server, "python3", "-c",
         "import socket; s = socket.create_server(('198.18.0.250', 7000)); print('up', flush=True); "
         "c, _ = s.accept(); c.sendall(c.recv(100).upper())"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
        reply = subprocess.run(
            ["ip", "netns", "exec", client, "python3", "-c",
             "import socket; c = socket.create_connection(('198.18.0.250', 7000), timeout=5); c.sendall(b'lab'); "
             "print(c.recv(100).decode())"], capture_output=True, text=True, timeout=30)
        assert reply.stdout.strip() == "LAB", reply.stderr
    finally:
        listener.kill()
        listener.wait()


def test_dockers_networks_take_addresses_from_198_19(docker_engine: Engine) -> None:
    if not docker_engine.pid:
        pytest.skip("a Docker daemon the tests did not start runs here, configured by its operator")
    pool = ipaddress.ip_network(POOL)
    network = f"silod-test-pool-{os.getpid()}"
    docker_engine.docker("network", "create", network)
    try:
        for name in ("bridge", network):
            config = json.loads(docker_engine.docker("network", "inspect", name).stdout)[0]["IPAM"]["Config"]
            assert config and all(ipaddress.ip_network(c["Subnet"]).subnet_of(pool) for c in config), config
    finally:
        docker_engine.docker("network", "rm", network, check=False)
