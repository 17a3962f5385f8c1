"""Every shell command the getting-started material and the guides show runs here, or is listed in
NOT_RUN with the reason it cannot and the test that covers it instead.

The guides are README.md and the docs pages in GUIDES; every other docs page is listed in
NOT_GUIDES with what it is, so a new page must be placed in one of the two. Their fenced
``sh``/``bash``/``shell``/``console`` blocks are read as a user would type them: continuation lines
joined, comments dropped, here-documents kept with their command.

Each block runs as a shell session of its own, in one working directory shared by the whole test
(so `job.yaml` written by one block is there for the next), against one `silod up` started once for
the module: README's getting-started `silod up --nodes 4 --gpus-per-node 2`. A block that starts a
`silod up` of its own runs it in a directory of its own. Background commands (`... &`) are started
and waited for (the port of their `--listen`, or a `silod up`'s cluster.json) and stopped when their
block ends; `kill %N` stops the block's N-th. What a user would put in place of the guides'
placeholders is put in by `Session.rewrite`: PATHS under the test's directory, free ports for the
services a page starts itself, the module cluster's for silod's DEFAULT_PORTS, the page's last
submitted job for JOB. A command must exit 0, or as NONZERO says; one that would start a program
outside PROGRAMS fails unrun, so nothing new runs on this machine before someone has looked at it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GUIDES = ["README.md", "docs/operators.md", "docs/cache.md", "docs/clients.md", "docs/distributed.md",
          "docs/development.md", "docs/configuration.md", "docs/tenants.md", "docs/containers.md"]
NOT_GUIDES = {
    "docs/api.md": "reference, generated from the protos",
    "docs/configuration-reference.md": "reference, generated from the settings",
    "docs/metrics.md": "reference, generated from the code",
    "docs/architecture.md": "concepts",
    "docs/estimator.md": "concepts: the performance model",
    "docs/policies.md": "concepts: the scheduling policies",
    "docs/benchmarks.md": "results: each command is a benchmark of minutes, its figure on the page",
    "docs/evaluation.md": "results: simulations of the evaluation, minutes each",
    "docs/results.md": "results: one line per figure, commands from benchmarks.md and evaluation.md",
    "docs/sizing.md": "results: how far one control plane goes",
}

# The README's getting-started cluster: the module fixture runs it, every block against it.
CLUSTER_COMMAND = "silod up --nodes 4 --gpus-per-node 2 &"

# THE table: every guide command this test does not run, by its first line as the guide shows it
# (comments dropped; "page: command" where the same command runs on another page), with why not
# here and what runs it instead.
DOCKER = ("needs Docker and the python:3.11-slim image from a registry; tests/deploy/test_compose_docker.py builds "
          "the image FROM a local base, tests/deploy/test_deploy_image.py checks the Dockerfile")
COMPOSE_CLUSTER = ("needs Docker, root and minutes; tests/deploy/test_compose_docker.py runs the compose section's "
                   "commands in its order (tests/deploy/test_operator_docs.py holds the section to them)")
K8S = "needs a Kubernetes cluster; tests/deploy/test_deploy_k8s.py checks the manifests offline"
SYSTEMD = "installs into the host (/opt, /etc, systemd); tests/deploy/test_deploy_systemd.py checks the units"
AUTH = "needs a cluster started with an auth token; tests/tenancy/test_cli_access.py runs these commands"
SAME_AS_TENANTS = ("docs/tenants.md runs the same command on the same cluster (a tenant is made once); "
                   "tests/tenancy/test_cli_access.py runs it with auth on")
TENANT_DATASET = ("a placeholder bucket (S3 credentials and a tenant of the same name); "
                  "tests/tenancy/test_dataset_tenants_processes.py registers datasets per tenant and shared")
CREDENTIAL_ID = "ID is a credential's id from the list above; tests/tenancy/test_cli_access.py rotates and revokes one"
NODE_CLIENT = "needs npm packages from the registry; tests/clients/test_node_client.py runs the Node.js client against a cluster"
DDP_JOB = ("a real DDP job (minutes of CPU here); tests/e2e/test_elastic_resize.py and tests/worker_agent/"
           "test_ddp_resize.py run the same example on a cluster")
def _compose_guide_lines() -> list[str]:
    """The compose section's commands as docs/operators.md shows them (JOB, scheduler-2 and scheduler
    for the placeholders): tests/deploy/compose_guide.py's, which tests/deploy/test_compose_docker.py runs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compose_guide", ROOT / "tests" / "deploy" / "compose_guide.py")
    assert spec is not None and spec.loader is not None
    guide = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guide)
    return sorted({guide.command(step, job="JOB", leader="scheduler-2", standby="scheduler") for step in guide.GUIDE})


NOT_RUN: dict[str, str] = {
    # README.md
    "make demo": "the whole demo (about a minute and a half); tests/test_demo.py runs it",
    "make test": "the suite itself; CI runs it (.ci/run)",
    # docs/development.md
    "make proto": "rewrites the generated code; tests/test_contracts.py checks it is current",
    "silod up --cluster typed.yaml --policy gavel &": (
        "a third cluster (10-40 s to start here); tests/deploy/test_operator_docs.py parses its flags, and every "
        "policy's typed placement runs in tests/scheduler and tests/simulator"),
    "silod simulate --workload workload-6 --policy pollux --out results/pollux-w6": (
        "a 3-30 s simulation here; tests/simulator/test_cli.py runs `silod simulate` on a packaged workload"),
    "silod simulate compare --workload workload-6 --policy tiresias --policy pollux --out results/w6": (
        "a 5-35 s simulation here; tests/simulator/test_cli.py runs `compare` and checks its table and plot"),
    # docs/operators.md
    "silod up --nodes 2 --gpus-per-node 4 --state-dir .silod/cluster":
        "a second cluster of another shape: README's `silod up --nodes 4 --gpus-per-node 2`, which this test runs, "
        "stands for it (same state dir); tests/deploy/test_operator_docs.py parses its flags",
    "docker build -f deploy/Dockerfile -t silod:latest .": DOCKER,
    "docker run --rm silod:latest health metadata.example.internal:7070": DOCKER,
    "debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm build/rootfs "
    "http://deb.debian.org/debian": COMPOSE_CLUSTER + " (tests/support/docker_engine.py makes its base so)",
    "cp /etc/ssl/certs/ca-certificates.crt build/rootfs/etc/ssl/certs/ca-certificates.crt": COMPOSE_CLUSTER,
    "tar -C build/rootfs -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' "
    "- silod-local/base": COMPOSE_CLUSTER,
    **{line: COMPOSE_CLUSTER for line in _compose_guide_lines()},
    "curl -s http://127.0.0.1:8080/api/overview": COMPOSE_CLUSTER + " (its dashboard)",
    "curl -s http://127.0.0.1:9090/api/v1/targets": COMPOSE_CLUSTER + " (its Prometheus)",
    "curl -s http://127.0.0.1:9090/api/v1/alerts": COMPOSE_CLUSTER + " (its Prometheus)",
    "python3.11 -m venv /opt/silod": SYSTEMD,
    "/opt/silod/bin/pip install /path/to/silod": SYSTEMD,
    "useradd --system --home-dir /var/lib/silod silod": SYSTEMD,
    "install -d -m 0750 /etc/silod": SYSTEMD,
    "install -m 0600 deploy/systemd/silod.env deploy/systemd/metadata.env /etc/silod/": SYSTEMD,
    "install -m 0644 deploy/systemd/silod-*.service /etc/systemd/system/": SYSTEMD,
    "systemctl daemon-reload": SYSTEMD,
    "systemctl enable --now silod-metadata silod-estimator silod-scheduler@1": SYSTEMD,
    "systemctl enable --now silod-scheduler@2": SYSTEMD,
    "systemctl enable --now silod-cache-server silod-worker-agent": SYSTEMD,
    "docker build -f deploy/Dockerfile -t registry.example.com/silod:0.1.0 .": DOCKER,
    "docker push registry.example.com/silod:0.1.0": DOCKER + " and a registry",
    "kubectl apply -f deploy/k8s/namespace.yaml": K8S,
    "kubectl -n silod create secret generic silod --from-literal=auth-token=\"$(openssl rand -hex 32)\" "
    "--from-literal=db-url='postgresql+psycopg2://silod:PASSWORD@db.example.com:5432/silod' "
    "--from-literal=aws-access-key-id=KEY --from-literal=aws-secret-access-key=SECRET": K8S,
    "kubectl label node gpu-node-1 gpu-node-2 silod/node=true": K8S,
    "kubectl apply -k deploy/k8s": K8S,
    "kubectl -n silod get pods -w": K8S,
    "kubectl -n silod port-forward svc/silod-scheduler 7073:7073 &": K8S,
    "kubectl -n silod exec statefulset/silod-scheduler -- silod logs JOB --metadata silod-metadata:7070": K8S,
    "silod nodes clear-gpu-fault gpu-07 3": ("needs a GPU that NVML reported faulty; tests/worker_agent/test_gpu_health.py "
                                            "and tests/cli_cluster/test_up_and_jobs.py clear faults"),
    "export SILOD_AUTH_TOKEN=...": AUTH,
    "docs/operators.md: silod admin tenant create vision alice bob": SAME_AS_TENANTS,
    "docs/operators.md: silod admin tenant members vision --add carol --remove bob": SAME_AS_TENANTS,
    "silod dataset register imagenet s3://datasets/imagenet --tenant vision": TENANT_DATASET,
    "silod dataset register cifar10 s3://datasets/cifar10 --shared": TENANT_DATASET,
    "silod login --token-file alice.token": ("needs the token the line above prints, saved to alice.token; "
                                             "tests/tenancy/test_cli_access.py logs in with one"),
    "silod admin credential rotate ID": CREDENTIAL_ID,
    "silod admin credential revoke ID": CREDENTIAL_ID,
    "silod db upgrade --db postgresql+psycopg2://silod:PASSWORD@db.example.com:5432/silod":
        "needs that PostgreSQL server; tests/metadata/test_metadata_migrations.py upgrades scratch databases",
    # docs/cache.md
    "silod dataset register imagenet-mini s3://bucket/imagenet-mini --option endpoint_url=http://127.0.0.1:9000":
        "a placeholder bucket; the page's walk-through registers from a running store emulator, which this test runs",
    "silod dataset preload imagenet-mini --cache 127.0.0.1:7071":
        "needs the dataset of the line above; tests/cache_server/test_cache_processes.py preloads a registered dataset",
    "silod dataset register imagenet-wds s3://bucket/imagenet/train --format tar-shards --option endpoint_url=...":
        "a placeholder bucket; tests/sdk/test_shards.py registers tar shards from a store emulator",
    "python benchmarks/data_loading.py": "a 12-minute benchmark; docs/benchmarks.md gives its figures and --quick",
    # docs/clients.md
    "cd clients/node && npm ci": NODE_CLIENT,
    "export SILOD_SCHEDULER_ADDR=127.0.0.1:7073": NODE_CLIENT,
    "node silod-client.mjs submit my-job --gpus 2 --samples 6400 --request-id my-job-1": NODE_CLIENT,
    "node silod-client.mjs watch job-3f9c2a1b7d4e": NODE_CLIENT,
    "node silod-client.mjs datasets": NODE_CLIENT,
    # docs/distributed.md
    "silod submit digits.yaml": DDP_JOB,
    "docs/distributed.md: silod watch JOB": DDP_JOB,
    "docs/distributed.md: silod logs JOB --rank 0 --follow": DDP_JOB,
}

# What a command may start: anything else fails unrun, so a new command is never run on this machine
# before someone has looked at it (an entry above, or a program here).
PROGRAMS = {"silod", "python", "cat", "mkdir", "cp", "curl", "grep", "kill", "."}

# Commands that run but, in the order the guide shows them, end otherwise than with exit 0.
NONZERO: dict[str, tuple[int, str]] = {
    # README cancels the job it has just watched to its end: a clear FAILED_PRECONDITION.
    'silod cancel JOB --reason "not needed"': (1, "FAILED_PRECONDITION: job_id: job job-"),
}

# Paths a guide writes to or reads from, moved under the test's directory ({work}); HOME is there too.
PATHS = ["/data/", "/srv/store", "/var/cache/silod"]
# silod's default ports: a page that starts no service on one means the cluster's.
DEFAULT_PORTS = {7070: "metadata", 7072: "estimator", 7073: "scheduler", 8080: "dashboard"}

FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w-]*)")
SHELL_LANGS = {"sh", "bash", "shell", "console"}


@dataclass
class Command:
    page: str
    line: int
    text: str                # what runs: continuation lines joined, comments dropped, a here-document kept
    key: str                 # its first line: what NOT_RUN and NONZERO name
    background: bool = False


@dataclass
class Block:
    page: str
    line: int
    commands: list[Command] = field(default_factory=list)


def _strip_comment(line: str) -> str:
    """The line without a `# ...` comment (a # that starts a word outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def blocks(page: str, text: str) -> list[Block]:
    """The shell blocks of a page, each a list of commands."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip().strip("`~") == ""):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if lang in SHELL_LANGS:
            found.append(Block(page, i + 1, _commands(page, i + 2, body, console=lang == "console")))
        i = j + 1
    return found


def _commands(page: str, first_line: int, body: list[str], console: bool) -> list[Command]:
    out: list[Command] = []
    k = 0
    while k < len(body):
        raw, line_no = body[k], first_line + k
        k += 1
        if console:
            if not raw.startswith("$ "):
                continue  # output
            raw = raw[2:]
        line = _strip_comment(raw.strip())
        while line.endswith("\\") and k < len(body):
            line = line[:-1].rstrip() + " " + _strip_comment(body[k].strip())
            k += 1
        if not line:
            continue
        text = line
        heredoc = re.search(r"<<-?\s*(['\"]?)(\w+)\1", line)
        if heredoc:
            doc = []
            while k < len(body) and body[k].strip() != heredoc.group(2):
                doc.append(body[k])
                k += 1
            k += 1
            text = "\n".join([line, *doc, heredoc.group(2)])
        background = bool(re.search(r"(?<!&)&$", line))
        out.append(Command(page, line_no, text, line, background))
    return out


def not_run(cmd: Command) -> str | None:
    """Why ``cmd`` is not run here, or None."""
    return NOT_RUN.get(f"{cmd.page}: {cmd.key}", NOT_RUN.get(cmd.key))


def guide_blocks() -> list[Block]:
    return [b for page in GUIDES if (ROOT / page).exists() for b in blocks(page, (ROOT / page).read_text())]


# ---- running ----------------------------------------------------------------------------------------------------


def _port_open(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SILOD_")}
    env.update(HOME=str(work / "home"), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(ROOT))
    return env


def _stop(proc: subprocess.Popen[bytes], timeout: float = 15) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def _state_dir(command: str, cwd: Path) -> Path:
    m = re.search(r"--state-dir\s+(\S+)", command)
    return cwd / (m.group(1) if m else ".silod/cluster")


@dataclass
class Session:
    """One block's shell session: its background jobs, the ports its page's services got, the last job."""

    work: Path
    cwd: Path
    ports: dict[int, str]
    cluster: dict  # type: ignore[type-arg]
    jobs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    last_job: str = ""
    log: list[str] = field(default_factory=list)

    def rewrite(self, text: str) -> str:
        for path in PATHS:
            text = text.replace(path, f"{self.work}{path}")
        text = re.sub(r"~/", f"{self.work}/home/", text)
        text = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: self.ports.get(int(m.group(1)), m.group(0)), text)
        if self.last_job:
            text = re.sub(r"\bJOB\b", self.last_job, text)
        return text

    def run(self, cmd: Command) -> str | None:
        """Run one command; None when it did what it should, else what went wrong."""
        text = self.rewrite(cmd.text)
        programs = {part.split()[0] for part in re.split(r"&&|\|\||;|\|", cmd.key.rstrip("& ")) if part.split()}
        if not programs <= PROGRAMS:
            return (f"not run: {sorted(programs - PROGRAMS)} is not a program this test starts; run it with one that "
                    "is, or list the command in NOT_RUN with why it cannot run here and what covers it")
        kill = re.fullmatch(r"kill %(\d+)", text.strip())
        if kill:
            proc = self.jobs[int(kill.group(1)) - 1]
            rc = _stop(proc)
            return None if rc in (0, -signal.SIGTERM) else f"exited {rc} on SIGTERM"
        if cmd.background:
            proc = subprocess.Popen(["bash", "-c", text.rstrip("& ")], cwd=self.cwd, env=_env(self.work),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            self.jobs.append(proc)
            listen = re.search(r"--listen\s+(\S+)", text)
            ready = ((lambda: _port_open(listen.group(1))) if listen else  # noqa: E731
                     (lambda: (_state_dir(text, self.cwd) / "cluster.json").exists()) if " up " in f" {text} " else
                     (lambda: True))
            deadline = time.monotonic() + 120  # a loaded 2-core machine starts a `silod up` in 10-60 s
            while not ready():
                if proc.poll() is not None:
                    return f"exited {proc.returncode} before it was ready"
                if time.monotonic() > deadline:
                    return "not ready after 120 s"
                time.sleep(0.1)
            return None
        done = subprocess.run(["bash", "-c", "set -o pipefail\n" + text], cwd=self.cwd, env=_env(self.work),
                              capture_output=True, text=True, timeout=90)
        output = done.stdout + done.stderr
        self.log.append(f"$ {text}\n{output}")
        if cmd.key.startswith("silod submit") and done.returncode == 0:
            self.last_job = done.stdout.split()[-1]
        want_rc, needle = NONZERO.get(cmd.key, (0, ""))
        if done.returncode != want_rc or needle not in output:
            return f"exit {done.returncode} (want {want_rc}{', ' + repr(needle) if needle else ''}):\n{output[-1500:]}"
        return None

    def close(self) -> None:
        for proc in reversed(self.jobs):
            _stop(proc)


def _make_inputs(work: Path) -> None:
    """The user's own files the guides name: a few images wherever a guide reads a folder of them."""
    for folder in ("data/imagenet-mini", "data/store/demo/images", "home/imagenet-mini"):
        (work / folder).mkdir(parents=True, exist_ok=True)
        for i in range(8):
            (work / folder / f"{i:06d}.jpg").write_bytes(bytes([i]) * 4096)
    for name in (".venv", "examples", "benchmarks", "clients", "deploy", "protos"):
        (work / name).symlink_to(ROOT / name)  # the guides run from a checkout: `. .venv/bin/activate`, examples/...


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:  # type: ignore[type-arg]
    """README's getting-started `silod up`, started once in the directory every block runs in."""
    work = tmp_path_factory.mktemp("guides")
    _make_inputs(work)
    assert CLUSTER_COMMAND in (ROOT / "README.md").read_text(), "README no longer shows the cluster this test starts"
    up = subprocess.Popen(["bash", "-c", CLUSTER_COMMAND.rstrip("& ")], cwd=work, env=_env(work),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        state = work / ".silod" / "cluster" / "cluster.json"
        deadline = time.monotonic() + 120
        while not state.exists():
            assert up.poll() is None, f"silod up exited {up.returncode}"
            assert time.monotonic() < deadline, "cluster.json not written"
            time.sleep(0.1)
        yield work, json.loads(state.read_text())
    finally:
        _stop(up, timeout=30)


def _cluster_ports(info: dict) -> dict[int, str]:  # type: ignore[type-arg]
    addr = {"metadata": info["metadata"], "estimator": info["estimator"], "scheduler": info["scheduler"],
            "dashboard": info["dashboard"].removeprefix("http://").rstrip("/")}
    return {port: addr[name] for port, name in DEFAULT_PORTS.items()}


def test_every_guide_command_runs_or_is_listed(cluster: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    work, info = cluster
    failures: list[str] = []
    for page in GUIDES:
        if not (ROOT / page).exists():
            continue
        page_blocks = blocks(page, (ROOT / page).read_text())
        # the ports the page's own services listen on get free ones; silod's defaults otherwise name the cluster's
        ports = _cluster_ports(info)
        last_job = ""  # what JOB stands for: the page's last submitted job
        for cmd in (c for b in page_blocks for c in b.commands):
            for port in re.findall(r"--listen\s+127\.0\.0\.1:(\d+)", cmd.text):
                ports[int(port)] = f"127.0.0.1:{_free_port()}"
        for block in page_blocks:
            runs = [c for c in block.commands if not_run(c) is None and c.key != CLUSTER_COMMAND]
            own_up = any(re.match(r"silod up\b", c.key) for c in runs)
            cwd = work / f"up-{page.replace('/', '-')}-{block.line}" if own_up else work
            cwd.mkdir(exist_ok=True)
            session = Session(work, cwd, ports, info, last_job=last_job)
            try:
                for cmd in runs:
                    problem = session.run(cmd)
                    if problem:
                        failures.append(f"{cmd.page}:{cmd.line}: {cmd.key}\n  {problem}")
                        break  # the rest of the block depends on it
            finally:
                session.close()
            last_job = session.last_job
    assert not failures, "\n\n".join(failures)


# ---- what the table and the page lists must hold, checked without running anything ---------------------------------


def test_every_docs_page_is_a_guide_or_listed() -> None:
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    unplaced = pages - set(GUIDES) - set(NOT_GUIDES)
    assert not unplaced, f"place each in GUIDES (its commands run here) or NOT_GUIDES (with what it is): {unplaced}"


def test_no_guide_hides_commands_in_an_unlabelled_block() -> None:
    """A fence without a language whose first line reads as a command (`silod ...`, `$ ...`) would escape
    this test: label it sh (or console for a transcript)."""
    hidden = []
    for page in GUIDES:
        if (ROOT / page).exists():
            lines = (ROOT / page).read_text().splitlines()
            opened = False
            for i, line in enumerate(lines):
                m = FENCE.match(line)
                if m and not opened:
                    opened = True
                    first = next((x for x in lines[i + 1:] if x.strip()), "")
                    if not m.group(3) and re.match(r"(\$ |silod |python |make )", first):
                        hidden.append(f"{page}:{i + 1}: {first}")
                elif line.strip().startswith(("```", "~~~")) and opened:
                    opened = False
    assert not hidden, hidden


def test_every_entry_names_a_command_a_guide_shows() -> None:
    shown = {c.key for b in guide_blocks() for c in b.commands}
    assert CLUSTER_COMMAND in shown
    shown |= {f"{c.page}: {c.key}" for b in guide_blocks() for c in b.commands}
    stale = (set(NOT_RUN) | set(NONZERO)) - shown
    assert not stale, f"entries for commands no guide shows any more: {sorted(stale)}"
    assert all(reason.strip() for reason in NOT_RUN.values())
    named = {path for reason in NOT_RUN.values() for path in re.findall(r"tests/[\w/]+\.py", reason)}
    assert named and not [path for path in named if not (ROOT / path).exists()], "a reason names a test that is gone"


def test_commands_are_read_as_a_user_types_them() -> None:
    page = """text
```sh
. .venv/bin/activate        # comment
silod up --nodes 2 \\
    --gpus-per-node 4 &      # starts it
# a whole comment line
cat > job.yaml <<'YAML'
name: x   # kept: part of the file
YAML
silod cancel JOB --reason "a # in quotes"
```

```console
$ silod jobs
ID  NAME
```

  ```bash
  make demo
  ```
```python
print("not shell")
```
"""
    got = [(c.key, c.background) for b in blocks("p.md", page) for c in b.commands]
    assert got == [(". .venv/bin/activate", False), ("silod up --nodes 2 --gpus-per-node 4 &", True),
                   ("cat > job.yaml <<'YAML'", False), ('silod cancel JOB --reason "a # in quotes"', False),
                   ("silod jobs", False), ("make demo", False)]
    heredoc = blocks("p.md", page)[0].commands[2]
    assert heredoc.text == "cat > job.yaml <<'YAML'\nname: x   # kept: part of the file\nYAML"
    assert blocks("p.md", page)[0].commands[1].line == 4


def test_a_new_unlisted_command_fails(tmp_path: Path) -> None:
    """What the main test does with a command nobody listed: it runs it, and a failing one is reported."""
    session = Session(tmp_path, tmp_path, {}, {})
    assert "not a program this test starts" in (session.run(Command("x.md", 1, "rm -rf /tmp/x", "rm -rf /tmp/x")) or "")
    assert "exit 2" in (session.run(Command("x.md", 2, "silod nowhere", "silod nowhere")) or "")
    assert session.run(Command("x.md", 3, "mkdir -p a && cat /dev/null | grep -c x || true", "mkdir -p a")) is None
    assert "silod nowhere" not in NOT_RUN
