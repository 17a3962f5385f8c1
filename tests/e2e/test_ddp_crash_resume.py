"""A rigid 4-rank DDP job (examples/train_ddp_digits.py) on two nodes under the real scheduler:
one rank is killed with SIGKILL mid-epoch; the scheduler restarts every rank from the last
checkpoint (a new generation), the sampler resumes at the checkpoint's position, and the job
ends with exactly the parameters of an uninterrupted run of the same job (bit-identical on CPU:
same world size, same order of samples, gloo's reductions in the same order)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from silod.v1 import common_pb2, metadata_pb2, scheduler_pb2
from tests.cache_server.harness import register
from tests.e2e.harness import wait_until

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp_digits.py"
EPOCHS = 2


def _lines(cluster, job_id: str, prefix: str) -> list[str]:  # type: ignore[no-untyped-def]
    found = []
    for agent in cluster.agents.values():
        for log in (agent.work_dir / "jobs" / job_id).glob("rank-*.log"):
            found += [line for line in log.read_text(errors="replace").splitlines() if line.startswith(prefix)]
    return found


def _steps(cluster, job_id: str) -> list[dict]:  # type: ignore[no-untyped-def]
    return [json.loads(line[5:]) for line in _lines(cluster, job_id, "step {")]


def _submit(cluster, name: str) -> str:  # type: ignore[no-untyped-def]
    spec = common_pb2.JobSpec(
        name=name, min_gpus=4, max_gpus=4, batch_size=64, epochs=EPOCHS, dataset="crash-digits",
        command=[sys.executable, str(EXAMPLE)],
        env={"SILOD_EXAMPLE_STEP_SLEEP_S": "0.05", "SILOD_CHECKPOINT_EVERY_S": "1"},
    )
    return cluster.jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30).id


def test_a_killed_rank_restarts_the_job_from_its_checkpoint_to_the_same_parameters(make_cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "digits"
    cluster = make_cluster("sqlite", nodes=2, gpus_per_node=2, read_paths=(store,))
    subprocess.run([sys.executable, str(EXAMPLE), "prepare", str(store)], check=True, capture_output=True, timeout=120)
    register(cluster.metadata.address, "crash-digits", f"file://{store}")

    reference = _submit(cluster, "uninterrupted")
    assert cluster.wait_terminal([reference], timeout=240)[reference].state == common_pb2.JOB_STATE_SUCCEEDED
    crashed = _submit(cluster, "crashed")
    checkpoints = cluster.checkpoints / crashed / "checkpoints.jsonl"
    wait_until(lambda: checkpoints.exists() and any(json.loads(line)["steps_done"] >= 8
                                                   for line in checkpoints.read_text().splitlines()),
               120, "a checkpoint after a few steps")
    victim = next(t for agent in cluster.agents.values() for t in agent.tasks()
                  if t.job_id == crashed and t.rank == 1 and t.pid)
    os.kill(victim.pid, signal.SIGKILL)
    done = cluster.wait_terminal([crashed], timeout=240)[crashed]
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED, done.message
    events = cluster.md.ListJobEvents(metadata_pb2.ListJobEventsRequest(job_id=crashed), timeout=10).events
    assert any("rank 1 (generation 1)" in e.message and "was killed (exit 137); restarting every rank from the "
               "last checkpoint (1 of 3)" in e.message for e in events), [e.message for e in events]

    # Generation 2 started every rank again, at the last checkpoint's position.
    steps = _steps(cluster, crashed)
    generations = sorted({s["generation"] for s in steps})
    assert generations == [1, 2]
    resumed = [line for line in _lines(cluster, crashed, "") if "resumed from the checkpoint at step" in line]
    assert len(resumed) == 4, resumed
    first_again = min(s["step"] for s in steps if s["generation"] == 2)
    saved = [json.loads(line) for line in checkpoints.read_text().splitlines()
             if json.loads(line)["generation"] == 1]
    assert first_again == saved[-1]["steps_done"] + 1, "resumed right after the last checkpoint of generation 1"
    # Counting generation 1 up to that checkpoint and generation 2 after it, every sample of
    # every epoch once: the sampler's position came back with the checkpoint.
    kept = [s for s in steps if (s["generation"] == 1 and s["step"] < first_again) or s["generation"] == 2]
    for epoch in range(EPOCHS):
        positions = sorted(p for s in kept if s["epoch"] == epoch for p in s["read"])
        assert positions == list(range(1797)), f"epoch {epoch}"

    # The same parameters as the uninterrupted run, bit for bit.
    final = {line.split(" hash ")[1] for line in _lines(cluster, crashed, "done rank")}
    expected = {line.split(" hash ")[1] for line in _lines(cluster, reference, "done rank")}
    assert len(expected) == 1 and final == expected
