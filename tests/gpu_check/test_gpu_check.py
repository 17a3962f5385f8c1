"""benchmarks/gpu_check.py where there is no GPU (every GPU line skipped, with its reason), and
the pieces that turn its measurements into lines, JSON and the docs' table."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check, gpu_check_steps

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(\d) (.{22}) (pass|fail|skipped)(?:: (.*))?$")


def _gpu_here() -> bool:
    from worker_agent.gpus import detect_gpus
    import torch

    return detect_gpus(0)[1] != "emulated" or torch.cuda.is_available()


@pytest.mark.skipif(_gpu_here(), reason="a GPU is here: `make gpu-check` runs the real checks")
def test_without_a_gpu_every_check_is_skipped_with_its_reason_and_the_json_is_written(tmp_path: Path) -> None:
    results = sorted((ROOT / "benchmarks" / "results").glob("gpu-check-*"))
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [m.groups() for m in map(LINE.match, done.stdout.splitlines()) if m]
    assert [int(number) for number, *_ in lines] == [1, 2, 3, 4, 5, 6, 7], done.stdout
    for number, _, status, why in lines:
        assert status == "skipped" and why and why.startswith("no GPU ("), f"check {number}: {status}: {why}"
    record = json.loads(out.read_text())
    assert record["exit_status"] == 0 and record["machine"]["gpu_count"] == 0
    assert {"host", "gpu_model", "driver", "torch", "cuda", "python"} <= record["machine"].keys()
    assert [(c["number"], c["status"]) for c in record["checks"]] == [(n, "skipped") for n in range(1, 8)]
    assert sorted((ROOT / "benchmarks" / "results").glob("gpu-check-*")) == results  # nothing in the repository


def _step_result() -> dict:
    options = gpu_check_steps.fill_defaults(argparse.Namespace(cpu=False, steps=0, reps=0, warmup=0, width=0, depth=0,
                                                               batch=0))
    ready = {v.name: {"params": 100_687_872, "device": "cuda:0", "noise_active": False if v.sdk else None,
                      "backend": "cpu:gloo,cuda:nccl" if v.sdk else "nccl"} for v in gpu_check_steps.VARIANTS}
    times = {"plain": [7.10, 7.20, 7.30], "plain-fu": [7.2, 7.2, 7.2], "sdk": [7.15, 7.25, 7.35],
             "sdk-reproducible": [7.3, 7.3, 7.3]}
    return gpu_check_steps.summarize(options, ready, times)


def test_step_overhead_is_the_ratio_of_medians_of_like_for_like_pairs() -> None:
    result = _step_result()
    assert result["params"] == 100_687_872 and result["shape"] == {"width": 4096, "depth": 6, "batch": 512}
    assert result["overhead"]["sdk/plain"] == pytest.approx(7.25 / 7.20 - 1)
    assert result["overhead"]["sdk-reproducible/plain-fu"] == pytest.approx(7.3 / 7.2 - 1)
    line = gpu_check_steps.summary_line(result)
    assert "SDK 7.25 vs plain DDP 7.20 ms a step (+0.7 %)" in line
    assert "100.7M parameters, batch 512, cuda:0" in line and "CUDA events" in line
    assert "gradient-noise hooks idle at world size 1" in line
    assert "| SDK, reproducible=True | cpu:gloo,cuda:nccl | 7.30 | 7.30, 7.30, 7.30 |" in gpu_check_steps.table(result)


def test_docs_table_has_a_row_per_run_and_the_step_times_of_measured_ones(tmp_path: Path) -> None:
    machine = {"host": "gpu-1", "gpu_model": "NVIDIA H200", "gpu_count": 1, "gpu_type": "h200", "driver": "580.1",
               "torch": "2.11.0", "cuda": "13.0", "torch_sees_gpus": 1, "python": "3.12.3"}
    checks = [gpu_check.passed(gpu_check.Check(1, "NVML discovery"), "1 x NVIDIA H200", "1 x h200"),
              gpu_check.skipped(gpu_check.Check(4, "resize"), "one GPU (NVIDIA H200): growing to two ranks needs two"),
              gpu_check.passed(gpu_check.Check(5, "SDK step overhead"), "...", "+0.7 %", **_step_result())]
    results = tmp_path / "results"
    gpu_check.write_results(results / "gpu-check-gpu-1-2026-11-28T0900.json", ["--write-docs"],
                            gpu_check.dt.datetime(2026, 11, 28, 9, 0), 61.0, machine, checks, 0)
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# B\n\n## GPU check\n\n{gpu_check.DOCS_BEGIN}\nold\n{gpu_check.DOCS_END}\n\n## Next\n")
    gpu_check.write_docs(docs, results)
    text = docs.read_text()
    assert "old" not in text and text.endswith(f"{gpu_check.DOCS_END}\n\n## Next\n")
    row = next(line for line in text.splitlines() if line.startswith("| [2026-11-28T09:00]"))
    assert "gpu-1: 1 x NVIDIA H200, torch 2.11.0, CUDA 13.0, Python 3.12.3" in row
    assert "| 1 x h200 |" in row and "| skipped: one GPU (NVIDIA H200)" in row
    steps = next(line for line in text.splitlines() if line.count("| [2026-11-28T09:00]") and "cuda:0" in line)
    assert "100.7M (6 x 4096), 512 | 7.20 ms | 7.20 ms | 7.25 ms | 7.30 ms | +0.7 %, +1.4 % |" in steps


def test_the_gpu_wheels_are_pinned_for_an_offline_install() -> None:
    lines = [line.strip() for line in (ROOT / "benchmarks" / "gpu_wheels.txt").read_text().splitlines()]
    wheels = [line for line in lines if line and not line.startswith("#")]
    assert wheels and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", w) for w in wheels), wheels
    assert ".gpu-wheels" in (ROOT / ".gitignore").read_text()


class _ListedNode:
    """The node row `silod nodes --json` prints (its own code, silod/cli/nodes.py), for check 6."""

    def __init__(self, telemetry: list[dict], faults: list[tuple[int, str]] = ()) -> None:
        from google.protobuf import json_format

        from silod.cli import nodes
        from silod.v1 import common_pb2

        node = common_pb2.Node(gpu_telemetry=[json_format.ParseDict(t, common_pb2.GpuTelemetry()) for t in telemetry],
                                   gpu_faults=[common_pb2.GpuFault(index=i, reason=r) for i, r in faults])
        self.row = nodes._gpu_figures(node)

    def node(self) -> dict:
        return self.row


H200_SAMPLE = {"utilization_ratio": 0.01, "memory_used_bytes": 2084438016, "memory_total_bytes": 150754820096,
               "temperature_celsius": 33.0, "ecc_uncorrectable_errors": 0}  # read off an H200 by check 6


def test_telemetry_check_passes_on_a_full_sample_of_every_gpu() -> None:
    check = gpu_check.check_telemetry(_ListedNode([H200_SAMPLE]), gpu_check.Gpus(count=1, model="NVIDIA H200"))
    assert check.status == "pass", check.detail
    assert check.short == "1.9/140 GiB, 33 °C"
    assert "utilisation 0.01" in check.detail and "ECC uncorrectable 0" in check.detail


@pytest.mark.parametrize("telemetry, faults, problem", [
    ([H200_SAMPLE], [], "1 GPU sample(s) for NVML's 2 GPU(s)"),
    ([H200_SAMPLE, {k: v for k, v in H200_SAMPLE.items() if k != "temperature_celsius"}], [], "GPU 1: no temperature"),
    ([H200_SAMPLE, {k: v for k, v in H200_SAMPLE.items() if k != "memory_total_bytes"}], [],
     "GPU 1: no device memory figures"),
    ([H200_SAMPLE, {**H200_SAMPLE, "utilization_ratio": 1.5}], [], "GPU 1: utilisation 1.5"),
    ([H200_SAMPLE, {**H200_SAMPLE, "lost": True}], [], "GPU 1: reported lost"),
    ([H200_SAMPLE, H200_SAMPLE], [(1, "Xid 79")], "faults recorded"),
])
def test_telemetry_check_fails_naming_what_nvml_did_not_give(telemetry: list, faults: list, problem: str) -> None:
    check = gpu_check.check_telemetry(_ListedNode(telemetry, faults), gpu_check.Gpus(count=2, model="NVIDIA H200"))
    assert check.status == "fail" and problem in check.detail, check.detail


def test_restart_check_passes_on_the_cpu_with_the_cpu_as_the_expected_device(tmp_path: Path) -> None:
    """Line 7's lab, plans and log parsing, run here with the ranks on the CPU: what the GPU run
    relies on (the stop's and the resume's lines, the step numbers, two launches) is checked. The
    suite's ranks pair gloo with the CUDA-only stand-in for NCCL (tests/conftest.py), as on a GPU."""
    check = gpu_check.check_restart(tmp_path, expect=("cpu", "cpu:gloo,cuda:cudaonly"))
    assert check.status == "pass", check.detail
    figures = check.figures
    assert figures["stopped_at_step"] >= 5 and figures["resumed_at_step"] == figures["stopped_at_step"]
    assert figures["first_step_after"] == figures["stopped_at_step"] + 1 and figures["launches"] == 2
    assert figures["training_on"] == [["cpu", "cpu:gloo,cuda:cudaonly"]] * 2  # what the GPU run compares
