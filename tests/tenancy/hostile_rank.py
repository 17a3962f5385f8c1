"""A rank whose code tries what a rank can reach on its node (tests/tenancy/test_contained_jobs.py).

Run by a worker agent as a rank of a hostile tenant's job, beside another tenant's job on the same
node. It is told where that job and the node's services keep their things (as an attacker who
read the operators' docs would know): the host paths to read in $TRY_PATHS (JSON), the other job's
host pids in $VICTIM_PIDS, its id in $VICTIM. It tries to read every process's environment and
command line, those paths, to signal and trace those pids, to open devices, every token it found
against every service, and (first) to fork without end; then it prints every outcome on one line
of its log after ``silod-test-result: `` and exits 0.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import signal
import time

import grpc

from silod.rpc.channels import open_channel
from silod.v1 import (
    common_pb2,
    estimator_pb2,
    estimator_pb2_grpc,
    metadata_pb2 as m,
    metadata_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_agent_pb2 as w,
    worker_agent_pb2_grpc,
)

MARK = "silod-test-result: "
TOKEN = re.compile(rb"silod_[0-9a-f]{16}_[0-9a-f]{64}")
env = os.environ
own_token = env.get("SILOD_AUTH_TOKEN", "")
found: dict[str, object] = {}


def outcome(call) -> str:  # type: ignore[no-untyped-def]
    """"OK", an errno name, or a gRPC status name."""
    try:
        answer = call()
        if hasattr(answer, "__next__"):
            next(answer)
        return "OK"
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    except grpc.RpcError as exc:
        return exc.code().name


# 0. A fork bomb: children that wait, until the kernel refuses one; then they go. First, before
#    any gRPC channel has threads that would need the pids the bomb takes.
children = []
refused = ""
started = time.monotonic()
while time.monotonic() - started < 20:
    try:
        pid = os.fork()
    except OSError as exc:
        refused = errno.errorcode.get(exc.errno or 0, str(exc))
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    children.append(pid)
for pid in children:
    os.kill(pid, signal.SIGKILL)
for pid in children:
    os.waitpid(pid, 0)
found["fork_bomb"] = {"children": len(children), "refused": refused}

# 1. Every process it can see: their environments and command lines, and any token in them.
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
found["pids"] = pids
tokens: set[str] = set()
values: set[str] = set()
for pid in pids:
    for name in ("environ", "cmdline"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                data = f.read()
        except OSError:
            continue
        tokens |= {t.decode() for t in TOKEN.findall(data)}
        values |= {part.decode(errors="replace") for part in data.split(b"\0") if part}
found["tokens"] = sorted(tokens)
found["values_seen"] = sorted(values)

# 2. Files: the node's credential, the agent's and the cache server's state, the other job's
#    directories. Anything read is searched for tokens too.
files: dict[str, str] = {}
for path in json.loads(env.get("TRY_PATHS", "[]")):
    if os.path.isdir(path):
        listing: list[str] = []
        files[path] = outcome(lambda: listing.extend(os.listdir(path)))
        if listing:
            files[path] += ": " + ",".join(sorted(listing))
    else:
        def read() -> None:
            with open(path, "rb") as f:
                tokens.update(t.decode() for t in TOKEN.findall(f.read()))
        files[path] = outcome(read)
found["files"] = files
found["tokens"] = sorted(tokens)

# 3. The other job's processes, by their host pids: signals and ptrace.
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH, PTRACE_DETACH = 16, 17


def ptrace(pid: int) -> str:
    if libc.ptrace(PTRACE_ATTACH, pid, None, None) == 0:
        # Attached (a process of its own, e.g. a container's init of the job's own user): wait for
        # the stop, let go, and wake it, or it would stay stopped and hold the job up.
        os.waitpid(pid, 0x40000000)  # __WALL
        libc.ptrace(PTRACE_DETACH, pid, None, None)
        os.kill(pid, signal.SIGCONT)
        return "OK"
    return errno.errorcode.get(ctypes.get_errno(), "?")


victim_pids = [int(p) for p in json.loads(env.get("VICTIM_PIDS", "[]"))]
found["signals"] = {str(pid): outcome(lambda: os.kill(pid, signal.SIGSTOP)) for pid in victim_pids}
found["ptrace"] = {str(pid): ptrace(pid) for pid in [*victim_pids, 1]}

# 4. Devices: what /dev holds, and making a GPU's device node (nvidia, minor 1: not its own).
found["dev"] = sorted(os.listdir("/dev"))
found["mknod"] = outcome(lambda: os.mknod("/tmp/gpu1", 0o600 | 0o020000, os.makedev(195, 1)))

# 5. Every token it found, against every service.
victim = env["VICTIM"]
calls: dict[str, str] = {}
for token in sorted(tokens | {own_token}):
    who = "own" if token == own_token else token[:22]
    md = metadata_pb2_grpc.MetadataServiceStub(open_channel(env["SILOD_METADATA_ADDR"], token=token))
    jobs = scheduler_pb2_grpc.JobServiceStub(open_channel(env["SCHEDULER_ADDR"], token=token))
    agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(open_channel(env["SILOD_AGENT_ADDR"], token=token))
    estimator = estimator_pb2_grpc.EstimatorServiceStub(open_channel(env["ESTIMATOR_ADDR"], token=token))
    calls[f"{who}: JobService.CancelJob"] = outcome(lambda: jobs.CancelJob(scheduler_pb2.CancelJobRequest(job_id=victim)))
    calls[f"{who}: MetadataService.TransitionJob"] = outcome(lambda: md.TransitionJob(m.TransitionJobRequest(
        job_id=victim, expected_state=common_pb2.JOB_STATE_RUNNING, new_state=common_pb2.JOB_STATE_FAILED)))
    calls[f"{who}: MetadataService.GetJob"] = outcome(lambda: md.GetJob(m.GetJobRequest(job_id=victim)))
    calls[f"{who}: WorkerAgentService.TailLogs"] = outcome(lambda: agent.TailLogs(w.TailLogsRequest(job_id=victim)))
    calls[f"{who}: WorkerAgentService.GetDirective"] = outcome(
        lambda: agent.GetDirective(w.GetDirectiveRequest(job_id=victim)))
    calls[f"{who}: EstimatorService.Observe"] = outcome(lambda: estimator.Observe(estimator_pb2.ObserveRequest(
        job_id=victim)))
found["calls"] = calls


print(MARK + json.dumps(found), flush=True)
# Not sys.exit: the interpreter's shutdown could hang in gRPC's fork handlers after the bomb's
# hundred forks (seen once in a container); the outcome is already out.
os._exit(0)
