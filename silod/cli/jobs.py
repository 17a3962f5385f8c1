"""Job commands of ``silod``: submit, jobs (and ``jobs show JOB``), watch, cancel, logs (JobService
and the agents' TailLogs).

The scheduler address comes from --scheduler, else SILOD_SCHEDULER_ADDR, else the
cluster.json that `silod up` writes in its state dir (--state-dir / SILOD_STATE_DIR).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re
import shlex
import sys
import time
import uuid
from typing import Any

import grpc

from silod.cli import locate
from silod.cli.client_commands import _channel, _fail, _rpc_failure, all_pages, call, identifier
from silod.rpc.identifiers import DATASET_NAME, JOB_ID, TENANT

INT_KEYS = ("min_gpus", "max_gpus", "batch_size", "max_batch_size", "epochs", "priority")
FLOAT_KEYS = ("emulated_step_compute_s", "inference_duration_s", "cpus_per_rank")
STR_KEYS = ("name", "application", "dataset", "tenant", "image")
ALLOWED_KEYS = frozenset((*INT_KEYS, *FLOAT_KEYS, *STR_KEYS, "sample_budget", "command", "env", "kind", "gpu_types",
                          "resize_in_place", "memory_per_rank"))
# Bytes with a unit, as Kubernetes writes memory: binary Ki..Ei, decimal k..E (a trailing B allowed).
_BYTES = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKMGTPE]i?)?B?\s*")
_UNIT = {"": 1, **{u: 1000 ** (k + 1) for k, u in enumerate("kMGTPE")}, "K": 1000,
         **{f"{u}i": 1024 ** (k + 1) for k, u in enumerate("KMGTPE")}}


class JobFileError(ValueError):
    """The job YAML is not a valid JobSpec: ``problems`` lists each, the key first."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))


def parse_job_yaml(text: str, source: str = "job file") -> Any:
    """YAML mapping with JobSpec field names -> common_pb2.JobSpec.

    Raises JobFileError listing every problem of the file (unknown keys, wrong types, malformed
    identifiers), not only the first; the rules that need the cluster (ranges, budgets, ...)
    are the services', which also answer with all their problems at once.
    """
    import yaml

    from silod.v1 import common_pb2

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobFileError(source, [f"not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise JobFileError(source, [f"expected a mapping of JobSpec fields, got {type(data).__name__}"])
    problems: list[str] = []
    for key in sorted((k for k in data if k not in ALLOWED_KEYS), key=str):
        problems.append(f"unknown key {str(key)!r} (allowed: {', '.join(sorted(ALLOWED_KEYS))})")
    if "epochs" in data and "sample_budget" in data:
        problems.append("give either 'epochs' or 'sample_budget', not both")
    spec = common_pb2.JobSpec()
    for key, value in data.items():
        if key not in ALLOWED_KEYS:
            continue
        problem = _set_key(spec, key, value, common_pb2)
        if problem is None and key in _IDENTIFIER_KEYS and value:
            rule = _IDENTIFIER_KEYS[key]
            found = rule.problem(value)
            problem = f"key {key!r}: {found}" if found else None
        if problem is not None:
            problems.append(problem)
    if problems:
        raise JobFileError(source, problems)
    return spec


_IDENTIFIER_KEYS = {"dataset": DATASET_NAME, "tenant": TENANT}


def _set_key(spec: Any, key: str, value: Any, common_pb2: Any) -> str | None:
    """Set one key of the job file on ``spec``; the problem with it, or None."""
    if key in INT_KEYS or key == "sample_budget":
        if not isinstance(value, int) or isinstance(value, bool):
            return f"key {key!r} must be an integer, got {value!r}"
        try:
            setattr(spec, key, value)
        except ValueError:
            return f"key {key!r} is out of range, got {value!r}"
    elif key in FLOAT_KEYS:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"key {key!r} must be a number, got {value!r}"
        try:
            setattr(spec, key, float(value))
        except OverflowError:
            return f"key {key!r} is out of range, got {value!r}"
    elif key in STR_KEYS:
        if not isinstance(value, str):
            return f"key {key!r} must be a string, got {value!r}"
        setattr(spec, key, value)
    elif key == "command":
        if isinstance(value, str):
            try:
                value = shlex.split(value)
            except ValueError as exc:
                return f"key 'command': {exc}"
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            return "key 'command' must be a list of strings or a string"
        spec.command.extend(str(v) for v in value)
    elif key == "env":
        if not isinstance(value, dict):
            return "key 'env' must be a mapping of NAME: value"
        bad = [k for k, v in value.items() if isinstance(v, (dict, list)) or v is None]
        if bad:
            return f"env {bad[0]!r} must be a scalar, got {value[bad[0]]!r}"
        for k, v in value.items():
            spec.env[str(k)] = str(v).lower() if isinstance(v, bool) else str(v)
    elif key == "kind":
        name = str(value).upper()
        name = name if name.startswith("JOB_KIND_") else f"JOB_KIND_{name}"
        if name not in common_pb2.JobKind.keys():
            return f"key 'kind' must be 'training' or 'inference', got {value!r}"
        spec.kind = common_pb2.JobKind.Value(name)
    elif key == "memory_per_rank":
        memory = parse_bytes(value)
        if memory is None:
            return (f"key 'memory_per_rank' must be bytes: an integer or a number with a unit such as 512Mi, 4Gi or "
                    f"2G, got {value!r}")
        try:
            spec.memory_bytes_per_rank = memory
        except ValueError:
            return f"key 'memory_per_rank' is out of range, got {value!r}"
    elif key == "resize_in_place":
        if not isinstance(value, bool):
            return f"key 'resize_in_place' must be true or false, got {value!r}"
        spec.resize_in_place = value
    elif key == "gpu_types":  # a list, or one type as a string
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return "key 'gpu_types' must be a list of GPU types such as [a100, h100]"
        spec.gpu_types.extend(value)
    return None


def parse_bytes(value: Any) -> int | None:
    """Bytes from an integer or a string such as "512Mi", "4Gi", "2G", "1.5Gi" (rounded up to a
    whole byte); None if it is neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    match = _BYTES.fullmatch(value) if isinstance(value, str) else None
    if match is None or (match.group(2) is None and "." in match.group(1)):
        return None
    return math.ceil(float(match.group(1)) * _UNIT[match.group(2) or ""])


def request_id_for(content: bytes) -> str:
    return "yaml-" + hashlib.sha256(content).hexdigest()[:40]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    submit = sub.add_parser("submit", help="submit a job described by a YAML file of JobSpec fields")
    submit.add_argument("file", help="YAML job file (keys: JobSpec fields, e.g. name, application, min_gpus, ...)")
    submit.add_argument("--request-id", default="",
                        help="idempotency key; default: derived from the file's content (resubmitting is a no-op)")
    submit.add_argument("--again", action="store_true",
                        help="submit a new job even if this file was submitted before (a fresh idempotency key)")
    submit.set_defaults(handler=_submit)

    jobs = sub.add_parser("jobs", help="list jobs: id, name, state, GPUs, progress, age")
    jobs.set_defaults(handler=_jobs)
    show = jobs.add_subparsers(dest="jobs_command", metavar="ACTION").add_parser(
        "show", help="one job: its state and what it asks for (GPUs, image, cores and memory per rank, ...)")
    show.add_argument("job_id", metavar="JOB", type=identifier(JOB_ID))
    show.set_defaults(handler=_show)

    watch = sub.add_parser("watch", help="follow a job's state and progress until it ends")
    watch.add_argument("job_id", metavar="JOB", type=identifier(JOB_ID))
    watch.set_defaults(handler=_watch)

    cancel = sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job_id", metavar="JOB", type=identifier(JOB_ID))
    cancel.add_argument("--reason", default="cancelled from the CLI")
    cancel.set_defaults(handler=_cancel)

    logs = sub.add_parser("logs", help="print a job's output from the nodes that ran it")
    logs.add_argument("job_id", metavar="JOB", type=identifier(JOB_ID))
    logs.add_argument("--rank", type=int, default=-1, help="only this rank (default: all)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing until the job's tasks exit")
    locate.add_flags(logs, "metadata")
    logs.set_defaults(handler=_logs)

    for p in (submit, jobs, show, watch, cancel):
        locate.add_flags(p, "scheduler")


def _run(args: argparse.Namespace, body: Any) -> int:
    """``body(JobServiceStub)`` against the scheduler."""
    from silod.v1 import scheduler_pb2_grpc

    return call(args, "scheduler", lambda channel: body(scheduler_pb2_grpc.JobServiceStub(channel)))


def _submit(args: argparse.Namespace) -> int:
    from silod.v1 import scheduler_pb2

    try:
        with open(args.file, "rb") as f:
            content = f.read()
    except OSError as exc:
        return _fail(f"cannot read {args.file}: {exc.strerror}")
    try:
        spec = parse_job_yaml(content.decode("utf-8", errors="replace"), args.file)
    except JobFileError as exc:
        for line in str(exc).splitlines():
            print(f"silod: {line}", file=sys.stderr)
        return 2
    if args.again and args.request_id:
        return _fail("--again and --request-id exclude each other")
    request_id = args.request_id or request_id_for(content)
    if args.again:
        request_id = f"{request_id[:40]}-{uuid.uuid4().hex[:16]}"
    sent_at = time.time()

    def body(stub: Any) -> int:
        job = stub.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec, client_request_id=request_id), timeout=15)
        print(job.id)
        state = _state_name(job.state)
        # The same key returns the job it made before: say so, or a user who fixed the cause of a
        # failure and resubmits would watch the old failed job again.
        if state in TERMINAL or (job.created_at.seconds and job.created_at.seconds < sent_at - 5):
            how = f"ended {state}" if state in TERMINAL else f"is {state}"
            print(f"silod: {args.file} was already submitted as {job.id}, which {how}; nothing new was submitted. "
                  f"To run it once more: silod submit --again {args.file}", file=sys.stderr)
        return 0

    return _run(args, body)


def _state_name(state: int) -> str:
    from silod.v1 import common_pb2

    return common_pb2.JobState.Name(state).removeprefix("JOB_STATE_")


def _age(ts: Any) -> str:
    if not ts.seconds:
        return "-"
    s = max(0, int(time.time() - ts.seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _jobs(args: argparse.Namespace) -> int:
    from silod.v1 import metadata_pb2

    def body(stub: Any) -> int:
        rows = all_pages(lambda token: stub.ListJobs(
            metadata_pb2.ListJobsRequest(page_size=500, page_token=token), timeout=15), "jobs")
        print(f"{'ID':<20} {'NAME':<20} {'STATE':<10} {'GPUS':>5} {'PROGRESS':>9} {'AGE':>5}")
        for j in rows:
            gpus = str(j.allocated.gpus) if j.allocated.gpus else "-"
            print(f"{j.id:<20} {j.spec.name[:20]:<20} {_state_name(j.state):<10} {gpus:>5} "
                  f"{100 * j.progress.fraction_done:>8.1f}% {_age(j.created_at):>5}")
        return 0

    return _run(args, body)


def _show(args: argparse.Namespace) -> int:
    from silod.v1 import metadata_pb2

    def body(stub: Any) -> int:
        print("\n".join(job_lines(stub.GetJob(metadata_pb2.GetJobRequest(job_id=args.job_id), timeout=15))))
        return 0

    return _run(args, body)


def job_lines(job: Any) -> list[str]:
    """What ``silod jobs show`` prints of ``job``: one "key: value" line each, requests only when set."""
    from silod.cli.client_commands import _human_bytes
    from silod.v1 import common_pb2

    spec = job.spec
    rows = [("id", job.id), ("name", spec.name), ("state", _state_name(job.state)), ("tenant", spec.tenant),
            ("kind", common_pb2.JobKind.Name(spec.kind).removeprefix("JOB_KIND_").lower()),
            ("application", spec.application or "-"), ("dataset", spec.dataset or "-"),
            ("gpus", f"{spec.min_gpus}..{spec.max_gpus} ({job.allocated.gpus} allocated)"),
            ("gpu types", ", ".join(spec.gpu_types) or "any"), ("batch size", str(spec.batch_size))]
    if spec.image:
        rows.append(("image", spec.image))
    if spec.cpus_per_rank:
        rows.append(("cpus per rank", f"{spec.cpus_per_rank:g}"))
    if spec.memory_bytes_per_rank:
        rows.append(("memory per rank", f"{_human_bytes(spec.memory_bytes_per_rank)} ({spec.memory_bytes_per_rank} B)"))
    if spec.command:
        rows.append(("command", shlex.join(spec.command)))
    rows += [("progress", f"{100 * job.progress.fraction_done:.1f}%"), ("age", _age(job.created_at))]
    if job.message:
        rows.append(("message", job.message))
    return [f"{key + ':':<17}{value}" for key, value in rows]


TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def _watch(args: argparse.Namespace) -> int:
    from silod.v1 import scheduler_pb2

    def body(stub: Any) -> int:
        stream = stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=args.job_id))
        last = None
        if sys.stdout.isatty():
            last = _watch_rich(stream, args.job_id)
        else:
            shown: tuple[str, int] | None = None
            for update in stream:
                last = update.job
                key = (_state_name(last.state), int(10 * last.progress.fraction_done))
                if key != shown:
                    shown = key
                    print(f"{last.id} {key[0]} {100 * last.progress.fraction_done:.1f}% "
                          f"samples={last.progress.samples_done} gpus={last.allocated.gpus}", flush=True)
                if key[0] in TERMINAL:
                    break
        if last is None:
            return _fail(f"no update for job {args.job_id}")
        state = _state_name(last.state)
        if state in TERMINAL:
            msg = f" ({last.message})" if last.message and state != "SUCCEEDED" else ""
            print(f"{last.id} {state}{msg}")
        return 0 if state == "SUCCEEDED" else 1

    return _run(args, body)


def _watch_rich(stream: Any, job_id: str) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    last = None
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                  TimeElapsedColumn()) as progress:
        task = progress.add_task(job_id, total=1.0)
        for update in stream:
            last = update.job
            state = _state_name(last.state)
            progress.update(task, completed=last.progress.fraction_done,
                            description=f"{last.id} {last.spec.name} [{state}] gpus={last.allocated.gpus}")
            if state in TERMINAL:
                break
    return last


def _cancel(args: argparse.Namespace) -> int:
    from silod.v1 import scheduler_pb2

    def body(stub: Any) -> int:
        job = stub.CancelJob(scheduler_pb2.CancelJobRequest(job_id=args.job_id, reason=args.reason), timeout=15)
        print(f"{job.id} {_state_name(job.state)}")
        return 0

    return _run(args, body)


def nodes_and_plan(args: argparse.Namespace, job_id: str = "") -> tuple[list[Any], Any] | int:
    """(registered nodes, latest plan or None before the first round) from the metadata service,
    after checking that ``job_id`` exists if one is given; an exit status if that fails (said)."""
    from silod.v1 import metadata_pb2, metadata_pb2_grpc

    found: list[tuple[list[Any], Any]] = []

    def body(channel: grpc.Channel) -> int:
        stub = metadata_pb2_grpc.MetadataServiceStub(channel)
        if job_id:
            stub.GetJob(metadata_pb2.GetJobRequest(job_id=job_id), timeout=10)
        nodes = list(stub.ListNodes(metadata_pb2.ListNodesRequest(), timeout=10).nodes)
        try:
            plan = stub.GetLatestPlan(metadata_pb2.GetLatestPlanRequest(), timeout=10)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            plan = None
        found.append((nodes, plan))
        return 0

    code = call(args, "metadata", body)
    return found[0] if not code and found else code


def _logs(args: argparse.Namespace) -> int:
    from silod.v1 import worker_agent_pb2, worker_agent_pb2_grpc

    found_view = nodes_and_plan(args, args.job_id)
    if isinstance(found_view, int):
        return found_view
    nodes, plan = found_view
    # Nodes of the job's current placement first; then every other node (a finished job is no
    # longer in the plan, but its logs stay on the nodes that ran it).
    placed = [p.node for a in (plan.jobs if plan else []) if a.job_id == args.job_id for p in a.placements]
    by_name = {n.spec.name: n.spec.agent_address for n in nodes if n.spec.agent_address}
    order = [n for n in dict.fromkeys(placed) if n in by_name] + sorted(n for n in by_name if n not in placed)
    found = False
    multi = len(order) > 1
    try:
        for name in order:
            with _channel(by_name[name], args) as channel:
                agent = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
                try:
                    for chunk in agent.TailLogs(worker_agent_pb2.TailLogsRequest(
                            job_id=args.job_id, rank=args.rank, follow=args.follow)):
                        found = True
                        text = chunk.data.decode("utf-8", errors="replace")
                        if multi or args.rank < 0:
                            prefix = f"[{name} rank {chunk.rank}] "
                            text = "".join(prefix + line for line in text.splitlines(keepends=True))
                        sys.stdout.write(text)
                        sys.stdout.flush()
                except grpc.RpcError as exc:
                    if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                        continue
                    return _rpc_failure(exc)
    except KeyboardInterrupt:
        return 130
    if not found:
        return _fail(f"NOT_FOUND: no logs of job {args.job_id} on any node (not started yet?)")
    return 0
