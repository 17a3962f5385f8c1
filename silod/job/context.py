"""silod.job contexts: ClusterContext (under a worker agent) and LocalContext (off-cluster twin)."""

from __future__ import annotations

import atexit
import io
import json
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from silod.job.world import World

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_LOG = "checkpoints.jsonl"  # one line per save: who wrote it and the progress it holds
FINISHED_FILE = "training-finished.json"  # rank 0 wrote it when the training ended (not at a stop)
REPORT_INTERVAL_S = 1.0
DIRECTIVE_INTERVAL_S = 1.0
CALL_TIMEOUT_S = 1.0  # a training step must never wait long for the agent
# The last report before exit carries the final progress, which the scheduler records before the
# job's terminal state: it is worth waiting a little for (it ignores the back-off after a failure).
FINAL_REPORT_TIMEOUT_S = 5.0
FINAL_REPORT_ATTEMPTS = 3
UNAVAILABLE_BACKOFF_S = 5.0  # after the agent was unreachable, skip calls this long
AGENT_CHECK_INTERVAL_S = 0.5  # how often a rank looks whether its agent process still exists


def _free_port() -> int:
    """A free TCP port on loopback, for the one-process group of an off-cluster run."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serialize(state: dict[str, Any]) -> bytes:
    """torch.save when the job already imported torch (tensors, state dicts), else pickle.

    Importing torch only to save a dict of ints costs seconds, which a rank asked to checkpoint
    before a deadline does not have; so the SDK never imports torch itself for saving.
    """
    buf = io.BytesIO()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.save(state, buf)
    else:
        pickle.dump(state, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def _deserialize(data: bytes) -> dict[str, Any]:
    if data[:2] == b"PK":  # torch.save's zip format
        import torch

        return torch.load(io.BytesIO(data), weights_only=False)
    return pickle.loads(data)


class JobContext:
    """Common API of both contexts."""

    def __init__(self, job_id: str, rank: int, world_size: int, generation: int, checkpoint_dir: Path) -> None:
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.checkpoint_dir = checkpoint_dir
        self.samples_done = 0
        self.steps_done = 0
        self.epochs_done = 0
        self.fraction_done = 0.0
        self.step_time_s = 0.0
        self.batch_size = 0
        self.cache_hit_ratio = 0.0
        self.grad_sqr = 0.0  # gradient noise statistics (see report())
        self.grad_var = 0.0
        self.leaving = False  # removed by a fast resize: exit without a checkpoint (survivors keep the state)
        # Set by ctx.distributed(): a REFORM is held (see held_world()) instead of applied at once,
        # so the ranks keep training in the old world while the new ranks start.
        self.hold_resizes = False
        self._resize_callbacks: list[Callable[[World], Any]] = []
        self._new_world: World | None = None
        self._held_world: World | None = None
        self._sigterm = threading.Event()
        self._last_report = 0.0
        self._started = time.monotonic()
        self._install_sigterm_handler()

    # -- signals
    def _install_sigterm_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum: int, frame: Any) -> None:
            self._sigterm.set()
            if callable(previous):  # a handler the script installed before init() still runs
                previous(signum, frame)

        signal.signal(signal.SIGTERM, handler)
        atexit.unregister(_ignore_sigterm_at_exit)  # registered once however many contexts a process makes
        atexit.register(_ignore_sigterm_at_exit)

    @property
    def sigterm_received(self) -> bool:
        return self._sigterm.is_set()

    # -- progress
    def set_progress(self, *, samples: int | None = None, steps: int | None = None, epoch: int | None = None) -> None:
        """Set absolute totals (e.g. after loading a checkpoint)."""
        if samples is not None:
            self.samples_done = int(samples)
        if steps is not None:
            self.steps_done = int(steps)
        if epoch is not None:
            self.epochs_done = int(epoch)

    def report(
        self,
        samples: int = 0,
        steps: int = 0,
        epoch: int | None = None,
        step_time_s: float | None = None,
        fraction_done: float | None = None,
        batch_size: int | None = None,
        cache_hit_ratio: float | None = None,
        grad_sqr: float | None = None,
        grad_var: float | None = None,
    ) -> None:
        """Add ``samples``/``steps`` done since the last call; set epoch, step time, fraction, batch size
        and the recent fraction of samples served from cache (0..1) if given; and the gradient
        noise statistics at the job's initial batch size (``ctx.distributed`` measures them)."""
        self.samples_done += int(samples)
        self.steps_done += int(steps)
        if epoch is not None:
            self.epochs_done = int(epoch)
        if step_time_s is not None and step_time_s > 0:
            self.step_time_s = float(step_time_s)
        if fraction_done is not None:
            self.fraction_done = min(1.0, max(0.0, float(fraction_done)))
        if batch_size is not None:
            self.batch_size = int(batch_size)
        if cache_hit_ratio is not None:
            self.cache_hit_ratio = min(1.0, max(0.0, float(cache_hit_ratio)))
        if grad_sqr is not None and grad_var is not None and grad_sqr > 0 and grad_var >= 0:
            self.grad_sqr, self.grad_var = float(grad_sqr), float(grad_var)
        now = time.monotonic()
        if self._last_report == 0.0 or now - self._last_report >= REPORT_INTERVAL_S:
            self._last_report = now
            self._flush()

    def _flush(self, final: bool = False) -> None:
        raise NotImplementedError

    def should_checkpoint(self) -> bool:
        raise NotImplementedError

    # -- fast resize (AFE)
    def on_resize(self, callback: Callable[[World], Any]) -> None:
        """Call ``callback(world)`` when the job is resized around this running process.

        Callbacks run inside ``should_checkpoint()`` or ``world_changed()`` (the calls that poll the
        agent), i.e. in the training loop between steps, after ``rank``, ``world_size``,
        ``generation`` and ``batch_size`` took their new values: the place to re-form the process
        group (destroy it, init again at ``world.master_addr:world.master_port``) and rescale."""
        self._resize_callbacks.append(callback)

    def world_changed(self) -> World | None:
        """The new world if the job was resized around this process since the last call, else None."""
        self._poll()
        world, self._new_world = self._new_world, None
        return world

    def held_world(self) -> World | None:
        """The world of a resize this rank was told of but has not switched to (``hold_resizes``)."""
        self._poll()
        return self._held_world

    def apply_world(self, world: World) -> None:
        """Switch to ``world`` now: rank, world size, generation and batch size take its values."""
        self._held_world = None
        self._resized(world)

    def _poll(self) -> None:
        """Ask for directives (rate-limited); off the cluster there are none."""

    def poll_directive(self, min_interval_s: float = 0.0) -> None:
        """Ask the agent for this rank's directive now (or if ``min_interval_s`` has passed since
        the last time), not waiting for the once-a-second poll of should_checkpoint()."""

    def master_addr_port(self) -> tuple[str, int]:
        """The rendezvous of this generation's process group."""
        return "127.0.0.1", _free_port()

    def distributed(self, model: Any, optimizer: Any, sampler: Any = None, **options: Any) -> Any:
        """Data-parallel training that silod can resize in place: see silod.job.distributed."""
        from silod.job.distributed import DistributedTraining

        return DistributedTraining(self, model, optimizer, sampler, **options)

    def _resized(self, world: World) -> None:
        self.rank, self.world_size, self.generation = world.rank, world.world_size, world.generation
        if world.batch_size > 0:
            self.batch_size = world.batch_size
        self._new_world = world
        for callback in self._resize_callbacks:
            callback(world)

    # -- checkpoints
    @property
    def checkpoint_path(self) -> Path:
        return self.checkpoint_dir / CHECKPOINT_FILE

    def save_checkpoint(self, state: dict[str, Any]) -> bool:
        """Write ``state`` atomically; returns False on ranks other than 0 (they do not write) and,
        on the cluster, once the rank's agent is gone (see :attr:`ClusterContext.agent_lost`)."""
        if self.rank != 0 or self.leaving:
            return False
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_dir / f".{CHECKPOINT_FILE}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(_serialize(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.checkpoint_path)
        self._log_checkpoint()
        return True

    def _log_checkpoint(self) -> None:
        """Append who saved and the progress counters at the save, so that operators and tests
        can tell which generation wrote the checkpoint in place and how far a resume goes back.
        One short O_APPEND write per line: concurrent writers never interleave within a line."""
        record = {
            "t": time.time(), "job_id": self.job_id, "generation": self.generation, "rank": self.rank,
            "world_size": self.world_size, "pid": os.getpid(),
            # The agent's stamp of this launch: tells processes apart where the pid is a PID
            # namespace's (a contained rank is pid 2 of its own).
            "launch": os.environ.get("SILOD_LAUNCH_TIME", ""), "samples_done": self.samples_done,
            "steps_done": self.steps_done, "epochs_done": self.epochs_done,
        }
        fd = os.open(self.checkpoint_dir / CHECKPOINT_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)

    def checkpoint_history(self) -> list[dict[str, Any]]:
        """The save records of this job's checkpoint directory, oldest first."""
        try:
            lines = (self.checkpoint_dir / CHECKPOINT_LOG).read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def load_checkpoint(self) -> dict[str, Any] | None:
        try:
            data = self.checkpoint_path.read_bytes()
        except FileNotFoundError:
            return None
        return _deserialize(data)

    def mark_training_finished(self) -> None:
        """Rank 0: record that the job's training is over, for ranks launched too late to join it."""
        if self.rank == 0 and not self.leaving:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            (self.checkpoint_dir / FINISHED_FILE).write_text(json.dumps({"t": time.time(), "generation": self.generation}))

    def training_finished(self) -> bool:
        return (self.checkpoint_dir / FINISHED_FILE).exists()

    def done(self) -> None:
        """Send the final progress; call before exiting."""
        self._flush(final=True)
        self.close()

    def close(self) -> None:
        pass


def _ignore_sigterm_at_exit() -> None:
    """A rank that exits ignores SIGTERM from then on.

    Python puts its signals back to their defaults as it finalizes, so a SIGTERM arriving then
    would kill a rank that has already checkpointed and returned 0, and it would exit 143: the
    agent's stop is such a SIGTERM when the rank saw the checkpoint directive first and the signal,
    sent through the Docker Engine, lands as the rank exits. SIGKILL at the deadline still ends a
    rank stuck in its exit."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class LocalContext(JobContext):
    """Off-cluster twin: rank 0 of 1, checkpoints in ./checkpoints (or SILOD_CHECKPOINT_DIR), progress to stderr."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str] | None = None) -> None:
        super().__init__(
            job_id="local",
            rank=0,
            world_size=1,
            generation=0,
            checkpoint_dir=Path(checkpoint_dir or os.environ.get("SILOD_CHECKPOINT_DIR") or "checkpoints"),
        )

    def _flush(self, final: bool = False) -> None:
        print(
            f"silod.job[local]: samples={self.samples_done} steps={self.steps_done} epoch={self.epochs_done} "
            f"step_time_s={self.step_time_s:.4f} fraction_done={self.fraction_done:.3f} "
            f"cache_hit_ratio={self.cache_hit_ratio:.3f}",
            file=sys.stderr,
            flush=True,
        )

    def should_checkpoint(self) -> bool:
        return self.sigterm_received


class ClusterContext(JobContext):
    """Under a worker agent: progress and directives over gRPC to SILOD_AGENT_ADDR."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        super().__init__(
            job_id=env["SILOD_JOB_ID"],
            rank=int(env.get("SILOD_RANK", "0")),
            world_size=int(env.get("SILOD_WORLD_SIZE", "1")),
            generation=int(env.get("SILOD_GENERATION", "0")),
            checkpoint_dir=Path(env.get("SILOD_CHECKPOINT_DIR") or "checkpoints"),
        )
        self.batch_size = int(env.get("SILOD_BATCH_SIZE", "0") or 0)
        self.agent_addr = env.get("SILOD_AGENT_ADDR", "")
        self._agent_pid = int(env.get("SILOD_AGENT_PID", "0") or 0)
        self._agent_start_time = env.get("SILOD_AGENT_START_TIME", "")
        self._agent_lost = False
        self._last_agent_check = 0.0
        self._checkpoint_asked = False
        self._sigterm_polled = False
        self._own_env = env is None  # then a re-formed world is also written to os.environ
        self.master_addr = env.get("MASTER_ADDR", "")
        self.master_port = int(env.get("MASTER_PORT", "0") or 0)
        self.deadline_s = 0.0
        self._last_poll = 0.0
        self._quiet_until = 0.0
        self._channel = None
        self._stub = None
        if self.agent_addr:
            from silod.rpc.channels import open_channel
            from silod.v1 import worker_agent_pb2_grpc

            self._channel = open_channel(self.agent_addr, token=env.get("SILOD_AUTH_TOKEN", ""), default_timeout_s=5)
            self._stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(self._channel)

    @property
    def agent_lost(self) -> bool:
        """True once the worker agent that launched this rank has died.

        Its node then counts as lost: the scheduler requeues the job from its last checkpoint,
        possibly on another node writing the same checkpoint directory. So from then on
        ``should_checkpoint()`` is true (the rank should exit) and ``save_checkpoint()`` writes
        nothing: work since the last checkpoint is lost, as if the machine had crashed. The
        agent's own child processes die with it; this covers the processes they started
        (launchers' workers, shells' children). Checked from /proc (the agent runs on this host).
        """
        if self._agent_lost or not self._agent_pid:
            return self._agent_lost
        now = time.monotonic()
        if self._last_agent_check and now - self._last_agent_check < AGENT_CHECK_INTERVAL_S:
            return False
        self._last_agent_check = now
        try:
            fields = Path(f"/proc/{self._agent_pid}/stat").read_text().rsplit(")", 1)[1].split()
            alive = fields[0] not in ("Z", "X") and (not self._agent_start_time or fields[19] == self._agent_start_time)
        except (OSError, IndexError):
            alive = not Path("/proc/self/stat").exists()  # no /proc at all: cannot tell, assume alive
        if not alive:
            self._agent_lost = True
            print("silod.job: the worker agent is gone; no more checkpoints, exit as asked", file=sys.stderr, flush=True)
        return self._agent_lost

    def save_checkpoint(self, state: dict[str, Any]) -> bool:
        if self.agent_lost:
            return False
        return super().save_checkpoint(state)

    def _agent_down(self, exc: Any) -> None:
        import grpc

        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._quiet_until = time.monotonic() + UNAVAILABLE_BACKOFF_S

    def _flush(self, final: bool = False) -> None:
        """Report progress to the agent. A periodic report is skipped while the agent is backed off
        and waits at most CALL_TIMEOUT_S; the final one (``done()``) is tried a few times, so the
        job's recorded progress is complete when it finishes (watchers see the final count)."""
        if self._stub is None or self.agent_lost or (not final and time.monotonic() < self._quiet_until):
            return
        import grpc

        attempts = FINAL_REPORT_ATTEMPTS if final else 1
        for attempt in range(1, attempts + 1):
            try:
                self._report_progress(FINAL_REPORT_TIMEOUT_S if final else CALL_TIMEOUT_S)
                return
            except grpc.RpcError as exc:
                retry = attempt < attempts and exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                                              grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retry:
                    self._agent_down(exc)
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # our generation was superseded
                        self._checkpoint_asked = True
                    print(f"silod.job: progress report failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
                    return
                time.sleep(0.2 * attempt)

    def _report_progress(self, timeout: float) -> None:
        from silod.v1 import common_pb2, worker_agent_pb2

        self._stub.ReportProgress(  # type: ignore[union-attr]
            worker_agent_pb2.ReportProgressRequest(
                job_id=self.job_id,
                rank=self.rank,
                generation=self.generation,
                progress=common_pb2.JobProgress(
                    samples_done=self.samples_done,
                    steps_done=self.steps_done,
                    epochs_done=self.epochs_done,
                    fraction_done=self.fraction_done,
                    throughput_samples_per_s=(self.batch_size / self.step_time_s) if self.step_time_s else 0.0,
                    cache_hit_ratio=self.cache_hit_ratio,
                ),
                step_time_s=self.step_time_s,
                batch_size=self.batch_size,
                cache_hit_ratio=self.cache_hit_ratio,
                grad_sqr=self.grad_sqr,
                grad_var=self.grad_var,
            ),
            timeout=timeout,
        )

    def poll_directive(self, min_interval_s: float = 0.0) -> None:
        if not self._last_poll or time.monotonic() - self._last_poll >= min_interval_s:
            self._poll(force=True)

    def master_addr_port(self) -> tuple[str, int]:
        return self.master_addr, self.master_port

    def should_checkpoint(self) -> bool:
        if self._checkpoint_asked or self.agent_lost:
            return True
        if self.sigterm_received:
            # The agent signals every rank it stops; one directive call tells a rank removed by
            # a fast resize (EXIT: no checkpoint needed) from one that must save (the default).
            if not self._sigterm_polled:
                self._sigterm_polled = True
                self._poll(force=True)
            self._checkpoint_asked = True
            return True
        self._poll()
        return self._checkpoint_asked

    def _poll(self, force: bool = False) -> None:
        """GetDirective at most once a second (``force``: now) and act on the answer."""
        now = time.monotonic()
        if self._stub is None or now < self._quiet_until or self._checkpoint_asked or (
            not force and self._last_poll and now - self._last_poll < DIRECTIVE_INTERVAL_S
        ):
            return
        self._last_poll = now
        import grpc

        from silod.v1 import worker_agent_pb2

        try:
            directive = self._stub.GetDirective(
                worker_agent_pb2.GetDirectiveRequest(job_id=self.job_id, rank=self.rank, generation=self.generation),
                timeout=CALL_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            self._agent_down(exc)
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # our generation was superseded
                self._checkpoint_asked = True
            return
        if directive.action in (worker_agent_pb2.DIRECTIVE_ACTION_CHECKPOINT_AND_EXIT,
                                worker_agent_pb2.DIRECTIVE_ACTION_EXIT):
            self._checkpoint_asked = True
            self.deadline_s = directive.deadline_s
            if directive.action == worker_agent_pb2.DIRECTIVE_ACTION_EXIT:
                self.leaving = True
                print("silod.job: removed by a fast resize; the surviving ranks keep the state, exit without "
                      "a checkpoint", file=sys.stderr, flush=True)
        elif directive.action == worker_agent_pb2.DIRECTIVE_ACTION_REFORM:
            if directive.new_generation > self.generation:  # a late repeat of one already applied is ignored
                self._reform(directive)

    def _reform(self, directive: Any) -> None:
        world = World(
            rank=directive.new_rank, world_size=directive.new_world_size, generation=directive.new_generation,
            master_addr=directive.master_addr, master_port=directive.master_port,
            batch_size=directive.new_batch_size or self.batch_size,
            previous_rank=self.rank, previous_world_size=self.world_size,
            local_rank=directive.new_local_rank, local_world_size=max(directive.new_local_world_size, 1),
            group_rank=directive.new_group_rank,
        )
        if self.hold_resizes:
            held = self._held_world
            if held is None or held.generation < world.generation:
                print(f"silod.job: resize to {world.world_size} ranks (generation {world.generation}) held: "
                      f"training goes on at {self.world_size} until the new ranks are ready", file=sys.stderr, flush=True)
                self._held_world = world
            return
        self.apply_world(world)

    def apply_world(self, world: World) -> None:
        self._held_world = None
        self.master_addr, self.master_port = world.master_addr, world.master_port
        if self._own_env:  # so that a process group re-initialised with init_method="env://" sees the new world
            os.environ.update({
                "SILOD_RANK": str(world.rank), "SILOD_WORLD_SIZE": str(world.world_size),
                "SILOD_GENERATION": str(world.generation), "SILOD_BATCH_SIZE": str(world.batch_size),
                "MASTER_ADDR": world.master_addr, "MASTER_PORT": str(world.master_port),
                "RANK": str(world.rank), "WORLD_SIZE": str(world.world_size), "LOCAL_RANK": str(world.local_rank),
                "LOCAL_WORLD_SIZE": str(world.local_world_size), "GROUP_RANK": str(world.group_rank),
            })
        print(f"silod.job: fast resize: now rank {world.rank} of {world.world_size}, generation {world.generation} "
              f"(was rank {world.previous_rank} of {world.previous_world_size})", file=sys.stderr, flush=True)
        self._resized(world)
        self._flush()  # tells the agent at once that this process runs under its new identity

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
            self._stub = None


def init(checkpoint_dir: str | os.PathLike[str] | None = None) -> JobContext:
    """A ClusterContext when launched by a worker agent (SILOD_JOB_ID set), else a LocalContext."""
    if os.environ.get("SILOD_JOB_ID"):
        return ClusterContext()
    return LocalContext(checkpoint_dir)
