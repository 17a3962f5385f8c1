"""`pip install silod` on every Python the package metadata names besides the suite's own.

pyproject.toml's classifiers name the Pythons the SDK supports; each one other than the suite's
(3.11, which test_client_wheel covers with torch) gets one fresh virtual environment per run with
the wheel and nothing else: no torch (PyPI's builds for 3.12 and 3.13 are multi-GB CUDA builds;
torch is the job's own dependency) and none of the server's packages. In it: every SDK module
loads or, for the PyTorch dataset/sampler and DDP modules, needs torch alone; the generated
stubs load against grpcio and protobuf and round-trip a message; silod.data says clearly that
torch is missing; the off-cluster job context works; the client commands run; and a job
submitted from that environment with its `silod submit`, running on its Python, reads its
dataset through the cache server of a cluster started from the full install.

An interpreter the metadata names but this machine lacks is skipped with a reason naming it, and
fails the run under CI=true. Both versions together take about a minute, most of it pip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import grpc
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from silod.v1 import cache_pb2, cache_pb2_grpc, common_pb2, metadata_pb2, scheduler_pb2_grpc
from tests.client_install.installs import (
    SUITE_PYTHON,
    Cluster,
    classified_pythons,
    client_env,
    find_python,
    installed_distributions,
    pip_install,
)

OTHER_PYTHONS = [v for v in classified_pythons() if v != SUITE_PYTHON]
SERVER_ONLY = ("sqlalchemy", "alembic", "scipy", "psycopg2-binary", "prometheus-client", "pydantic", "matplotlib",
               "aiohttp-cors", "grpcio-reflection", "torch")
FILES = 48
SIZE = 2000

# Modules that must load without torch and without server code (the rest of silod may need torch).
TORCH_FREE = ("silod.job", "silod.job.context", "silod.data", "silod.data.catalog", "silod.data.store",
              "silod.data.keys", "silod.rpc", "silod.rpc.channels", "silod.rpc.errors", "silod.manifest",
              "silod.cli", "silod.cli.main", "silod.cli.client_commands", "silod.cli.jobs", "silod.cli.nodes")

# Run by the client environment's Python, outside this checkout.
_PROBE = r'''
import importlib, json, os, pkgutil, sys, tempfile
import silod
result = {"file": silod.__file__, "loaded": [], "need_torch": [], "broken": {}}
for info in pkgutil.walk_packages(silod.__path__, "silod."):
    if info.name.endswith(".__main__"):
        continue
    try:
        importlib.import_module(info.name)
        result["loaded"].append(info.name)
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            result["need_torch"].append(info.name)
        else:
            result["broken"][info.name] = repr(exc)
    except Exception as exc:
        result["broken"][info.name] = repr(exc)

# The generated stubs, against this environment's protobuf and grpcio runtimes.
import grpc, google.protobuf
from silod.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
spec = common_pb2.JobSpec(name="stub-check", min_gpus=1, max_gpus=2, command=["python", "train.py"])
wire = scheduler_pb2.SubmitJobRequest(spec=spec).SerializeToString()
result["round_trip"] = scheduler_pb2.SubmitJobRequest.FromString(wire).spec == spec
result["stub"] = hasattr(scheduler_pb2_grpc.JobServiceStub(grpc.insecure_channel("127.0.0.1:1")), "SubmitJob")
result["runtimes"] = [grpc.__version__, google.protobuf.__version__]

# silod.data without torch: the package loads, its torch classes say what is missing.
import silod.data
try:
    from silod.data import SilodDataset
    result["data_error"] = None
except ImportError as exc:
    result["data_error"] = f"{type(exc).__name__}: {exc}"

# The job context off the cluster: rank 0 of 1, checkpoints in ./checkpoints (pickled: no torch).
os.chdir(tempfile.mkdtemp())
import silod.job
ctx = silod.job.init()
ctx.report(samples=8, steps=1, step_time_s=0.01)
saved = ctx.save_checkpoint({"step": 3, "weights": [0.5, 1.5]})
result["context"] = [type(ctx).__name__, ctx.rank, ctx.world_size, saved, ctx.load_checkpoint()]
ctx.done()
print(json.dumps(result))
'''

JOB_SCRIPT = r'''
"""A job owner's script without torch: silod.job for progress and checkpoints, the generated
stubs to read the dataset through the node's cache server."""
import hashlib, os, sys
import silod, silod.job
from silod.data.catalog import load_manifest
from silod.rpc.channels import open_channel
from silod.v1 import cache_pb2, cache_pb2_grpc, metadata_pb2_grpc

ctx = silod.job.init()
channel = open_channel(os.environ["SILOD_METADATA_ADDR"])
manifest = load_manifest(metadata_pb2_grpc.MetadataServiceStub(channel), os.environ["SILOD_DATASET"])
channel.close()
channel = open_channel(os.environ["SILOD_CACHE_ADDR"])
cache = cache_pb2_grpc.CacheServiceStub(channel)
digest, count, done_leases = 0, 0, []
for start in range(0, len(manifest.keys), 16):
    keys = manifest.keys[start:start + 16]
    lease = cache.Lease(cache_pb2.LeaseRequest(job_id=ctx.job_id, dataset=manifest.name, keys=keys,
                                               release_lease_ids=done_leases))
    for obj in lease.objects:
        with open(obj.path, "rb") as f:
            data = f.read()
        assert len(data) == manifest.sizes[manifest.index[obj.key]], obj.key
        digest ^= int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
    count += len(keys)
    done_leases = [lease.lease_id]
    ctx.report(samples=len(keys), steps=1, batch_size=16, step_time_s=0.01)
cache.ReleaseLease(cache_pb2.ReleaseLeaseRequest(lease_id=lease.lease_id))
channel.close()
ctx.save_checkpoint({"samples": count})
assert ctx.load_checkpoint() == {"samples": count}
print(f"client-job: {count} samples digest {digest:016x} python {sys.version_info[0]}.{sys.version_info[1]} "
      f"silod {silod.__file__}", flush=True)
ctx.done()
'''


def test_the_metadata_names_the_pythons_it_is_tested_on(silod_wheel: Path) -> None:
    """The wheel's Requires-Python admits every classified version and none older; the suite's
    own Python is one of them and there are others (each tested below)."""
    with zipfile.ZipFile(silod_wheel) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(wheel.read(name).decode())
    requires = SpecifierSet(metadata["Requires-Python"])
    versions = [c.rsplit(" :: ", 1)[1] for c in metadata.get_all("Classifier")
                if c.startswith("Programming Language :: Python :: 3.")]
    assert versions == classified_pythons() and SUITE_PYTHON in versions and OTHER_PYTHONS
    assert all(requires.contains(f"{v}.0") for v in versions), (requires, versions)
    oldest = min(versions, key=lambda v: int(v.split(".")[1]))
    assert not requires.contains(f"3.{int(oldest.split('.')[1]) - 1}.99"), requires
    # `pip install silod` brings no torch and no server package on any Python.
    plain = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    plain = [r.name.lower().replace("_", "-") for r in plain if r.marker is None or "extra" not in str(r.marker)]
    assert "grpcio" in plain and not set(plain) & set(SERVER_ONLY), plain


@pytest.fixture(scope="module", params=OTHER_PYTHONS)
def sdk_python(request: pytest.FixtureRequest, silod_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment of that Python with the silod wheel alone (one per run)."""
    version: str = request.param
    interpreter = find_python(version)
    if interpreter is None:
        reason = (f"python{version} not found (on PATH or in pyenv): `pip install silod` on Python {version}, "
                  "which pyproject.toml's classifiers claim, is untested")
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    root = tmp_path_factory.mktemp(f"sdk-python{version}")
    subprocess.run([str(interpreter), "-m", "venv", str(root / "venv")], check=True, timeout=120, env=client_env())
    python = root / "venv" / "bin" / "python"
    pip_install(python, str(silod_wheel))
    return python


def test_the_sdk_installs_alone_and_loads(sdk_python: Path, tmp_path: Path) -> None:
    installed = installed_distributions(sdk_python)
    assert {"silod", "grpcio", "protobuf"} <= installed
    assert installed.isdisjoint(SERVER_ONLY), installed & set(SERVER_ONLY)
    check = subprocess.run([str(sdk_python), "-m", "pip", "check", "--disable-pip-version-check"],
                           capture_output=True, text=True, timeout=120, env=client_env())
    assert check.returncode == 0, check.stdout + check.stderr

    done = subprocess.run([str(sdk_python), "-c", _PROBE], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env=client_env())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(sdk_python.parent.parent)), result["file"]  # the installed silod
    assert result["broken"] == {}  # every module loads, or needs torch and nothing else
    assert set(TORCH_FREE) <= set(result["loaded"]), set(TORCH_FREE) - set(result["loaded"])
    assert "silod.data.dataset" in result["need_torch"]  # torch really is absent
    stubs = {m for m in result["loaded"] if m.startswith("silod.v1.")}
    assert {"silod.v1.common_pb2", "silod.v1.scheduler_pb2_grpc", "silod.v1.cache_pb2_grpc"} <= stubs
    assert result["round_trip"] and result["stub"], result
    assert result["runtimes"][0] == "1.85.1" and result["runtimes"][1].startswith("7."), result["runtimes"]
    assert result["data_error"] is not None and result["data_error"].startswith("ImportError: ")
    assert "needs torch in the job's environment" in result["data_error"], result["data_error"]
    assert result["context"] == ["LocalContext", 0, 1, True, {"step": 3, "weights": [0.5, 1.5]}], result["context"]


def _silod(python: Path, *argv: str, cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python.parent / "silod"), *argv], capture_output=True, text=True, timeout=timeout_s,
                          cwd=cwd, env=client_env())


def test_the_client_commands_run_and_server_commands_name_the_extra(sdk_python: Path, tmp_path: Path) -> None:
    for argv in (["--help"], ["submit", "--help"], ["jobs", "--help"], ["watch", "--help"], ["logs", "--help"],
                 ["cancel", "--help"], ["nodes", "--help"], ["dataset", "list", "--help"], ["health", "--help"]):
        done = _silod(sdk_python, *argv, cwd=tmp_path)
        assert done.returncode == 0 and "usage: silod" in done.stdout, (argv, done.stderr[-2000:])
    for argv, extra in ((["metadata"], "silod[server]"), (["simulate", "list"], "silod[sim]")):
        done = _silod(sdk_python, *argv, cwd=tmp_path)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert f"pip install '{extra}'" in done.stderr and "Traceback" not in done.stderr, (argv, done.stderr)


def test_a_job_submitted_from_this_python_runs_on_it(sdk_python: Path, sdk_cluster: Cluster, tmp_path: Path) -> None:
    """The client commands of this environment against a cluster of the full install (the suite's
    Python): the job they submit runs this environment's Python and reads through the cache."""
    version = subprocess.run([str(sdk_python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    dataset = f"sdk-py{version.replace('.', '')}"
    expected = sdk_cluster.dataset(dataset, FILES, SIZE, seed=int(version.split(".")[1]))
    (tmp_path / "train.py").write_text(JOB_SCRIPT)
    (tmp_path / "job.yaml").write_text(json.dumps({
        "name": f"sdk-python-{version}", "min_gpus": 1, "max_gpus": 1, "batch_size": 16, "sample_budget": FILES,
        "dataset": dataset, "command": [str(sdk_python), str(tmp_path / "train.py")]}))
    scheduler = ["--scheduler", sdk_cluster.scheduler]

    assert _silod(sdk_python, "health", sdk_cluster.metadata, cwd=tmp_path).returncode == 0
    listed = _silod(sdk_python, "dataset", "list", "--metadata", sdk_cluster.metadata, cwd=tmp_path)
    assert listed.returncode == 0 and dataset in listed.stdout, listed.stdout + listed.stderr
    submitted = _silod(sdk_python, "submit", str(tmp_path / "job.yaml"), *scheduler, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().splitlines()[-1]
    watched = _silod(sdk_python, "watch", job_id, *scheduler, cwd=tmp_path, timeout_s=180)
    log = sdk_cluster.rank_log(job_id) if (sdk_cluster.root / "work" / "jobs" / job_id).exists() else ""
    assert watched.returncode == 0, watched.stdout[-2000:] + watched.stderr[-2000:] + log

    venv = sdk_python.parent.parent
    line = f"client-job: {FILES} samples digest {expected:016x} python {version} silod {venv}/lib/"
    logs = _silod(sdk_python, "logs", job_id, "--rank", "0", "--metadata", sdk_cluster.metadata, cwd=tmp_path)
    assert logs.returncode == 0 and line in logs.stdout, logs.stdout[-3000:] + logs.stderr[-2000:]
    jobs = _silod(sdk_python, "jobs", *scheduler, cwd=tmp_path)
    assert jobs.returncode == 0 and any(job_id in row and "SUCCEEDED" in row for row in jobs.stdout.splitlines()), \
        jobs.stdout

    # What the cluster itself says, over the suite's own stubs.
    with grpc.insecure_channel(sdk_cluster.scheduler) as channel:
        job = scheduler_pb2_grpc.JobServiceStub(channel).GetJob(metadata_pb2.GetJobRequest(job_id=job_id), timeout=10)
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED and job.progress.samples_done == FILES
    with grpc.insecure_channel(sdk_cluster.cache) as channel:
        stats = cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.StatsRequest(job_id=job_id), timeout=5)
    assert stats.jobs and stats.jobs[0].misses == FILES and stats.jobs[0].remote_bytes == FILES * SIZE
    assert sys.version_info[:2] != tuple(int(p) for p in version.split("."))  # not the suite's own Python
