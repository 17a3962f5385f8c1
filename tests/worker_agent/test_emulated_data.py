"""The emulated job reading a registered dataset through silod.data under a real agent and a real
cache server: its reads go through the cache (cold in epoch 0, warm after) and it reports the
hit ratio it sees."""

from __future__ import annotations

import random

import grpc

from silod.v1 import allocation_pb2, cache_pb2, cache_pb2_grpc
from tests.cache_server.harness import make_dataset, register
from tests.support.procs import start_service
from tests.worker_agent.conftest import assignment, node_plan, wait_until

FILES = 240
EPOCHS = 3


def test_emulated_job_reads_its_dataset_through_the_cache_and_reports_the_hit_ratio(  # type: ignore[no-untyped-def]
    metadata, allocation, start_agent, tmp_path
) -> None:
    root = tmp_path / "store"
    make_dataset(root, FILES, 2000, seed=5)
    register(metadata.address, "emu-data", f"file://{root}")
    with start_service("cache-server", "--metadata-address", metadata.address, "--disk-cache-dir",
                       str(tmp_path / "disk"), "--memory-cache-bytes", "0", "--no-fsync",
                       "--log-level", "warning", workdir=tmp_path / "cache-proc") as cache:
        agent = start_agent("--cache-address", cache.address)
        job = "job-data"
        task = assignment(job, 0, 1, [0], step_s=0.05, batch=8)
        task.spec.dataset = "emu-data"
        task.spec.ClearField("sample_budget")
        task.spec.epochs = EPOCHS  # an epoch is one pass over the dataset's 240 samples
        allocation.push(node_plan(agent.node, 1, task))

        def final():  # type: ignore[no-untyped-def]
            reports = [t for t in allocation.task_reports() if t.job_id == job]
            return reports[-1] if reports and reports[-1].phase == allocation_pb2.TASK_PHASE_EXITED else None

        done = wait_until(final, timeout=120, what="the job finished")
        assert done.exit_code == 0, agent.log(job, 0)
        assert done.progress.samples_done == EPOCHS * FILES and done.progress.epochs_done == EPOCHS

        # Every sample read went through the cache server: each object fetched once, then hits. The
        # job reads a step ahead, so the first step of an epoch is asked for while the last one of
        # the epoch before may still be fetching: an object in both (epochs are shuffled) can be
        # asked for twice before it lands, and each such ask is a miss (seen on a loaded machine).
        stats = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address)).Stats(
            cache_pb2.StatsRequest(job_id=job), timeout=5).jobs[0]
        assert stats.hits + stats.misses == EPOCHS * FILES
        assert FILES <= stats.misses <= FILES + _keys_at_epoch_boundaries(batch=8), (stats.hits, stats.misses)

        # What the job reported: cold in the first epoch, warm from the second one on.
        seen = [(t.progress.epochs_done, t.progress.cache_hit_ratio) for t in allocation.task_reports()
                if t.job_id == job and t.progress.samples_done > 0]
        cold = [ratio for epoch, ratio in seen if epoch == 0]
        warm = [ratio for epoch, ratio in seen if epoch >= 2]
        assert cold and max(cold) < 0.2, seen
        assert warm and max(warm) > 0.9, seen
        assert done.progress.cache_hit_ratio > 0.9
        assert done.progress.throughput_samples_per_s > 0
        assert "emulated: epoch 0 read; recent cache hit ratio" in agent.log(job, 0)


def _keys_at_epoch_boundaries(batch: int) -> int:
    """Objects in both the last step of an epoch and the first of the next, in the emulated
    job's order (silod/jobs/emulated.py: epoch e reads range(FILES) shuffled by Random(e))."""
    orders = []
    for epoch in range(EPOCHS):
        order = list(range(FILES))
        random.Random(epoch).shuffle(order)
        orders.append(order)
    return sum(len(set(orders[e][-batch:]) & set(orders[e + 1][:batch])) for e in range(EPOCHS - 1))
