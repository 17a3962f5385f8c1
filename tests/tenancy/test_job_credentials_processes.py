"""A job's ranks hold a credential of their own job and no other, with real `silod metadata`,
`silod scheduler`, `silod cache-server` and `silod worker-agent` processes and auth on.

The job's own code (job_with_a_token.py) reads SILOD_AUTH_TOKEN and tries to act as the
scheduler, on another tenant's job and on its samples: every try is PERMISSION_DENIED and changes
nothing, while what a job needs works and it trains to SUCCEEDED. The cluster token is nowhere
in the rank's environment (a warm process's); once the job has ended its token is refused within the cache TTL.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import grpc
from silod.v1 import access_pb2 as a, cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2 as m, metadata_pb2_grpc, scheduler_pb2
from silod.v1 import scheduler_pb2_grpc, worker_agent_pb2 as w, worker_agent_pb2_grpc

from silod.launcher import start_service
from silod.rpc.channels import open_channel
from tests.cache_server.harness import make_dataset, silod_cli
from tests.tenancy.job_results import result_of

CLUSTER_TOKEN = "cluster-secret-for-job-credential-tests"
CACHE_S = 1.0  # credential_cache_s of the scheduler, the agent and the cache server
SCRIPT = Path(__file__).with_name("job_with_a_token.py")
RUNNING, SUCCEEDED = common_pb2.JOB_STATE_RUNNING, common_pb2.JOB_STATE_SUCCEEDED
ALLOWED = ("own: ListDatasetObjects", "own: GetDataset", "own: Lease", "own: ReleaseLease", "own: Read",
           "own: ReportProgress", "own: GetDirective")


def wait_for(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_jobs_ranks_hold_a_credential_of_their_own_job_only(tmp_path: Path) -> None:
    make_dataset(tmp_path / "store", 20, 500, seed=3)
    auth = ("--auth-token", CLUSTER_TOKEN, "--log-level", "warning")
    ttl = ("--credential-cache-s", str(CACHE_S))
    with start_service("metadata", "--db", f"sqlite:///{tmp_path / 'meta.db'}", *auth, workdir=tmp_path / "md") as md, \
         start_service("scheduler", "--metadata-address", md.address, "--interval-s", "1", *ttl, *auth,
                       workdir=tmp_path / "sched") as sch, \
         start_service("cache-server", "--metadata-address", md.address, "--disk-cache-dir", str(tmp_path / "disk"),
                       "--memory-cache-bytes", "0", "--no-fsync", *ttl, *auth, workdir=tmp_path / "cache") as cache, \
         start_service("worker-agent", "--metadata-address", md.address, "--scheduler-address", sch.address,
                       "--node-name", "n0", "--gpus", "2", "--work-dir", str(tmp_path / "agent"),
                       "--cache-address", cache.address, "--report-s", "0.5", "--heartbeat-s", "0.5", *ttl,
                       "--warm-processes", "1", "--warm-preload", "grpc",  # the job below runs in a warm one
                       "--log-level", "warning", env={"SILOD_AUTH_TOKEN": CLUSTER_TOKEN},  # as deployments set it
                       workdir=tmp_path / "ag") as agent_proc:
        code, output = silod_cli("dataset", "register", "imgs", f"file://{tmp_path / 'store'}", "--metadata",
                                 md.address, "--token", CLUSTER_TOKEN)
        assert code == 0, output
        admin_md = metadata_pb2_grpc.MetadataServiceStub(open_channel(md.address, token=CLUSTER_TOKEN))
        admin = scheduler_pb2_grpc.JobServiceStub(open_channel(sch.address, token=CLUSTER_TOKEN))

        victim = admin.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(
            name="victim", tenant="speech", application="cifar10", min_gpus=1, max_gpus=1, batch_size=8,
            sample_budget=10_000_000, emulated_step_compute_s=0.05)))  # the emulated job: the SDK's own calls
        wait_for(lambda: admin.GetJob(m.GetJobRequest(job_id=victim.id)).state == RUNNING, 40, "victim running")
        job = admin.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(
            name="curious", tenant="vision", application="cifar10", dataset="imgs", min_gpus=1, max_gpus=1,
            batch_size=8, sample_budget=64, command=[sys.executable, str(SCRIPT)], resize_in_place=True,
            env={"VICTIM": victim.id, "SCHEDULER_ADDR": sch.address})))
        done = wait_for(lambda: (j := admin.GetJob(m.GetJobRequest(job_id=job.id))).state not in (
            common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED, RUNNING) and j, 60, "the job ended")
        log = (tmp_path / "agent" / "jobs" / job.id / "rank-0.log").read_text()
        assert done.state == SUCCEEDED, f"{done.message}\n{log}"
        assert done.progress.samples_done == 64, "its progress went through its agent"
        seen = result_of(tmp_path / "agent" / "jobs" / job.id / "rank-0.log")
        results = seen["results"]

        # What the job needs works; all else is refused.
        assert {name: results[name] for name in ALLOWED} == {name: "OK" for name in ALLOWED}, results
        assert results["own: leased bytes"] == str(4 * 500)
        refused = {name: code for name, code in results.items() if not name.startswith("own:")}
        assert refused and set(refused.values()) == {"PERMISSION_DENIED"}, refused
        assert len(refused) == 18

        # ... and changed nothing: no plan of the attacker's, the other job still runs, no new job.
        plans = admin_md.ListPlans(m.ListPlansRequest()).plans
        assert plans and all(p.policy != "attacker" for p in plans) and max(p.version for p in plans) < 1_000
        assert admin.GetJob(m.GetJobRequest(job_id=victim.id)).state == RUNNING
        assert sorted(j.id for j in admin.ListJobs(m.ListJobsRequest()).jobs) == sorted([victim.id, job.id])

        # The rank's environment holds its job's credential and no cluster token, nor does the one
        # its warm process was started with (/proc/self/environ).
        assert seen["env"].get("SILOD_WARM_START") == "1"
        token = seen["env"]["SILOD_AUTH_TOKEN"]
        assert token.startswith("silod_") and token != CLUSTER_TOKEN
        assert CLUSTER_TOKEN not in seen["environ"] and CLUSTER_TOKEN not in json.dumps(seen["env"])
        listed = admin_md.ListCredentials(a.ListCredentialsRequest(kind=a.PRINCIPAL_KIND_JOB, name=job.id,
                                                                   include_revoked=True)).credentials
        assert [(c.id, c.HasField("revoked_at")) for c in listed] == [(token.split("_")[1], True)], \
            "one credential for the job's one node, revoked when the job ended"

        # Ended: refused at once by the metadata service, within the cache TTL elsewhere.
        as_job_md = metadata_pb2_grpc.MetadataServiceStub(open_channel(md.address, token=token))
        try:
            as_job_md.GetJob(m.GetJobRequest(job_id=job.id))
            raise AssertionError("the ended job's token still works on the metadata service")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        as_job_cache = cache_pb2_grpc.CacheServiceStub(open_channel(cache.address, token=token))
        as_job_agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(open_channel(agent_proc.address, token=token))
        calls = {
            "cache": lambda: as_job_cache.Stats(cache_pb2.StatsRequest(job_id=job.id)),
            "agent": lambda: as_job_agent.GetDirective(w.GetDirectiveRequest(job_id=job.id)),
        }
        ended_at = time.monotonic()
        for where, call in calls.items():
            while True:
                try:
                    call()
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                        break
                assert time.monotonic() - ended_at < CACHE_S + 3, f"the ended job's token still works on the {where}"
                time.sleep(0.1)
        admin.CancelJob(scheduler_pb2.CancelJobRequest(job_id=victim.id))

