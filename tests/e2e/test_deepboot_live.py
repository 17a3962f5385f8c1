"""DeepBoot on real processes: an elastic job borrows idle inference GPUs, gives them back when
a burst of inference tasks arrives, and finishes from its checkpoints without losing more than
one checkpoint interval of progress."""

from __future__ import annotations

from silod.v1 import common_pb2, metadata_pb2, plan_pb2, scheduler_pb2
from tests.e2e.harness import TERMINAL, held, wait_until
from tests.e2e.test_elastic_resize import ProgressWatcher

STEP_S = 0.05
CHECKPOINT_EVERY_S = 1.0
TASK_S = 4.0
# Enough to outlive the lending and the burst (about 90,000 samples are done by the burst's end on
# a loaded two-core machine; the test checks the job is still running then) and little more: the
# rest is run-to-completion time.
BUDGET = 240_000


def _plans(cluster) -> list[plan_pb2.AllocationPlan]:  # type: ignore[no-untyped-def]
    return list(cluster.md.ListPlans(metadata_pb2.ListPlansRequest(page_size=100), timeout=10).plans)


def _lent(plan: plan_pb2.AllocationPlan, job_id: str) -> int:
    return sum(1 for loan in plan.loans if loan.job_id == job_id)


def test_elastic_job_borrows_inference_gpus_and_returns_them_to_a_burst(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster("sqlite", nodes=1, inference_nodes=2, gpus_per_node=2, policy="deepboot",
                           restart_cost_s=0.0, scheduler_args=("--inference-protect-scale", "0.1"))
    env = {"SILOD_CHECKPOINT_EVERY_S": str(CHECKPOINT_EVERY_S)}
    # A job that lets the policy grow its batch (as far as cifar10's profile goes): a batch fixed
    # at 32 gains too little from a sixth GPU for deepboot to lend any.
    training = cluster.submit("elastic", 1, 6, samples=BUDGET, step_s=STEP_S, max_batch_size=4096, env=env)
    watcher = ProgressWatcher(cluster, training)
    try:
        wait_until(lambda: any(_lent(p, training) > 0 for p in _plans(cluster))
                   and cluster.job(training).state == common_pb2.JOB_STATE_RUNNING,
                   timeout=90, what="the elastic job running on borrowed inference GPUs")
        borrowed = max(_lent(p, training) for p in _plans(cluster))
        assert borrowed >= 2, f"only {borrowed} inference GPUs lent while all four sat idle"

        tasks = []
        for k in range(4):
            spec = common_pb2.JobSpec(name=f"infer-{k}", kind=common_pb2.JOB_KIND_INFERENCE,
                                      application="infer-resnet50-1", min_gpus=1, max_gpus=1,
                                      inference_duration_s=TASK_S)
            tasks.append(cluster.jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30).id)
        finished = cluster.wait_terminal(tasks, timeout=120)
        assert all(j.state == common_pb2.JOB_STATE_SUCCEEDED for j in finished.values()), finished
        # The elastic job lived through the burst (else giving the GPUs back would prove nothing).
        assert cluster.job(training).state not in TERMINAL, "the elastic job ended before the burst did"

        # The burst took every inference GPU: at some plan all four tasks ran and nothing was lent.
        plans = _plans(cluster)
        during = [p for p in plans
                  if sum(1 for r in p.replicas if r.state == plan_pb2.REPLICA_STATE_RUNNING) == len(tasks)]
        assert during, "the four tasks never ran at once"
        assert all(_lent(p, training) == 0 for p in during)
        inference_nodes = {"i0", "i1"}
        for task in tasks:
            placed = {pl.node for p in plans for j in p.jobs if j.job_id == task for pl in j.placements}
            assert placed and placed <= inference_nodes, (task, placed)

        job = cluster.wait_terminal([training], timeout=240)[training]
        assert job.state == common_pb2.JOB_STATE_SUCCEEDED and job.progress.samples_done == BUDGET
    finally:
        samples = watcher.stop()

    # Resizes resumed from the last checkpoint: progress never fell back by more than one interval.
    per_interval = 6 * 32 * CHECKPOINT_EVERY_S / STEP_S  # six GPUs' worth of steps in one interval, upper bound
    drops = [a - b for a, b in zip(samples, samples[1:]) if b < a]
    assert all(d <= per_interval for d in drops), drops
    # AFE: the ranks on the training node survived every resize (one launch per GPU there), while
    # the generation moved on with each loan and reclaim.
    on_training_node = [launch for launch in cluster.agents["n0"].launches() if launch[0] == training]
    assert len(on_training_node) == 2, on_training_node
    assert max(j.generation for p in _plans(cluster) for j in p.jobs if j.job_id == training) >= 2
    # No GPU was ever held by two tasks on any node, pools included.
    for agent in cluster.agents.values():
        history = agent.gpu_history()
        assert history, agent.name
        held(history)  # raises on a double acquire
