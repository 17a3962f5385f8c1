"""What a rank is told: its environment, worked out from its assignment and the node's settings.

The rank gets torchrun's variables (an unmodified ``init_process_group("env://")`` script runs
as is), silod's own (``SILOD_*``: its identity, the agent's and cache server's addresses, its
checkpoint directory, its budget) and the job's ``env``. The agent's own settings never leak into
it, and with auth on neither does the cluster token: a rank holds a credential of its own job
(:mod:`worker_agent.credentials`) and no other.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from services.runtime.auth import auth_enabled
from silod.v1 import common_pb2, plan_pb2
from worker_agent.runtimes.leftovers import start_time


def base_env(settings: Any) -> dict[str, str]:
    """The agent's environment without its own settings (SILOD_LISTEN, SILOD_GPUS, ...), which
    must not leak into jobs. With auth on, that includes the cluster token: ranks get a
    credential of their own job instead. Without auth, a SILOD_AUTH_TOKEN of the environment is
    passed on as it always was."""
    own = {f"SILOD_{name.upper()}" for name in type(settings).model_fields} | {"SILOD_CONFIG"}
    if not auth_enabled(settings):
        own.discard("SILOD_AUTH_TOKEN")
    return {k: v for k, v in os.environ.items() if k not in own}


# What a rank that does not run as the agent's user keeps of the agent's environment: where
# programs are and how text is read, nothing that could hold a secret.
MINIMAL_KEYS = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ")


def minimal_base(passthrough: str = "", host_keys: bool = True) -> dict[str, str]:
    """The agent's environment as a contained rank gets it: :data:`MINIMAL_KEYS` (unless
    ``host_keys`` is false: a rank in an image has the image's) and what the operator lets through
    (``rank_env_passthrough``: comma-separated names, ``PREFIX*`` for every name that starts so),
    never a secret the operator did not name."""
    wanted = [w.strip() for w in passthrough.split(",") if w.strip()]
    return {k: v for k, v in os.environ.items() if (host_keys and k in MINIMAL_KEYS)
            or any(k == w or (w.endswith("*") and k.startswith(w[:-1])) for w in wanted)}


def master_addr(a: plan_pb2.TaskAssignment, agent_address: str) -> str:
    """Rank 0's host as the plan names it; a plan without one (an older scheduler) has all
    ranks here, so this node's advertised host is right."""
    if a.master_addr:
        return a.master_addr
    host, sep, _ = agent_address.rpartition(":")
    return host.strip("[]") if sep else agent_address


def rank_env(settings: Any, agent_address: str, a: plan_pb2.TaskAssignment, checkpoint_dir: Path,
             job_token: str = "", base: dict[str, str] | None = None, agent_visible: bool = True) -> dict[str, str]:
    """The environment of the rank ``a`` (``base``: what it inherits, by default :func:`base_env`;
    ``agent_visible``: the rank sees the agent's process, see SILOD_AGENT_PID)."""
    spec = a.spec
    env = {
        **(base_env(settings) if base is None else base),
        "PYTHONUNBUFFERED": "1",
        "SILOD_JOB_ID": a.job_id,
        "SILOD_RANK": str(a.rank),
        "SILOD_WORLD_SIZE": str(max(a.world_size, 1)),
        "SILOD_GENERATION": str(a.generation),
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in a.gpu_indices),
        "SILOD_CACHE_ADDR": settings.cache_address,
        "SILOD_AGENT_ADDR": agent_address,
        # Lets the SDK in processes that do not die with the agent (a task's own children)
        # notice it is gone: see silod.job.ClusterContext.agent_lost.
        "SILOD_AGENT_PID": str(os.getpid()),
        "SILOD_AGENT_START_TIME": start_time(os.getpid()),
        "SILOD_METADATA_ADDR": settings.metadata_address,
        "SILOD_CHECKPOINT_DIR": str(checkpoint_dir),
        # torchrun's variables: an unmodified init_process_group("env://") script runs as is.
        "RANK": str(a.rank),
        "WORLD_SIZE": str(max(a.world_size, 1)),
        "LOCAL_RANK": str(a.local_rank),
        "LOCAL_WORLD_SIZE": str(max(a.local_world_size, 1)),
        "GROUP_RANK": str(a.group_rank),
        "MASTER_ADDR": master_addr(a, agent_address),
        "MASTER_PORT": str(a.master_port),
        "SILOD_BATCH_SIZE": str(a.batch_size or spec.batch_size),
        # The batch size gradient statistics are expressed at (the estimator's B0).
        "SILOD_BASE_BATCH_SIZE": str(spec.batch_size),
        "SILOD_STEP_COMPUTE_S": repr(spec.emulated_step_compute_s),
        # Wall-clock launch time: the SDK says how long the rank took to be ready to train.
        "SILOD_LAUNCH_TIME": f"{time.time():.3f}",
    }
    if not agent_visible:
        del env["SILOD_AGENT_PID"], env["SILOD_AGENT_START_TIME"]
    if spec.dataset:  # what the job reads through silod.data (the emulated job reads it each step)
        env["SILOD_DATASET"] = spec.dataset
    if spec.kind == common_pb2.JOB_KIND_INFERENCE:
        env["SILOD_JOB_KIND"] = "inference"
        env["SILOD_INFERENCE_DURATION_S"] = repr(spec.inference_duration_s)
    budget = spec.WhichOneof("budget")
    if budget == "sample_budget":
        env["SILOD_SAMPLE_BUDGET"] = str(spec.sample_budget)
    elif budget == "epochs":
        env["SILOD_EPOCHS"] = str(spec.epochs)
    env.update(spec.env)
    if a.local_world_size > 1 and "OMP_NUM_THREADS" not in env:
        # torchrun's default: ranks that share a node would otherwise each start a thread per
        # core and oversubscribe it. The job's or the operator's setting wins.
        env["OMP_NUM_THREADS"] = "1"
    if job_token:  # after spec.env: a rank holds its own job's credential and no other
        env["SILOD_AUTH_TOKEN"] = job_token
    return env
