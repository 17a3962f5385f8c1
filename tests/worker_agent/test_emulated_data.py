"""The emulated job reading a registered dataset through silod.data under a real agent and a real
cache server: its reads go through the cache (cold in epoch 0, warm after) and it reports the
hit ratio it sees."""

from __future__ import annotations

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

        # Every sample read went through the cache server: each object fetched once, then hits.
        stats = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address)).Stats(
            cache_pb2.StatsRequest(job_id=job), timeout=5).jobs[0]
        assert (stats.hits + stats.misses, stats.misses) == (EPOCHS * FILES, FILES)

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
