"""The commands of docs/operators.md "Docker Compose", in the guide's order: what
tests/deploy/test_compose_docker.py runs against a real Docker Engine, and what
tests/deploy/test_operator_docs.py holds the guide to (every `docker`, `export` and `.venv/bin/python`
line of that section, in order, is one of these, a {placeholder} standing for one word).

The images are those of a machine where no registry is at hand: the guide makes a Debian bookworm
base from Debian's packages and tags it silod-local/base (the test tags the one
tests/support/docker_engine.py makes from the same recipe), and a training image with PyTorch and
the SDK, silod-local/torch (the test's: that module's job image, the CPU PyTorch of this machine's
disk); every other image is built FROM them by the commands below.
"""

from __future__ import annotations

import re

COMPOSE = "docker compose -f deploy/compose.yaml"
BASE = "silod-local/base"
TORCH = "silod-local/torch"
IMAGES = {  # the compose file's variable -> the image the guide builds for it
    "SILOD_IMAGE": "silod-local/silod",
    "SILOD_POSTGRES_IMAGE": "silod-local/postgres",
    "SILOD_OBJECTSTORE_IMAGE": "silod-local/objectstore",
    "SILOD_PROMETHEUS_IMAGE": "silod-local/prometheus",
}
DIGITS_JOB_IMAGE = "silod-local/digits-job"  # examples/compose/digits*.yaml name it
UPLOAD = ("import s3fs; fs = s3fs.S3FileSystem(endpoint_url='http://objectstore:5000'); fs.mkdir('datasets'); "
          "fs.put('/digits/', 'datasets/digits/', recursive=True)")

BUILDS = {
    "build-silod": f"docker build -f deploy/Dockerfile --build-arg PYTHON_IMAGE={BASE} -t {IMAGES['SILOD_IMAGE']} .",
    **{f"build-{name}": f"docker build --build-arg BASE={BASE} -t {IMAGES[variable]} deploy/local-images/{name}"
       for name, variable in (("postgres", "SILOD_POSTGRES_IMAGE"), ("objectstore", "SILOD_OBJECTSTORE_IMAGE"),
                              ("prometheus", "SILOD_PROMETHEUS_IMAGE"))},
    "build-digits-job": f"docker build -f deploy/local-images/digits-job/Dockerfile --build-arg JOB_BASE={TORCH} "
                        f"-t {DIGITS_JOB_IMAGE} examples",
}

GUIDE: dict[str, str] = {
    **BUILDS,
    "images": "export " + " ".join(f"{k}={v}" for k, v in IMAGES.items()),
    "up": f"{COMPOSE} up -d --wait",
    "ps": f"{COMPOSE} ps",
    "prepare": ".venv/bin/python examples/train_ddp_digits.py prepare build/digits",
    "upload": f'{COMPOSE} run --rm -v "$PWD/build/digits:/digits:ro" --entrypoint python cli -c "{UPLOAD}"',
    "register": f"{COMPOSE} run --rm cli dataset register digits s3://datasets/digits "
                "--option endpoint_url=http://objectstore:5000",
    "submit": f'{COMPOSE} run --rm -v "$PWD/examples/compose:/jobs:ro" cli submit /jobs/digits.yaml',
    "watch": f"{COMPOSE} run --rm cli watch {{job}}",
    "logs": f"{COMPOSE} run --rm cli logs {{job}}",
    # Failures, while a longer job runs.
    "submit-long": f'{COMPOSE} run --rm -v "$PWD/examples/compose:/jobs:ro" cli submit /jobs/digits-long.yaml',
    "leader": f"{COMPOSE} run --rm cli admin leader --json",
    "kill-leader": f"{COMPOSE} kill {{leader}}",
    "leader-again": f"{COMPOSE} run --rm cli admin leader --json",
    "submit-new": f'{COMPOSE} run --rm -v "$PWD/examples/compose:/jobs:ro" cli submit --scheduler {{standby}}:7073 '
                  "/jobs/emulated.yaml",
    "watch-new": f"{COMPOSE} run --rm cli watch --scheduler {{standby}}:7073 {{job}}",
    "restart-postgres": f"{COMPOSE} restart postgres",
    "stop-agent": f"{COMPOSE} stop agent-1",
    "watch-long": f"{COMPOSE} run --rm cli watch --scheduler {{standby}}:7073 {{job}}",
    "down": f"{COMPOSE} down -v",
}


def command(step: str, **values: str) -> str:
    """The guide's command of ``step`` with its placeholders filled in."""
    return GUIDE[step].format(**values)


def pattern(step: str) -> re.Pattern[str]:
    """A guide line that is ``step``'s command, any one word in place of each placeholder."""
    parts = re.split(r"\{\w+\}", GUIDE[step])
    return re.compile(r"\S+".join(re.escape(p) for p in parts) + r"\Z")
