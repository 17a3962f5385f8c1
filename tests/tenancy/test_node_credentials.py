"""Node credentials: the settings that carry one (named when wrong), the environment a node's ranks
get (no node credential in it), and `silod up` with auth on minting one per emulated node so that
its agent and cache server run without the cluster token. What a node credential may and may not
call, with real processes, is in test_hostile_tenants.py."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from silod.v1 import access_pb2 as a, metadata_pb2 as m, metadata_pb2_grpc

from cache_server.service import Settings as CacheSettings
from services.runtime.settings import ConfigError, load_settings
from silod.rpc.channels import open_channel
from worker_agent.service import Settings as AgentSettings

TOKEN = "silod_0123456789abcdef_" + "ab" * 32
CLUSTER_TOKEN = "cluster-secret-for-silod-up"


@pytest.mark.parametrize("cls", [AgentSettings, CacheSettings])
def test_the_node_credential_settings(cls, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    for name in ("SILOD_NODE_CREDENTIAL", "SILOD_NODE_CREDENTIAL_FILE", "SILOD_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    held = tmp_path / "credential"
    held.write_text(TOKEN + "\n")
    assert load_settings(cls, node_credential_file=str(held)).node_credential == TOKEN
    assert load_settings(cls, node_credential=TOKEN).node_credential == TOKEN
    for overrides, message in (
        ({"node_credential": TOKEN, "node_credential_file": str(held)}, "set one of them, not both"),
        ({"node_credential_file": str(tmp_path / "absent")}, "node_credential_file: cannot read"),
        ({"node_credential": "cluster-token"}, "node_credential: not a silod credential"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_settings(cls, **overrides)


def test_a_bad_node_credential_file_stops_the_agent_naming_the_setting(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "silod.cli", "worker-agent", "--metadata-address", "127.0.0.1:1",
                           "--node-credential-file", str(tmp_path / "absent")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "node_credential_file: cannot read" in done.stderr, done.stderr


def test_ranks_do_not_inherit_the_node_credential(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker_agent.launch_env import base_env

    monkeypatch.setenv("SILOD_NODE_CREDENTIAL", TOKEN)
    monkeypatch.setenv("SILOD_AUTH_TOKEN", "")
    settings = load_settings(AgentSettings, metadata_address="127.0.0.1:1", work_dir=str(tmp_path))
    env = base_env(settings)
    assert "SILOD_NODE_CREDENTIAL" not in env and TOKEN not in env.values()


def _children(pid: int) -> list[int]:
    found = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def test_silod_up_with_auth_gives_each_node_a_credential_of_its_own(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env["SILOD_AUTH_TOKEN"] = CLUSTER_TOKEN
    up = subprocess.Popen([sys.executable, "-m", "silod.cli", "up", "--nodes", "1", "--gpus-per-node", "1",
                           "--no-dashboard", "--state-dir", str(state)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (state / "cluster.json").exists():
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            assert time.monotonic() < deadline, "cluster.json not written"
            time.sleep(0.1)
        import json

        info = json.loads((state / "cluster.json").read_text())
        admin = metadata_pb2_grpc.MetadataServiceStub(open_channel(info["metadata"], token=CLUSTER_TOKEN))
        issued = admin.ListCredentials(a.ListCredentialsRequest(kind=a.PRINCIPAL_KIND_NODE)).credentials
        assert [c.name for c in issued] == ["node-0"]
        for name in ("node-0",):
            held = state / "nodes" / name / "node-credential"
            assert stat.S_IMODE(held.stat().st_mode) == 0o600
            assert held.read_text().split("_")[1] in {c.id for c in issued}
        # The node processes hold their node credential and no cluster token, and are at work with it:
        # registered and heartbeating (UpsertNode, Heartbeat under the node rules).
        node_procs = [p for p in _children(up.pid)
                      if any(w in Path(f"/proc/{p}/cmdline").read_bytes() for w in (b"worker-agent", b"cache-server"))]
        assert len(node_procs) == 2
        for pid in node_procs:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert CLUSTER_TOKEN.encode() not in environ and b"SILOD_NODE_CREDENTIAL_FILE=" in environ
        deadline = time.monotonic() + 30
        while [n.spec.name for n in admin.ListNodes(m.ListNodesRequest(alive_only=True)).nodes] != ["node-0"]:
            assert time.monotonic() < deadline, "the nodes did not register"
            time.sleep(0.2)
    finally:
        up.send_signal(signal.SIGINT)
        out = up.communicate(timeout=60)[0]
    assert up.returncode == 0, out
    # No call of theirs was refused, on their side or the scheduler's and the metadata service's.
    logs = [*(state / "logs").glob("cache-server-*.log"), *(state / "logs").glob("worker-agent-*.log"),
            *(state / "logs").glob("scheduler-*.log"), *(state / "logs").glob("metadata-*.log")]
    assert len(logs) == 4
    for log in logs:
        assert "UNAUTHENTICATED" not in log.read_text() and "PERMISSION_DENIED" not in log.read_text(), log


def test_a_node_services_directory_asks_with_its_node_credential(tmp_path: Path) -> None:
    """What a worker agent or cache server without the cluster token asks the metadata service:
    whom a token stands for (the cluster token included, which it cannot tell itself; a refusal kept
    for the TTL, so that a flood of bad tokens is not a flood of questions) and a certificate user's
    tenants."""
    import asyncio

    from services.metadata.service import Settings as MetadataSettings
    from services.runtime.directory import RemoteDirectory
    from services.runtime.errors import Unauthenticated
    from services.runtime.principals import CLUSTER_ADMIN, USER
    from tests.metadata.metadata_harness import InProcessServer

    settings = MetadataSettings(db=f"sqlite:///{tmp_path / 'md.db'}", log_level="warning", auth_token=CLUSTER_TOKEN)
    server = InProcessServer(settings)
    with server:
        admin = metadata_pb2_grpc.MetadataServiceStub(open_channel(server.address, token=CLUSTER_TOKEN))
        node = admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_NODE, name="n0")).token
        admin.CreateTenant(a.CreateTenantRequest(name="vision", members=["alice"]))

        async def asks() -> None:
            directory = RemoteDirectory(server.address, node, ttl_s=60, resolve_any=True)
            try:
                assert await directory.resolve(CLUSTER_TOKEN) == CLUSTER_ADMIN
                with pytest.raises(Unauthenticated):
                    await directory.resolve("not-the-cluster-token")
                alice = await directory.certificate_principal(USER, "alice")
                assert alice.tenants == ("vision",)
            finally:
                await directory.close()
            return directory

        directory = asyncio.run(asks())
    # The server is gone: what the directory refused within its TTL is still refused, not UNAVAILABLE.
    with pytest.raises(Unauthenticated):
        asyncio.run(directory.resolve("not-the-cluster-token"))
