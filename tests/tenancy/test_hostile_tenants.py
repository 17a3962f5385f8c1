"""The hostile-tenant suite: with real processes and auth on, every principal calls every method of
the access table with another principal's resources, and is refused, and nothing changes.

One cluster for the module: `silod metadata`, `silod scheduler`, `silod estimator`, a cache server
and a worker agent on node n0 and a worker agent on node n1, the node processes holding node
credentials (never the cluster token); tenants alpha (user alice) and beta (user bob), a running job
of each. The attackers: alice (tenant alpha), bob (tenant beta), node n1, and job B (tenant beta's
job, with a job credential). Alice aims at tenant beta's job, the others at tenant alpha's; node n1
at node n0. The cases come from services/runtime/access_rules.RULES (tests/tenancy/hostile_cases.py),
so a method added to the table without a hostile case fails the suite. First, a real job of tenant
beta whose own code tries to commit a plan, cancel the other tenant's job and read its samples.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from silod.v1 import access_pb2 as a, cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2 as m, metadata_pb2_grpc
from silod.v1 import scheduler_pb2, scheduler_pb2_grpc

from services.runtime.access_rules import RULES
from services.runtime.principals import JOB, NODE, USER
from silod.launcher import ServiceProcess, start_service
from silod.rpc.channels import open_channel
from tests.cache_server.harness import make_dataset, silod_cli
from tests.tenancy import hostile_cases
from tests.tenancy.job_results import result_of
from tests.tenancy.hostile_cases import Case, Target, empty_request, method_descriptor

CLUSTER_TOKEN = "cluster-secret-for-the-hostile-suite"
ATTACKERS = {"alice": USER, "bob": USER, "node-n1": NODE, "job-B": JOB}
CASES = hostile_cases.cases(ATTACKERS)  # raises, failing collection, for a method with no hostile case
REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
RUNNING, SUCCEEDED = common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_SUCCEEDED
SCRIPT = Path(__file__).with_name("job_with_a_token.py")


def wait_for(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Cluster:
    processes: dict[str, ServiceProcess]
    tokens: dict[str, str]  # attacker -> its token
    targets: dict[str, Target]  # attacker -> what it aims at
    job_a: str
    job_b: str
    admin_md: Any
    admin_jobs: Any
    admin_cache: Any
    root: Path = Path()  # the module's directory: the agents' work directories are <root>/<node>
    channels: dict[tuple[str, str], Any] = field(default_factory=dict)

    def address(self, method: str) -> str:
        service = method.lstrip("/").split("/")[0].rsplit(".", 1)[-1]
        name = {"MetadataService": "metadata", "JobService": "scheduler", "AllocationService": "scheduler",
                "PlanFeedService": "scheduler", "CacheService": "cache-n0", "WorkerAgentService": "agent-n0", "EstimatorService": "estimator",
                "ServerReflection": "metadata"}[service]
        return self.processes[name].address

    def channel(self, attacker: str, address: str) -> Any:
        key = (attacker, address)
        if key not in self.channels:
            self.channels[key] = open_channel(address, token=self.tokens[attacker])
        return self.channels[key]


def _start_all(stack: contextlib.ExitStack, specs: dict[str, tuple[tuple[str, ...], dict[str, str]]],
               root: Path) -> dict[str, ServiceProcess]:
    """Start independent services side by side (start-up is mostly imports)."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start_service, *argv, env=env, workdir=root / name, timeout_s=60)
                   for name, (argv, env) in specs.items()}
        started = {}
        for name, future in futures.items():
            with contextlib.suppress(Exception):
                started[name] = stack.enter_context(future.result())
        for name, future in futures.items():
            future.result()  # re-raises the first failure, the others being closed by the stack
    return started


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("hostile")
    make_dataset(root / "store", 20, 500, seed=5)
    auth = ("--auth-token", CLUSTER_TOKEN, "--log-level", "warning")
    ttl = ("--credential-cache-s", "1")
    with contextlib.ExitStack() as stack:
        md = stack.enter_context(start_service("metadata", "--db", f"sqlite:///{root / 'meta.db'}", *auth,
                                               workdir=root / "md"))
        admin_md = metadata_pb2_grpc.MetadataServiceStub(open_channel(md.address, token=CLUSTER_TOKEN))

        def issue(kind: int, name: str) -> a.IssuedCredential:
            return admin_md.CreateCredential(a.CreateCredentialRequest(kind=kind, name=name))

        node = {n: issue(a.PRINCIPAL_KIND_NODE, n).token for n in ("n0", "n1")}
        (root / "n0.credential").write_text(node["n0"] + "\n")
        admin_md.CreateTenant(a.CreateTenantRequest(name="alpha", members=["alice"]))
        admin_md.CreateTenant(a.CreateTenantRequest(name="beta", members=["bob"]))
        users = {u: issue(a.PRINCIPAL_KIND_USER, u) for u in ("alice", "bob")}
        # imgs: shared with every tenant (tenant beta's job reads it); each tenant's own: the targets.
        for name, owner in (("imgs", ("--shared",)), ("alpha-imgs", ("--tenant", "alpha")),
                            ("beta-imgs", ("--tenant", "beta"))):
            code, output = silod_cli("dataset", "register", name, f"file://{root / 'store'}", *owner, "--metadata",
                                     md.address, "--token", CLUSTER_TOKEN)
            assert code == 0, output

        core = _start_all(stack, {
            "scheduler": (("scheduler", "--metadata-address", md.address, "--interval-s", "1", *ttl, *auth), {}),
            "estimator": (("estimator", "--metadata-address", md.address, *auth), {}),
            # The node's cache server: its node credential in the environment, no cluster token.
            "cache-n0": (("cache-server", "--metadata-address", md.address, "--node", "n0",
                          "--disk-cache-dir", str(root / "disk"), "--memory-cache-bytes", "0", "--no-fsync", *ttl,
                          "--log-level", "warning"), {"SILOD_NODE_CREDENTIAL": node["n0"]}),
        }, root)
        agent = ("worker-agent", "--metadata-address", md.address, "--scheduler-address",
                 core["scheduler"].address, "--report-s", "0.5", "--heartbeat-s", "0.5", *ttl, "--log-level", "warning")
        agents = _start_all(stack, {
            # n0 reads its credential from a file (node_credential_file), n1 from the environment.
            "agent-n0": ((*agent, "--node-name", "n0", "--gpus", "3", "--work-dir", str(root / "n0"),
                          "--cache-address", core["cache-n0"].address,
                          "--node-credential-file", str(root / "n0.credential")), {}),
            "agent-n1": ((*agent, "--node-name", "n1", "--gpus", "0", "--work-dir", str(root / "n1")),
                         {"SILOD_NODE_CREDENTIAL": node["n1"]}),
        }, root)

        def submit(user: str, tenant: str) -> str:
            jobs = scheduler_pb2_grpc.JobServiceStub(open_channel(core["scheduler"].address,
                                                                  token=users[user].token))
            return jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(
                name=f"{tenant}-train", tenant=tenant, application="cifar10", min_gpus=1, max_gpus=1, batch_size=8,
                sample_budget=10**12, emulated_step_compute_s=0.2))).id

        job_a, job_b = submit("alice", "alpha"), submit("bob", "beta")
        admin_jobs = scheduler_pb2_grpc.JobServiceStub(open_channel(core["scheduler"].address, token=CLUSTER_TOKEN))
        for job in (job_a, job_b):
            wait_for(lambda: admin_jobs.GetJob(m.GetJobRequest(job_id=job)).state == RUNNING, 60, f"{job} running")
        job_b_token = issue(a.PRINCIPAL_KIND_JOB, job_b).token
        admin_cache = cache_pb2_grpc.CacheServiceStub(open_channel(core["cache-n0"].address, token=CLUSTER_TOKEN))
        keys = tuple(o.key for o in admin_md.ListDatasetObjects(m.ListDatasetObjectsRequest(name="imgs")).objects[:4])

        def lease(job: str) -> str:
            return str(admin_cache.Lease(cache_pb2.LeaseRequest(job_id=job, dataset="imgs", keys=list(keys))).lease_id)

        def target(job: str, tenant: str, own_node: str, victim_user: str, own_tenant: str = "",
                   own_job: str = "") -> Target:
            return Target(job=job, tenant=tenant, node="n0", own_node=own_node, dataset=f"{tenant}-imgs", keys=keys,
                          lease_id=lease(job), token=users[victim_user].token,
                          credential_id=users[victim_user].credential.id, own_job=own_job, own_tenant=own_tenant)

        yield Cluster(
            processes={"metadata": md, **core, **agents},
            tokens={"alice": users["alice"].token, "bob": users["bob"].token, "node-n1": node["n1"],
                    "job-B": job_b_token},
            targets={"alice": target(job_b, "beta", "", "bob", own_tenant="alpha"),
                     "bob": target(job_a, "alpha", "", "alice", own_tenant="beta"),
                     "node-n1": target(job_a, "alpha", "n1", "alice"),
                     "job-B": target(job_a, "alpha", "", "alice", own_job=job_b)},
            job_a=job_a, job_b=job_b, admin_md=admin_md, admin_jobs=admin_jobs, admin_cache=admin_cache,
            root=root)
        for job in (job_a, job_b):
            admin_jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=job))


def snapshot(c: Cluster) -> dict[str, Any]:
    """What an attacker must not change, read by an admin: the two jobs' states and tenants, the
    datasets (spec, tenant, manifest), the plan's placements of the two jobs and the plans' authors, the nodes' specs
    and GPU faults (the GPU table), credentials, tenants."""
    md = c.admin_md
    jobs = {j: (md.GetJob(m.GetJobRequest(job_id=j)).state, md.GetJob(m.GetJobRequest(job_id=j)).spec.tenant)
            for j in (c.job_a, c.job_b)}
    datasets = {d.spec.SerializeToString(deterministic=True): (d.manifest_version, [
        (o.key, o.size_bytes) for o in md.ListDatasetObjects(m.ListDatasetObjectsRequest(name=d.spec.name)).objects])
        for d in md.ListDatasets(m.ListDatasetsRequest()).datasets}
    plan = md.GetLatestPlan(m.GetLatestPlanRequest())
    placements = {j.job_id: sorted((p.node, tuple(p.gpu_indices)) for p in j.placements)
                  for j in plan.jobs if j.job_id in (c.job_a, c.job_b)}
    plans = md.ListPlans(m.ListPlansRequest(page_size=100)).plans
    nodes = {n.spec.name: (n.spec.SerializeToString(deterministic=True),
                           [f.SerializeToString(deterministic=True) for f in n.gpu_faults])
             for n in md.ListNodes(m.ListNodesRequest()).nodes}
    credentials = [(x.id, x.kind, x.name, x.HasField("revoked_at")) for x in md.ListCredentials(
        a.ListCredentialsRequest(include_revoked=True)).credentials if x.kind != a.PRINCIPAL_KIND_JOB]
    tenants = [(t.name, tuple(t.members), t.quota.SerializeToString(deterministic=True))
               for t in md.ListTenants(a.ListTenantsRequest()).tenants]
    return {"jobs": jobs, "datasets": datasets, "placements": placements,
            "plan authors": sorted({p.policy for p in plans}), "plans below 1e6": max(p.version for p in plans) < 10**6,
            "nodes": nodes, "credentials": credentials, "tenants": tenants}


@pytest.fixture(scope="module")
def before(cluster: Cluster) -> dict[str, Any]:
    return snapshot(cluster)


def test_a_jobs_own_code_cannot_commit_a_plan_cancel_another_job_or_read_its_samples(cluster: Cluster,
                                                                                        tmp_path: Path) -> None:
    """Tenant beta's job (tests/tenancy/job_with_a_token.py, run by the n0 agent that holds a node
    credential) tries with its SILOD_AUTH_TOKEN what only the scheduler, another tenant or another job
    may do; it is refused each time, and trains to the end with what a job needs."""
    c = cluster
    bob = scheduler_pb2_grpc.JobServiceStub(c.channel("bob", c.processes["scheduler"].address))
    job = bob.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(
        name="curious", tenant="beta", application="cifar10", dataset="imgs", min_gpus=1, max_gpus=1,
        batch_size=8, sample_budget=64, command=[sys.executable, str(SCRIPT)],
        env={"VICTIM": c.job_a, "SCHEDULER_ADDR": c.processes["scheduler"].address})))
    done = wait_for(lambda: (j := c.admin_jobs.GetJob(m.GetJobRequest(job_id=job.id))).state not in (
        common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED, RUNNING) and j, 60, "the job ended")
    assert done.state == SUCCEEDED, done.message
    results = result_of(c.root / "n0" / "jobs" / job.id / "rank-0.log")["results"]
    own = {k: v for k, v in results.items() if k.startswith("own:") and k != "own: leased bytes"}
    assert own and set(own.values()) == {"OK"}, own
    refused = {k: v for k, v in results.items() if not k.startswith("own:")}
    for attempt in ("AllocationService.CommitPlan", "MetadataService.CommitPlan", "JobService.CancelJob",
                    "MetadataService.TransitionJob", "CacheService.Read", "CacheService.Lease"):
        assert refused[attempt] == "PERMISSION_DENIED", (attempt, refused)
    assert set(refused.values()) == {"PERMISSION_DENIED"}, refused
    assert c.admin_jobs.GetJob(m.GetJobRequest(job_id=c.job_a)).state == RUNNING
    assert all(p.policy != "attacker" for p in c.admin_md.ListPlans(m.ListPlansRequest(page_size=100)).plans)


def _call(channel: Any, method: str, request: Any) -> tuple[grpc.StatusCode, str]:
    descriptor = method_descriptor(method)
    reply = message_factory.GetMessageClass(descriptor.output_type).FromString
    kwargs = {"request_serializer": lambda r: r.SerializeToString(), "response_deserializer": reply}
    try:
        if descriptor.client_streaming and descriptor.server_streaming:
            next(channel.stream_stream(method, **kwargs)(iter(request), timeout=5))
        elif descriptor.client_streaming:
            channel.stream_unary(method, **kwargs)(iter(request), timeout=5)
        elif descriptor.server_streaming:
            with contextlib.suppress(StopIteration):
                next(channel.unary_stream(method, **kwargs)(request, timeout=5))
        else:
            channel.unary_unary(method, **kwargs)(request, timeout=5)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _param(case: Case) -> Any:
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=case.why)] if case.expect == "hole" else []
    return pytest.param(case, id=f"{case.attacker}-{case.name}-{case.expect}", marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_hostile_call(cluster: Cluster, before: dict[str, Any], case: Case) -> None:
    target = cluster.targets[case.attacker]
    request = case.build(target) if case.build is not None else empty_request(case.method)
    code, details = _call(cluster.channel(case.attacker, cluster.address(case.method)), case.method, request)
    if case.expect == "shared":  # opened on purpose by the table (hostile_cases.SHARED says why)
        assert code not in REFUSED, f"{case.name} is refused to a {case.attacker}: {code.name}; {case.why}"
        return
    assert code in REFUSED, f"{case.attacker} called {case.name} on another's resources: {code.name}"
    if RULES[case.method].check_for(case.kind) is not None:  # admitted kind, refused by ownership:
        field = details.split(":", 1)[0]  # the refusal names the request field it is about
        assert code == grpc.StatusCode.PERMISSION_DENIED and field and " " not in field, (code, details)


def test_nothing_changed(cluster: Cluster, before: dict[str, Any]) -> None:
    after = snapshot(cluster)
    assert after == before
    assert before["jobs"] == {cluster.job_a: (RUNNING, "alpha"), cluster.job_b: (RUNNING, "beta")}
    assert before["plans below 1e6"] and "attacker" not in before["plan authors"]
    assert set(before["nodes"]) == {"n0", "n1"}
    assert len(before["datasets"]) == 3


def test_the_suite_covers_every_method_of_the_table() -> None:
    covered = {(c.method, c.attacker) for c in CASES}
    for method, rule in RULES.items():
        if not rule.public:
            assert {(method, who) for who in ATTACKERS} <= covered, method
