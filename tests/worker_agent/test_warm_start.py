"""Warm processes (worker_agent.warm_start): a rank of a job that resizes in place runs in a
process the agent started ahead of need, and looks to its script exactly like a cold start."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from silod.v1 import allocation_pb2
from tests.worker_agent.conftest import assignment, node_plan, wait_until
from worker_agent.warm_start import eligible

EXITED = allocation_pb2.TASK_PHASE_EXITED

# Cheap stand-ins for torch in the preload list: whether the script finds them already imported
# tells a warm start from a cold one.
PRELOAD = "wave,colorsys"

SCRIPT = """\
import json, os, sys
preloaded = "wave" in sys.modules and "colorsys" in sys.modules
with open(os.environ["SILOD_TEST_OUT"], "w") as out:
    json.dump({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(), "pid": os.getpid(),
               "preloaded": preloaded, "rank": os.environ["SILOD_RANK"], "omp": os.environ.get("OMP_NUM_THREADS"),
               "warm": os.environ.get("SILOD_WARM_START"), "comm": open("/proc/self/comm").read().strip()},
              out)
print("hello from the rank", flush=True)
sys.exit(3)
"""


def _warm_pids(agent_pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent_pid and b"worker_agent.warm_process" in cmdline:
            found.add(int(entry))
    return found


def _run(allocation, agent, job: str, version: int, script: Path, out: Path, *, in_place: bool = True,
         env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    a = assignment(job, 0, 1, [0], command=[sys.executable, str(script), "two words", "--flag"])
    a.spec.resize_in_place = in_place
    a.spec.env["SILOD_TEST_OUT"] = str(out)
    a.spec.env.update(env or {})
    allocation.push(node_plan(agent.node, version, a))

    def exited():  # type: ignore[no-untyped-def]
        return next((t for t in allocation.task_reports() if t.job_id == job and t.phase == EXITED), None)

    report = wait_until(exited, timeout=30, what=f"{job} exited")
    return report, json.loads(out.read_text())


def test_an_in_place_jobs_rank_runs_in_a_warm_process_as_if_started_cold(allocation, start_agent, tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "scripts" / "rank.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    # The process runtime, whose ranks share the agent's view of the host: the test reads the
    # rank's host pid and writes where the script says (a contained rank: the next test).
    agent = start_agent("--warm-processes", "1", "--warm-preload", PRELOAD, "--runtime", "process")
    agent_pid = agent.proc.proc.pid
    warm = wait_until(lambda: _warm_pids(agent_pid), what="a warm process")
    assert wait_until(lambda: all(Path(f"/proc/{p}/comm").read_text().strip() == "silod-warm" for p in warm),
                      what="the warm process named")

    report, seen = _run(allocation, agent, "job-warm", 1, script, tmp_path / "warm.json")
    assert seen["pid"] in warm and seen["preloaded"] and seen["warm"] == "1"
    assert seen["comm"] == os.path.basename(sys.executable)[:15]  # as started cold, no longer "silod-warm"
    assert report.exit_code == 3
    assert seen["argv"] == [str(script), "two words", "--flag"]
    assert seen["name"] == "__main__" and seen["path0"] == str(script.parent)
    assert seen["cwd"] == str((agent.work_dir / "jobs" / "job-warm").resolve()) and seen["rank"] == "0"
    log = agent.log("job-warm", 0)
    assert log.startswith("--- silod: generation 1 rank 0") and "hello from the rank" in log
    # The pool starts a replacement.
    replacement = wait_until(lambda: _warm_pids(agent_pid) - warm, what="a replacement warm process")

    # Started cold: a job that does not resize in place, and one whose environment sets a
    # variable read at interpreter start-up (too late for a warm process).
    _, cold = _run(allocation, agent, "job-rigid", 2, script, tmp_path / "rigid.json", in_place=False)
    assert not cold["preloaded"] and cold["pid"] not in replacement and cold["warm"] is None
    _, cold = _run(allocation, agent, "job-arena", 3, script, tmp_path / "arena.json", env={"MALLOC_ARENA_MAX": "2"})
    assert not cold["preloaded"] and cold["pid"] not in replacement
    assert _warm_pids(agent_pid) == replacement  # still idle, unused
    # The thread count is the exception: a warm process applies it when it becomes the rank.
    _, warm_omp = _run(allocation, agent, "job-omp", 4, script, tmp_path / "omp.json", env={"OMP_NUM_THREADS": "1"})
    assert warm_omp["preloaded"] and warm_omp["omp"] == "1" and warm_omp["pid"] in replacement

    # A missing script: the same status and message as a cold start.
    missing = tmp_path / "scripts" / "gone.py"
    a = assignment("job-missing", 0, 1, [1], command=[sys.executable, str(missing)])
    a.spec.resize_in_place = True
    allocation.push(node_plan(agent.node, 5, a))
    report = wait_until(lambda: next((t for t in allocation.task_reports()
                                      if t.job_id == "job-missing" and t.phase == EXITED), None), what="exit")
    assert report.exit_code == 2 and "can't open file" in agent.log("job-missing", 0)


CONTAINED_SCRIPT = """\
import json, os, sys
print("seen:", json.dumps({"preloaded": "wave" in sys.modules and "colorsys" in sys.modules, "uid": os.getuid(),
                           "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "cwd": os.getcwd(),
                           "warm": os.environ.get("SILOD_WARM_START"), "argv": sys.argv[1:]}), flush=True)
"""


def test_a_contained_rank_runs_in_a_warm_process_inside_its_sandbox(allocation, start_agent, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The warm process (root, torch's stand-ins imported) puts itself in the rank's sandbox when it
    # takes the rank: the job's uid, a PID namespace of its own, its own work directory.
    scripts = tmp_path / "scripts"
    scripts.mkdir(mode=0o755)
    (scripts / "rank.py").write_text(CONTAINED_SCRIPT)
    from tests.support.contained import readable

    agent = start_agent("--warm-processes", "1", "--warm-preload", PRELOAD, *readable(scripts))
    warm = wait_until(lambda: _warm_pids(agent.proc.proc.pid), what="a warm process")
    a = assignment("job-cwarm", 0, 1, [0], command=[sys.executable, str(scripts / "rank.py"), "x"])
    a.spec.resize_in_place = True
    allocation.push(node_plan(agent.node, 1, a))
    report = wait_until(lambda: next((t for t in allocation.task_reports()
                                      if t.job_id == "job-cwarm" and t.phase == EXITED), None), what="exit")
    log = agent.log("job-cwarm", 0)
    assert report.exit_code == 0, log
    seen = json.loads(log.split("seen: ", 1)[1].splitlines()[0])
    assert seen["preloaded"] and seen["warm"] == "1" and seen["argv"] == ["x"]
    assert seen["uid"] >= 1_000_000 and seen["pids"] == [1, 2]  # its init and itself, nothing of the host
    assert seen["cwd"] == "/silod/work"  # <work_dir>/jobs/job-cwarm/work on the host
    assert next(iter(warm)) not in _warm_pids(agent.proc.proc.pid)  # it was taken


def test_which_commands_may_run_warm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {"PATH": os.path.dirname(sys.executable), "PYTHONUNBUFFERED": "1"}
    python = sys.executable
    assert eligible([python, "train.py", "--x"], env, str(tmp_path), env)
    assert eligible([python, "-m", "pkg.train"], env, str(tmp_path), env)
    assert eligible([os.path.basename(python), "train.py"], env, str(tmp_path), env)  # found on the task's PATH
    assert not eligible([python, "-m"], env, str(tmp_path), env)
    assert not eligible([python, "-O", "train.py"], env, str(tmp_path), env)  # interpreter options
    assert not eligible([python], env, str(tmp_path), env)
    assert not eligible(["/bin/sh", "run.sh"], env, str(tmp_path), env)  # another program
    assert not eligible([python, "train.py"], {**env, "PYTHONHASHSEED": "0"}, str(tmp_path), env)
    assert not eligible([python, "train.py"], {**env, "LD_PRELOAD": "x.so"}, str(tmp_path), env)
    assert eligible([python, "train.py"], {**env, "SILOD_RANK": "3", "CUDA_VISIBLE_DEVICES": "1"}, str(tmp_path), env)
    # A thread count is applied when the warm process becomes the rank; other OpenMP settings are not.
    assert eligible([python, "train.py"], {**env, "OMP_NUM_THREADS": "1"}, str(tmp_path), env)
    assert not eligible([python, "train.py"], {**env, "OMP_NUM_THREADS": "auto"}, str(tmp_path), env)
    assert not eligible([python, "train.py"], {**env, "OMP_PROC_BIND": "true"}, str(tmp_path), env)


def test_a_warm_process_applies_the_ranks_thread_count_to_pytorch() -> None:
    import subprocess

    code = ("import torch; torch.set_num_threads(2); from worker_agent.warm_process import apply_thread_count; "
            "apply_thread_count('1'); one = torch.get_num_threads(); apply_thread_count(None); "
            "print(one, torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1", "1"]  # set once; nothing given: left as it was
