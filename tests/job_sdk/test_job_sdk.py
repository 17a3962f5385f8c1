"""silod.job off the cluster (the twin) and the example script, as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import silod.job
from silod.job import LocalContext
from tests.support.procs import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "train_cifar_like.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_init_off_cluster_returns_the_twin(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("SILOD_JOB_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        _check_twin(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)  # init() installed the SDK's handler in pytest


def _check_twin(tmp_path: Path) -> None:
    ctx = silod.job.init()
    assert isinstance(ctx, LocalContext)
    assert (ctx.rank, ctx.world_size) == (0, 1) and ctx.checkpoint_dir == Path("checkpoints")
    assert ctx.load_checkpoint() is None and not ctx.should_checkpoint()
    assert ctx.save_checkpoint({"step": 3, "weights": [1.0, 2.0]})
    assert ctx.load_checkpoint() == {"step": 3, "weights": [1.0, 2.0]}
    # no temp file left; the save is recorded next to the checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint.pt", "checkpoints.jsonl"]
    [record] = ctx.checkpoint_history()
    assert (record["generation"], record["rank"], record["pid"]) == (0, 0, os.getpid())
    ctx.report(samples=10, steps=1, epoch=0, step_time_s=0.1, fraction_done=0.5)
    assert (ctx.samples_done, ctx.steps_done) == (10, 1)
    ctx.done()


def test_example_runs_standalone_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    run = lambda steps: subprocess.run(  # noqa: E731
        [sys.executable, str(EXAMPLE), "--steps", str(steps)], cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=60,
    )
    first = run(20)
    assert first.returncode == 0, first.stderr
    assert "done at step 20" in first.stdout and "resumed" not in first.stdout
    assert (tmp_path / "checkpoints" / "checkpoint.pt").is_file()
    second = run(30)
    assert second.returncode == 0, second.stderr
    assert "resumed from checkpoint at step 20" in second.stdout and "done at step 30" in second.stdout
    assert "silod.job[local]: samples=" in second.stderr  # the twin logs progress


def test_sigterm_makes_the_example_checkpoint_and_exit_zero(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--steps", "100000", "--emulated-gpu-s", "0.01"],
            cwd=tmp_path, env=_env(), stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "step 10 " not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    text = log.read_text()
    assert "checkpointed at step" in text
    saved = int(text.split("checkpointed at step ")[1].split(";")[0])
    assert saved >= 10
    again = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(saved + 5)], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=60)
    assert f"resumed from checkpoint at step {saved}" in again.stdout and again.returncode == 0


def test_rank_whose_agent_died_stops_checkpointing_and_is_asked_to_exit(tmp_path: Path) -> None:
    from silod.job import ClusterContext

    # A stand-in for the agent: only its process's existence (pid and start time) matters here.
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        start_time = Path(f"/proc/{agent.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        previous = signal.getsignal(signal.SIGTERM)
        try:
            ctx = ClusterContext({"SILOD_JOB_ID": "job-x", "SILOD_RANK": "0", "SILOD_GENERATION": "3",
                                  "SILOD_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "SILOD_AGENT_PID": str(agent.pid),
                                  "SILOD_AGENT_START_TIME": start_time})
        finally:
            signal.signal(signal.SIGTERM, previous)  # ClusterContext installed the SDK's handler in pytest
        assert not ctx.agent_lost and not ctx.should_checkpoint()
        ctx.report(samples=64, steps=2)
        assert ctx.save_checkpoint({"samples": 64})
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 10
        while not ctx.agent_lost and time.monotonic() < deadline:  # looked at every AGENT_CHECK_INTERVAL_S
            time.sleep(0.05)
        assert ctx.agent_lost and ctx.should_checkpoint()
        assert not ctx.save_checkpoint({"samples": 128})
        assert ctx.load_checkpoint() == {"samples": 64}
        assert [(r["generation"], r["samples_done"]) for r in ctx.checkpoint_history()] == [(3, 64)]
    finally:
        agent.kill()
        agent.wait()


def test_a_sigterm_arriving_as_the_rank_exits_does_not_turn_its_exit_0_into_143(tmp_path: Path) -> None:
    # The agent's stop can land after the rank honoured the checkpoint directive and returned:
    # Python has by then put SIGTERM back to its default, which kills. The object below sends the
    # signal from the interpreter's teardown of __main__, the latest point Python code runs.
    script = tmp_path / "late_sigterm.py"
    script.write_text(
        "import os, signal, time\n"
        "import silod.job\n"
        "ctx = silod.job.init()\n"
        "class Late:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(0.2)\n"
        "        print('teardown outlived the signal', flush=True)\n"
        "late = Late()\n"
        "ctx.done()\n"
        "print('returned', flush=True)\n")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr)
    assert run.stdout.splitlines()[-2:] == ["returned", "teardown outlived the signal"]
