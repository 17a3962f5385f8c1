"""A job's own code trying what its SILOD_AUTH_TOKEN allows (tests/tenancy/test_job_credentials_processes.py).

Run by a worker agent as a rank. It does what a job needs (manifest reads, leases of its own
job, progress and directives), then tries to act as the scheduler, on another job and on other
tenants' jobs, and prints every outcome (a status code name) with its environment on one line of
its log, after ``silod-test-result: `` (:data:`MARK`; a contained rank writes nowhere else the
test could read).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import grpc

import silod.job
from silod.rpc.channels import open_channel
from silod.v1 import (
    allocation_pb2_grpc,
    cache_pb2,
    cache_pb2_grpc,
    common_pb2,
    metadata_pb2 as m,
    metadata_pb2_grpc,
    plan_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_agent_pb2 as w,
    worker_agent_pb2_grpc,
)
from silod.v1 import access_pb2

MARK = "silod-test-result: "  # tests/tenancy/job_results.py reads it back
env = os.environ
token, job, victim = env["SILOD_AUTH_TOKEN"], env["SILOD_JOB_ID"], env["VICTIM"]
rank, generation = int(env["SILOD_RANK"]), int(env["SILOD_GENERATION"])
results: dict[str, str] = {}


def attempt(name: str, call) -> object:  # type: ignore[no-untyped-def]
    try:
        answer = call()
        if hasattr(answer, "__next__"):  # a server stream: its first message or its error
            answer = next(answer)
    except grpc.RpcError as exc:
        results[name] = exc.code().name
        return None
    results[name] = "OK"
    return answer


md = metadata_pb2_grpc.MetadataServiceStub(open_channel(env["SILOD_METADATA_ADDR"], token=token))
scheduler = open_channel(env["SCHEDULER_ADDR"], token=token)
jobs, alloc = scheduler_pb2_grpc.JobServiceStub(scheduler), allocation_pb2_grpc.AllocationServiceStub(scheduler)
cache = cache_pb2_grpc.CacheServiceStub(open_channel(env["SILOD_CACHE_ADDR"], token=token))
agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(open_channel(env["SILOD_AGENT_ADDR"], token=token))

# What a job needs: its dataset's manifest, leases of its own job, progress and directives.
listed = attempt("own: ListDatasetObjects", lambda: md.ListDatasetObjects(m.ListDatasetObjectsRequest(name="imgs")))
attempt("own: GetDataset", lambda: md.GetDataset(m.GetDatasetRequest(name="imgs")))
keys = [o.key for o in listed.objects][:4] if listed is not None else ["x"]
lease = attempt("own: Lease", lambda: cache.Lease(cache_pb2.LeaseRequest(job_id=job, dataset="imgs", keys=keys)))
if lease is not None:
    results["own: leased bytes"] = str(sum(len(Path(o.path).read_bytes()) for o in lease.objects))
    attempt("own: ReleaseLease", lambda: cache.ReleaseLease(cache_pb2.ReleaseLeaseRequest(lease_id=lease.lease_id)))
attempt("own: Read", lambda: cache.Read(cache_pb2.ReadRequest(job_id=job, dataset="imgs", keys=keys[:1])))
attempt("own: ReportProgress", lambda: agent.ReportProgress(w.ReportProgressRequest(
    job_id=job, rank=rank, generation=generation, progress=common_pb2.JobProgress(samples_done=1))))
attempt("own: GetDirective", lambda: agent.GetDirective(w.GetDirectiveRequest(job_id=job, rank=rank,
                                                                             generation=generation)))
deadline = time.monotonic() + 30  # RUNNING once the agent reported the rank running
while md.GetJob(m.GetJobRequest(job_id=job)).state != common_pb2.JOB_STATE_RUNNING and time.monotonic() < deadline:
    time.sleep(0.1)

# (a) the scheduler's part
evil = plan_pb2.AllocationPlan(version=1_000, policy="attacker", jobs=[plan_pb2.JobAllocation(
    job_id=job, placements=[plan_pb2.GpuPlacement(node="n0", gpu_indices=[0, 1])])])
attempt("AllocationService.CommitPlan", lambda: alloc.CommitPlan(m.CommitPlanRequest(plan=evil)))
attempt("MetadataService.CommitPlan", lambda: md.CommitPlan(m.CommitPlanRequest(plan=evil)))
attempt("AllocationService.GetLatestPlan", lambda: alloc.GetLatestPlan(m.GetLatestPlanRequest()))
attempt("MetadataService.TransitionJob own", lambda: md.TransitionJob(m.TransitionJobRequest(
    job_id=job, expected_state=common_pb2.JOB_STATE_RUNNING, new_state=common_pb2.JOB_STATE_SUCCEEDED)))
attempt("MetadataService.MintJobCredential", lambda: md.MintJobCredential(
    access_pb2.MintJobCredentialRequest(job_id=victim, node="n0")))
attempt("MetadataService.ResolveCredential", lambda: md.ResolveCredential(
    access_pb2.ResolveCredentialRequest(token=token)))
# (b) another job
attempt("JobService.CancelJob", lambda: jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=victim)))
attempt("MetadataService.TransitionJob", lambda: md.TransitionJob(m.TransitionJobRequest(
    job_id=victim, expected_state=common_pb2.JOB_STATE_RUNNING, new_state=common_pb2.JOB_STATE_CANCELLED)))
attempt("MetadataService.GetJob", lambda: md.GetJob(m.GetJobRequest(job_id=victim)))
attempt("WorkerAgentService.GetDirective", lambda: agent.GetDirective(w.GetDirectiveRequest(job_id=victim)))
# (c) another job's samples
attempt("CacheService.Lease", lambda: cache.Lease(cache_pb2.LeaseRequest(job_id=victim, dataset="imgs", keys=keys)))
attempt("CacheService.Read", lambda: cache.Read(cache_pb2.ReadRequest(job_id=victim, dataset="imgs", keys=keys)))
attempt("CacheService.Prefetch", lambda: cache.Prefetch(cache_pb2.PrefetchRequest(job_id=victim, dataset="imgs")))
attempt("CacheService.Stats", lambda: cache.Stats(cache_pb2.StatsRequest()))
# (d) other tenants' jobs
attempt("JobService.ListJobs", lambda: jobs.ListJobs(m.ListJobsRequest()))
attempt("JobService.ListJobs speech", lambda: jobs.ListJobs(m.ListJobsRequest(tenant="speech")))
attempt("MetadataService.ListJobs", lambda: md.ListJobs(m.ListJobsRequest()))
attempt("JobService.SubmitJob", lambda: jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=common_pb2.JobSpec(
    name="spawn", tenant="vision", application="x", min_gpus=1, max_gpus=1, batch_size=1, sample_budget=1))))

print(MARK + json.dumps({"results": results, "env": dict(env),
                         "environ": Path("/proc/self/environ").read_bytes().decode(errors="replace")}), flush=True)
ctx = silod.job.init()
ctx.report(samples=int(env["SILOD_SAMPLE_BUDGET"]), steps=1, step_time_s=0.01)
ctx.should_checkpoint()
ctx.done()

