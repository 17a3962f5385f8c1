"""The generated silod.v1 code is what protos/ says, and ships inside the installable package."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "silod" / "v1"


def _regenerate(out: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos" / "silod" / "v1").glob("*.proto"))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={out}", f"--grpc_python_out={out}",
         f"--mypy_out={out}", f"--mypy_grpc_out={out}", *protos],
        cwd=ROOT, env=env, check=True, capture_output=True,
    )


def test_committed_generated_code_matches_protos(tmp_path: Path) -> None:
    _regenerate(tmp_path)
    fresh = tmp_path / "silod" / "v1"
    fresh_files = {p.name for p in fresh.iterdir()}
    committed = {p.name for p in GENERATED.iterdir() if "_pb2" in p.name}
    assert fresh_files == committed, f"generated file set differs; run `make proto` (missing/extra: {fresh_files ^ committed})"
    stale = [name for name in sorted(fresh_files) if not filecmp.cmp(fresh / name, GENERATED / name, shallow=False)]
    assert not stale, f"silod/v1 is stale for {stale}; run `make proto` and commit the result"


def test_api_reference_matches_protos() -> None:
    sys.path.insert(0, str(ROOT / "protos"))
    try:
        import render_api_docs
    finally:
        sys.path.pop(0)
    expected = render_api_docs.render(render_api_docs.load_descriptors())
    assert (ROOT / "docs" / "api.md").read_text() == expected, "docs/api.md is stale; run `make proto`"


def test_every_proto_field_documents_itself() -> None:
    """Every field carries a comment with its unit or meaning (on its line or the line above)."""
    undocumented = []
    for proto in sorted((ROOT / "protos" / "silod" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            code = line.split("//")[0].strip()
            is_field = code.endswith(";") and "=" in code and not code.startswith(("option", "syntax", "import", "package"))
            is_enum_value = code.split("=")[0].strip().isupper()
            if is_field and not is_enum_value and "//" not in line and not lines[i - 1].strip().startswith("//"):
                if not code.startswith("message"):  # one-field requests: `message GetJobRequest { string job_id = 1; }`
                    undocumented.append(f"{proto.name}:{i + 1}: {line.strip()}")
    assert not undocumented, "fields without a comment giving their unit or meaning:\n" + "\n".join(undocumented)


def test_wheel_ships_working_typed_stubs(tmp_path: Path) -> None:
    """Installing the package (no sys.path edits, no source tree) gives importable stubs."""
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("silod-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("metadata", "scheduler", "allocation", "estimator", "cache", "worker_agent", "common", "plan"):
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert f"silod/v1/{module}{suffix}" in names, f"wheel lacks silod/v1/{module}{suffix}"
    assert "silod/v1/py.typed" in names

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True, text=True,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    probe = (
        "import silod.v1.scheduler_pb2_grpc as g, silod.v1.common_pb2 as c;"
        "print(g.__file__); print(c.JobSpec(name='x', min_gpus=1).min_gpus)"
    )
    # Run from an empty directory with only the installed copy (and the venv's dependencies) on the path.
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    out = subprocess.run([sys.executable, "-c", probe], cwd=workdir, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    module_path, value = out.stdout.split()
    assert module_path.startswith(str(target)), f"imported from {module_path}, not the installed wheel"
    assert value == "1"
    shutil.rmtree(target)
