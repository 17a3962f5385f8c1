"""An elastic job resized 4 -> 2 -> 4 GPUs by the policy (pollux) resumes from its checkpoint
each time: its progress never goes back by more than one checkpoint interval."""

from __future__ import annotations

import re
import threading

from silod.v1 import common_pb2
from tests.e2e.harness import wait_until

STEP_S = 0.05
CHECKPOINT_EVERY_S = 1.0
# pollux picks the batch size (hundreds of samples per step here, ~15,000 samples/s on 4 GPUs):
# a few times what the job does before it grows back (~40,000 on a loaded 2-core machine).
BUDGET = 150_000


class ProgressWatcher:
    """Polls the job's progress as the scheduler records it (rank 0's reports) in the background."""

    def __init__(self, cluster, job_id: str) -> None:  # type: ignore[no-untyped-def]
        self.samples: list[int] = []
        self.last_state = common_pb2.JOB_STATE_UNSPECIFIED
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(cluster, job_id), daemon=True)
        self._thread.start()

    def _run(self, cluster, job_id: str) -> None:  # type: ignore[no-untyped-def]
        while not self._stop.is_set():
            job = cluster.job(job_id)
            self.samples.append(job.progress.samples_done)
            self.last_state = job.state
            if job.state in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED):
                return
            self._stop.wait(0.1)

    def abandon(self) -> None:
        """The test failed before the job finished: do not wait for the terminal state."""
        self._stop.set()

    def stop(self) -> list[int]:
        """The series up to the watcher's own sight of the terminal state.

        The caller usually learns that the job finished from another poll; stopping the watcher
        at once could cut its series before its last read, which holds the final progress (the
        scheduler records it before the terminal state). So let it read until it sees the
        terminal state itself, and stop it early only when the job never got there."""
        self._thread.join(30)
        self._stop.set()
        self._thread.join(30)
        return self.samples


def test_policy_shrinks_and_grows_an_elastic_job_which_resumes_each_time(make_cluster) -> None:  # type: ignore[no-untyped-def]
    # pollux with no restart cost: an elastic job alone gets the whole node; a second job makes
    # it shrink to share (p = -1 favours giving every job GPUs); alone again, it grows back.
    cluster = make_cluster("sqlite", nodes=1, policy="pollux", restart_cost_s=0.0)
    env = {"SILOD_CHECKPOINT_EVERY_S": str(CHECKPOINT_EVERY_S)}
    # Its owner lets the batch grow (as far as cifar10's profile goes): at a fixed batch of 32 a
    # fourth GPU gains pollux too little to grow the job.
    elastic = cluster.submit("elastic", 1, 4, samples=BUDGET, step_s=STEP_S, max_batch_size=4096, env=env)
    watcher = ProgressWatcher(cluster, elastic)
    try:
        def world_sizes() -> list[int]:
            sizes: list[int] = []
            for generation in sorted({g for j, _, g, _ in cluster.agents["n0"].launches() if j == elastic}):
                size = len([1 for j, _, g, _ in cluster.agents["n0"].launches() if j == elastic and g == generation])
                if not sizes or sizes[-1] != size:
                    sizes.append(size)
            return sizes

        wait_until(lambda: world_sizes() == [4] and cluster.job(elastic).progress.samples_done > 0, timeout=90,
                   what="the elastic job running on 4 GPUs")
        competitor = cluster.submit("rigid", 2, 2, samples=15_000, step_s=STEP_S, max_batch_size=4096, env=env)
        wait_until(lambda: world_sizes()[:2] == [4, 2], timeout=90, what="the elastic job shrunk to 2 GPUs")
        wait_until(lambda: cluster.job(competitor).state == common_pb2.JOB_STATE_SUCCEEDED, timeout=90,
                   what="the competing job finished")
        wait_until(lambda: world_sizes() == [4, 2, 4], timeout=90, what="the elastic job grown back to 4 GPUs")
        done = cluster.wait_terminal([elastic], timeout=120)[elastic]
    except BaseException:
        watcher.abandon()
        raise
    finally:
        series = watcher.stop()
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED, done.message
    assert done.progress.samples_done == BUDGET

    # Each generation resumed exactly where the previous one's last checkpoint left it.
    resumes = cluster.resumes(elastic)
    saves = cluster.checkpoint_history(elastic)
    assert [g for g, _, _ in resumes] == [1, 2, 3]
    assert resumes[0][1] == 0
    for generation, resumed_at, _ in resumes[1:]:
        previous = [s for s in saves if s["generation"] == generation - 1]
        assert previous, f"generation {generation - 1} checkpointed before it was stopped"
        assert resumed_at == previous[-1]["samples_done"] > 0

    # Progress as recorded never went back by more than what one checkpoint interval processes
    # at the largest batch any generation ran with (the batch each launch got is in its log).
    batches = [int(b) for b in re.findall(r'"SILOD_BATCH_SIZE": "(\d+)"', cluster.agents["n0"].log(elastic, 0))]
    assert len(batches) == 3
    interval_samples = CHECKPOINT_EVERY_S / STEP_S * max(batches)
    # The first read that shows the job finished already holds its final progress: users of
    # `silod watch` never see a finished job short of its budget.
    assert watcher.last_state == common_pb2.JOB_STATE_SUCCEEDED
    assert len(series) > 20 and series[-1] == BUDGET
    high = 0
    for value in series:
        assert value >= high - interval_samples, f"progress fell from {high} to {value}"
        high = max(high, value)
