"""The scheduler cut off from the metadata store: heartbeats it could not see are not the nodes'
fault, and its first round once the store answers again must not requeue anything on them."""

from __future__ import annotations

import time

import grpc

from silod.v1 import allocation_pb2, common_pb2, metadata_pb2
from tests.scheduler_live.harness import wait_for


def test_the_first_round_after_a_partition_keeps_the_nodes_it_could_not_hear(make_cluster) -> None:
    cluster = make_cluster(node_timeout_s=2.0, metadata_link=True)
    cluster.add_node("n1", gpus=1)
    job = cluster.submit("steady", min_gpus=1, max_gpus=1)
    plan = cluster.round()
    entry = next(e for e in plan.jobs if e.job_id == job.id)
    cluster.report("n1", plan.version, allocation_pb2.TaskReport(
        job_id=job.id, rank=0, generation=entry.generation, phase=allocation_pb2.TASK_PHASE_RUNNING, gpu_indices=[0]))
    assert cluster.state(job.id) == common_pb2.JOB_STATE_RUNNING
    cluster.heartbeat("n1")

    # The whole control plane is cut off from the node: the scheduler cannot reach the store and
    # the node's heartbeats stop (they could not get through either), for 3x the node timeout.
    cluster.link.cut()
    time.sleep(6.0)
    cluster.link.restore()

    # The next round (forced at once, before the node's heartbeats resume) sees a node whose
    # last heartbeat is 6 s old; it must count the blind span, not requeue the job.
    def a_round():  # type: ignore[no-untyped-def]
        try:
            return cluster.scheduler.submit(cluster.core.run_round("after the partition")) or True
        except grpc.RpcError:
            return False  # the channel to the store is still reconnecting

    wait_for(a_round, timeout=30, what="a round that reaches the store again")
    cluster.heartbeat("n1")
    events = cluster.md.ListJobEvents(metadata_pb2.ListJobEventsRequest(job_id=job.id)).events
    moves = [common_pb2.JobState.Name(e.to_state) for e in events if e.type == "state"]
    assert moves[-1] == "JOB_STATE_RUNNING", moves
    assert "JOB_STATE_PENDING" not in moves[moves.index("JOB_STATE_RUNNING"):], moves
    latest = cluster.latest()
    assert [(p.node, list(p.gpu_indices)) for e in latest.jobs if e.job_id == job.id for p in e.placements] \
        == [("n1", [0])]
