"""Per-rank CPU and memory requests in the live scheduler: the nodes' and jobs' fields in the
policy's view, a round that places ranks only where they fit, the release hold, and SubmitJob
refusing a rank no live training node could ever hold."""

from __future__ import annotations

import grpc

from scheduler.invariants import plan_problems
from scheduler.live import convert
from scheduler.live.releases import hold_releases
from scheduler.policy import NodeInfo, Plan
from silod.v1 import common_pb2, metadata_pb2
from tests.metadata.metadata_harness import assert_rpc_error
from tests.scheduler.conftest import allocation, make_job, make_snapshot

GiB = 2**30
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def add_node(cluster, name: str, gpus: int = 4, **spec: object) -> None:
    cluster.md.UpsertNode(metadata_pb2.UpsertNodeRequest(spec=common_pb2.NodeSpec(
        name=name, gpus=gpus, gpu_model="emulated", agent_address=f"{name}.local:7000", **spec)))
    cluster.md.Heartbeat(metadata_pb2.HeartbeatRequest(node=name))


def test_node_info_takes_what_the_node_reports_and_0_as_nothing_to_give() -> None:
    node = convert.node_info(common_pb2.Node(spec=common_pb2.NodeSpec(name="n", gpus=4, cpus=31.5, memory_bytes=2**37)))
    assert (node.cpus, node.memory_bytes) == (31.5, 2**37)
    old = convert.node_info(common_pb2.Node(spec=common_pb2.NodeSpec(name="n", gpus=4)))
    assert (old.cpus, old.memory_bytes) == (0.0, 0.0)


def test_a_round_places_ranks_only_where_their_cores_and_memory_fit(cluster) -> None:
    add_node(cluster, "n0-old", gpus=4)  # an older agent: reports neither
    add_node(cluster, "n1-small", gpus=4, cpus=4, memory_bytes=64 * GiB)
    add_node(cluster, "n2-big", gpus=4, cpus=32, memory_bytes=256 * GiB, runtime="contained")
    heavy = cluster.submit("heavy", 2, 2, cpus_per_rank=4, memory_bytes_per_rank=8 * GiB)
    plain = cluster.submit("plain", 4, 4)
    snap, _ = cluster.scheduler.submit(cluster.core.snapshot())
    nodes = {n.name: n for n in snap.nodes}
    assert (nodes["n0-old"].cpus, nodes["n2-big"].cpus, nodes["n2-big"].memory_bytes) == (0.0, 32.0, 256 * GiB)
    job = next(j for j in snap.jobs if j.job_id == heavy.id)
    assert (job.cpus_per_rank, job.memory_bytes_per_rank) == (4.0, 8 * GiB)
    plan = cluster.round()
    placed = {entry.job_id: {p.node for p in entry.placements} for entry in plan.jobs}
    assert placed[heavy.id] == {"n2-big"}  # n1-small has 4 cores: one rank, not two
    assert placed[plain.id]  # a job without requests is placed, the old agent's node included


def test_a_job_kept_on_its_old_gpus_keeps_its_cores_and_the_newcomer_waits() -> None:
    nodes = (NodeInfo("n0", 8, cpus=8), NodeInfo("n1", 8, cpus=8))
    jobs = [make_job("old", gpus=2, cpus_per_rank=3), make_job("new", gpus=2, cpus_per_rank=3, submit=1)]
    current = Plan({"old": allocation(("n0", (0, 1)))})
    snap = make_snapshot(nodes, jobs, current=current)
    # The policy moved "old" to n1 and gave n0 to "new"; n1's GPUs are not released yet, so
    # "old" stays on n0 and "new" would bring n0 to 12 of its 8 cores.
    plan = Plan({"old": allocation(("n1", (0, 1))), "new": allocation(("n0", (2, 3)))})
    held = hold_releases(plan, current, {("n1", 0): "gone", ("n1", 1): "gone"}, snap)
    assert set(held.allocations) == {"old"} and held.get("old").placement == (("n0", (0, 1)),)
    assert plan_problems(snap, held) == []
    assert set(hold_releases(plan, current, {("n1", 0): "gone"}).allocations) == {"old", "new"}  # GPUs alone


def test_submit_refuses_a_rank_no_live_training_node_could_hold(cluster) -> None:
    add_node(cluster, "n1", gpus=4, cpus=16, memory_bytes=64 * GiB)
    add_node(cluster, "n2", gpus=4, cpus=64, memory_bytes=16 * GiB)
    add_node(cluster, "i1", gpus=4, cpus=512, memory_bytes=1024 * GiB, pool=common_pb2.NODE_POOL_INFERENCE)
    cluster.round()
    too_many = assert_rpc_error(lambda: cluster.submit("c", cpus_per_rank=65), PRECONDITION, "spec.cpus_per_rank")
    assert "65 cores per rank" in too_many.details() and "64" in too_many.details()
    assert_rpc_error(lambda: cluster.submit("m", memory_bytes_per_rank=65 * GiB), PRECONDITION, "spec.memory_bytes_per_rank")
    # Each fits some node, but no node has both.
    both = assert_rpc_error(lambda: cluster.submit("b", cpus_per_rank=32, memory_bytes_per_rank=32 * GiB), PRECONDITION,
                            "spec.cpus_per_rank")
    assert "both" in both.details()
    assert cluster.submit("ok", cpus_per_rank=64, memory_bytes_per_rank=16 * GiB).state == common_pb2.JOB_STATE_PENDING
    assert [j.spec.name for j in cluster.jobs.ListJobs(metadata_pb2.ListJobsRequest()).jobs] == ["ok"]


def quiet(cluster) -> None:
    """Nothing lists the nodes in the background from here on: the node watch stops, and
    submissions trigger no rounds (the interval is 60 s)."""
    async def stop_node_watch() -> None:
        cluster.core._node_task.cancel()

    cluster.scheduler.submit(stop_node_watch())
    cluster.core.trigger = lambda reason: None


def test_submit_decides_on_the_nodes_it_holds_and_rereads_only_to_refuse(cluster) -> None:
    add_node(cluster, "n1", gpus=4, cpus=16, memory_bytes=64 * GiB)
    cluster.round()
    quiet(cluster)
    reads = []
    listed = cluster.core.read_rank_room

    async def counted():
        reads.append(1)
        return await listed()

    cluster.core.read_rank_room = counted
    for k in range(3):
        cluster.submit(f"fits-{k}", cpus_per_rank=8, memory_bytes_per_rank=GiB)
    assert reads == []  # no metadata read for a submission the nodes it holds admit
    add_node(cluster, "n2", gpus=4, cpus=96, memory_bytes=64 * GiB)  # joined since the scheduler last listed
    cluster.submit("needs-n2", cpus_per_rank=96)  # the fresh listing before refusing finds it
    assert reads == [1]
    assert_rpc_error(lambda: cluster.submit("never", cpus_per_rank=97), PRECONDITION, "spec.cpus_per_rank")
    assert reads == [1, 1]


def test_submit_accepts_requests_while_no_node_is_known(cluster) -> None:
    assert cluster.submit("early", cpus_per_rank=4096, memory_bytes_per_rank=2**50).state == common_pb2.JOB_STATE_PENDING
