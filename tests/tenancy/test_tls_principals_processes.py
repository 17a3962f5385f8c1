"""TLS client certificates as principals, with real `silod metadata` and `silod cache-server` processes.

The metadata service and the cache server require client certificates signed by the test's CA
(tls_client_ca_file). A call without a bearer token is the principal the certificate's Common Name
names: admin:<label>, user:<name> (with the tenants the store gives that user now), node:<name>. A
bearer token, when present, wins. The cache server holds no token at all: it names itself to the
metadata service with its own certificate (node:n0), looks up a certificate user's tenants through
it, and asks it about the cluster token it does not hold. Certificates are made here (cryptography).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from silod.v1 import access_pb2 as a, cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2 as m, metadata_pb2_grpc

from silod.launcher import ServiceProcess, start_service
from silod.rpc.channels import open_channel
from tests.metadata.metadata_harness import assert_rpc_error
from tests.metadata.metadata_samples import training_spec

CLUSTER_TOKEN = "cluster-secret-for-tls-tests"
DENIED, UNAUTHENTICATED = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


class Authority:
    """A CA that signs server and client certificates into ``root``."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name
        self.key = ec.generate_private_key(ec.SECP256R1())  # EC: quick to make
        self.cert = self._sign(name, self.key.public_key(), ca=True)
        self.ca_file = root / f"{name}-ca.pem"
        self.ca_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def _sign(self, common_name: str, public_key, ca: bool = False, san=None) -> x509.Certificate:  # type: ignore[no-untyped-def]
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.name)]))
                   .public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(self.key, hashes.SHA256())

    def issue(self, common_name: str, server: bool = False) -> tuple[str, str]:
        """(certificate file, key file) of a new certificate for ``common_name``."""
        key = ec.generate_private_key(ec.SECP256R1())
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))] if server else None
        cert = self._sign(common_name, key.public_key(), san=san)
        stem = self.root / f"{self.name}-{common_name.replace(':', '_')}"
        cert_file, key_file = stem.with_suffix(".pem"), stem.with_suffix(".key")
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return str(cert_file), str(key_file)


@dataclass
class Cluster:
    ca: Authority
    rogue: Authority
    metadata: ServiceProcess
    cache: ServiceProcess
    alpha_job: str
    beta_job: str

    def metadata_as(self, common_name: str = "", token: str = "", authority: Authority | None = None) -> object:
        return metadata_pb2_grpc.MetadataServiceStub(self._channel(self.metadata, common_name, token, authority))

    def cache_as(self, common_name: str = "", token: str = "") -> object:
        return cache_pb2_grpc.CacheServiceStub(self._channel(self.cache, common_name, token, None))

    def _channel(self, process: ServiceProcess, common_name: str, token: str, authority: Authority | None) -> object:
        cert, key = (authority or self.ca).issue(common_name) if common_name else ("", "")
        return open_channel(process.address, token=token, tls_ca_file=str(self.ca.ca_file), tls_cert_file=cert,
                            tls_key_file=key, default_timeout_s=5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("tls")
    ca, rogue = Authority(root, "silod-test"), Authority(root, "rogue")
    server_cert, server_key = ca.issue("localhost", server=True)
    tls = ("--tls-cert-file", server_cert, "--tls-key-file", server_key, "--tls-client-ca-file", str(ca.ca_file),
           "--log-level", "warning")
    with start_service("metadata", "--db", f"sqlite:///{root / 'meta.db'}", "--auth-token", CLUSTER_TOKEN, *tls,
                       workdir=root / "md") as md:
        admin = metadata_pb2_grpc.MetadataServiceStub(open_channel(
            md.address, token=CLUSTER_TOKEN, tls_ca_file=str(ca.ca_file), tls_cert_file=server_cert,
            tls_key_file=server_key))
        admin.CreateTenant(a.CreateTenantRequest(name="alpha", members=["alice"]))
        admin.CreateTenant(a.CreateTenantRequest(name="beta", members=["bob"]))
        jobs = {t: admin.CreateJob(m.CreateJobRequest(spec=training_spec(tenant=t))).id for t in ("alpha", "beta")}
        node_cert, node_key = ca.issue("node:n0")
        # The cache server: no token of any kind, its certificate names it node n0 to the metadata service.
        with start_service("cache-server", "--metadata-address", md.address, "--metadata-tls-ca-file",
                           str(ca.ca_file), "--tls-client-cert-file", node_cert, "--tls-client-key-file", node_key,
                           "--node", "n0", "--disk-cache-dir", str(root / "disk"), "--memory-cache-bytes", "0",
                           "--no-fsync", "--lease-socket", "off", *tls, env={"SILOD_AUTH_TOKEN": ""},
                           workdir=root / "cache") as cache:
            yield Cluster(ca, rogue, md, cache, jobs["alpha"], jobs["beta"])


def test_a_user_certificate_is_that_user_with_its_tenants(cluster: Cluster) -> None:
    alice = cluster.metadata_as("user:alice")
    assert [j.id for j in alice.ListJobs(m.ListJobsRequest()).jobs] == [cluster.alpha_job]
    assert alice.GetJob(m.GetJobRequest(job_id=cluster.alpha_job)).spec.tenant == "alpha"
    assert_rpc_error(lambda: alice.GetJob(m.GetJobRequest(job_id=cluster.beta_job)), DENIED, "job_id")
    assert_rpc_error(lambda: alice.CreateTenant(a.CreateTenantRequest(name="mine")), DENIED, None)


def test_a_bearer_token_wins_over_the_certificate(cluster: Cluster) -> None:
    admin = cluster.metadata_as("admin:ops")
    bob_token = admin.CreateCredential(a.CreateCredentialRequest(kind=a.PRINCIPAL_KIND_USER, name="bob")).token
    as_bob = cluster.metadata_as("user:alice", token=bob_token)
    assert [j.id for j in as_bob.ListJobs(m.ListJobsRequest()).jobs] == [cluster.beta_job]
    wrong = cluster.metadata_as("admin:ops", token="silod_0123456789abcdef_" + "00" * 32)
    assert_rpc_error(lambda: wrong.ListTenants(a.ListTenantsRequest()), UNAUTHENTICATED, None)
    malformed = cluster.metadata_as("admin:ops")  # a header that is no bearer token is not "no token"
    assert_rpc_error(lambda: malformed.ListTenants(a.ListTenantsRequest(), metadata=[("authorization", "Basic x")]),
                     UNAUTHENTICATED, None)


def test_admin_and_node_certificates(cluster: Cluster) -> None:
    admin = cluster.metadata_as("admin:ops")
    admin.CreateTenant(a.CreateTenantRequest(name="gamma"))
    assert "gamma" in [t.name for t in admin.ListTenants(a.ListTenantsRequest()).tenants]
    node = cluster.metadata_as("node:n7")
    node.UpsertNode(m.UpsertNodeRequest(spec=common_pb2.NodeSpec(name="n7", gpus=1)))
    node.Heartbeat(m.HeartbeatRequest(node="n7"))
    assert_rpc_error(lambda: node.Heartbeat(m.HeartbeatRequest(node="n0")), DENIED, "node")
    assert_rpc_error(lambda: node.ListJobs(m.ListJobsRequest()), DENIED, None)


@pytest.mark.parametrize("common_name", ["job:x", "alice", "user:", "robot:r2"])
def test_a_certificate_naming_no_principal_is_unauthenticated(cluster: Cluster, common_name: str) -> None:
    stub = cluster.metadata_as(common_name)
    assert_rpc_error(lambda: stub.ListTenants(a.ListTenantsRequest()), UNAUTHENTICATED, None)


def test_no_certificate_or_one_of_another_ca_does_not_connect(cluster: Cluster) -> None:
    for stub in (cluster.metadata_as(""), cluster.metadata_as("admin:ops", authority=cluster.rogue)):
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListTenants(a.ListTenantsRequest())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_node_service_identified_by_its_certificate(cluster: Cluster) -> None:
    """The cache server holds no token: it asks the metadata service about a certificate user's
    tenants and about the cluster token with its own certificate (node:n0)."""
    alice = cluster.cache_as("user:alice")
    assert alice.Stats(cache_pb2.StatsRequest()).node == "n0"
    assert_rpc_error(lambda: alice.Prefetch(cache_pb2.PrefetchRequest(job_id=cluster.beta_job, dataset="d")),
                     DENIED, "job_id")
    with pytest.raises(grpc.RpcError) as own:  # her tenant's job: admitted (no such dataset here)
        alice.Prefetch(cache_pb2.PrefetchRequest(job_id=cluster.alpha_job, dataset="d"))
    assert own.value.code() not in (DENIED, UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE), own.value.details()
    assert cluster.cache_as("admin:ops", token=CLUSTER_TOKEN).Stats(cache_pb2.StatsRequest()).node == "n0"
    not_the_token = cluster.cache_as("admin:ops", token=CLUSTER_TOKEN + "x")
    assert_rpc_error(lambda: not_the_token.Stats(cache_pb2.StatsRequest()), UNAUTHENTICATED, None)
    lease = cluster.cache_as("user:alice").Lease
    assert_rpc_error(lambda: lease(cache_pb2.LeaseRequest(job_id=cluster.alpha_job, dataset="d", keys=["k"])),
                     DENIED, None)


@pytest.mark.parametrize(("settings", "message"), [
    ({"tls_client_ca_file": "CA"}, "tls_client_ca_file: needs TLS on"),
    ({"tls_client_cert_file": "CA"}, "tls_client_key_file: must be set together with tls_client_cert_file"),
    ({"tls_client_cert_file": "CA", "tls_client_key_file": "/nonexistent/key.pem"},
     "tls_client_key_file: cannot read '/nonexistent/key.pem'"),
])
def test_incomplete_client_certificate_settings_are_named(tmp_path: Path, settings: dict[str, str],
                                                          message: str) -> None:
    import asyncio

    from services.runtime.server import start_server
    from services.runtime.settings import ConfigError, ServiceSettings
    from tests.support.servicers import scripted_definition

    ca = Authority(tmp_path, "settings")
    settings = {k: str(ca.ca_file) if v == "CA" else v for k, v in settings.items()}
    with pytest.raises(ConfigError, match=message):
        asyncio.run(start_server(scripted_definition(), ServiceSettings(**settings)))
