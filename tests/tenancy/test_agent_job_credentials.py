"""The worker agent's side of job credentials, with a real `silod worker-agent` (auth on) beside an
in-process metadata service and the scripted AllocationService (tests/worker_agent/conftest.py):
a rank the metadata service will mint no credential for is not launched (exit 127, the reason in
its log); once the latest plan places the job on the node, its ranks there share one minted job
credential, and none of them sees the cluster token."""

from __future__ import annotations

import sys
from pathlib import Path

from silod.v1 import access_pb2 as a, allocation_pb2, metadata_pb2 as m, plan_pb2

from tests.metadata.metadata_samples import training_spec
from tests.worker_agent.conftest import allocation, assignment, metadata, node_plan, start_agent, wait_until

__all__ = ["allocation", "metadata", "start_agent"]  # the fixtures, used by name below

CLUSTER_TOKEN = "cluster-secret-of-the-agent"
# Says its credential in its log (a contained rank writes nothing outside its own directories).
WRITE_TOKEN = "import os, time; print('token:', os.environ.get('SILOD_AUTH_TOKEN', '-'), flush=True); time.sleep(0.5)"


def _exited(allocation, job: str, generation: int) -> list[allocation_pb2.TaskReport]:  # type: ignore[no-untyped-def]
    """The last EXITED report of each rank of the generation (an exit is repeated until acknowledged)."""
    return list({t.rank: t for t in allocation.task_reports() if t.job_id == job and t.generation == generation
                 and t.phase == allocation_pb2.TASK_PHASE_EXITED}.values())


def test_ranks_get_a_job_credential_or_are_not_launched(metadata, allocation, start_agent, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    agent = start_agent("--auth-token", CLUSTER_TOKEN, gpus=2)
    job = metadata.stub.CreateJob(m.CreateJobRequest(spec=training_spec(tenant="vision"))).id
    command = [sys.executable, "-c", WRITE_TOKEN]

    def seen() -> list[str]:
        return [line.split(" ", 1)[1] for rank in (0, 1) if (agent.work_dir / "jobs" / job / f"rank-{rank}.log").exists()
                for line in agent.log(job, rank).splitlines() if line.startswith("token: ")]

    # No plan places the job on this node: no credential, so no launch.
    allocation.push(node_plan(agent.node, 1, assignment(job, 0, 1, [0], generation=1, command=command)))
    failed = wait_until(lambda: _exited(allocation, job, 1), what="the refused rank reported")[0]
    assert failed.exit_code == 127
    assert "no job credential: PERMISSION_DENIED" in agent.log(job, 0)
    assert not seen(), "the rank was not started"

    # Placed: both ranks on this node get the job's credential, one for the node.
    try:
        latest = metadata.stub.GetLatestPlan(m.GetLatestPlanRequest()).version
    except Exception:  # noqa: BLE001 - none yet
        latest = 0
    metadata.stub.CommitPlan(m.CommitPlanRequest(plan=plan_pb2.AllocationPlan(version=latest + 1, jobs=[
        plan_pb2.JobAllocation(job_id=job, generation=2,
                               placements=[plan_pb2.GpuPlacement(node=agent.node, gpu_indices=[0, 1])])])))
    allocation.push(node_plan(agent.node, 2, *(assignment(job, r, 2, [r], generation=2, command=command)
                                               for r in (0, 1))))
    done = wait_until(lambda: len(_exited(allocation, job, 2)) == 2 and _exited(allocation, job, 2),
                      what="both ranks done")
    assert [t.exit_code for t in done] == [0, 0], agent.log(job, 0)
    tokens = seen()
    assert len(tokens) == 2 and len(set(tokens)) == 1, tokens
    assert CLUSTER_TOKEN not in tokens
    principal = metadata.stub.ResolveCredential(a.ResolveCredentialRequest(token=tokens[0])).principal
    assert (principal.kind, principal.name) == (a.PRINCIPAL_KIND_JOB, job)
    assert len(metadata.stub.ListCredentials(a.ListCredentialsRequest(kind=a.PRINCIPAL_KIND_JOB, name=job))
               .credentials) == 1
