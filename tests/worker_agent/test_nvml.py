"""worker_agent.nvml against NVML answers fed by the fake pynvml: discovery shared with
detect_gpus, figures tolerated per GPU and per figure, lost GPUs, Xid events."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from tests.worker_agent.fake_nvml import STATE_ENV, FakeNvml, NVMLError, gpu, write_state
from worker_agent import nvml
from worker_agent.gpus import detect_gpus


def test_detect_gpus_reads_nvml_through_the_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "nvml.json"
    write_state(state, {"gpus": [gpu("NVIDIA H100 80GB HBM3"), gpu("NVIDIA H100 80GB HBM3")]})
    monkeypatch.setenv(STATE_ENV, str(state))
    assert detect_gpus(4, "tests.worker_agent.fake_nvml:nvml") == (2, "NVIDIA H100 80GB HBM3")


def test_without_pynvml_gpus_are_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError, as where it is absent
    assert nvml.load() is None
    assert nvml.open_session() is None
    assert detect_gpus(3) == (3, "emulated")


def test_the_real_pynvml_without_a_driver_gives_emulated_gpus() -> None:
    """The dev install brings nvidia-ml-py; this machine has no NVIDIA driver."""
    pynvml = pytest.importorskip("pynvml")
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()
    assert nvml.open_session() is None
    assert detect_gpus(3) == (3, "emulated")


def test_no_driver_or_no_devices_is_emulated() -> None:
    fake = FakeNvml(None)  # no state file: nvmlInit fails as without a driver
    with pytest.raises(NVMLError):
        nvml.Session(fake)
    empty = FakeNvml({"gpus": []})
    session = nvml.Session(empty)
    assert session.count == 0
    session.close()
    assert empty.initialised == 0


def test_a_bad_hook_fails_loudly() -> None:
    with pytest.raises(ImportError):
        nvml.load("tests.worker_agent.no_such_module:nvml")
    with pytest.raises(AttributeError):
        nvml.load("tests.worker_agent.fake_nvml:no_such_object")


def test_unsupported_figures_are_left_out_per_gpu_and_per_figure() -> None:
    fake = FakeNvml({"gpus": [
        gpu(util=55, temp=62, ecc=2),
        gpu(unsupported=["ecc", "temperature"]),   # a consumer card: no ECC, here no sensor either
        gpu(unsupported=["utilization", "memory"]),
    ]})
    session = nvml.Session(fake)
    first, second, third = session.sample()
    assert (first.utilization_ratio, first.temperature_celsius, first.ecc_uncorrectable_errors) == (0.55, 62.0, 2)
    assert (first.memory_used_bytes, first.memory_total_bytes) == (3 * 2**30, 40 * 2**30)
    assert second.ecc_uncorrectable_errors is None and second.temperature_celsius is None
    assert second.utilization_ratio == 0.37 and second.memory_total_bytes == 40 * 2**30
    assert third.utilization_ratio is None and third.memory_used_bytes is None and third.ecc_uncorrectable_errors == 0
    assert not any(s.lost for s in (first, second, third))
    session.close()
    assert fake.initialised == 0


def test_a_gpu_lost_before_or_after_the_start_is_reported_lost() -> None:
    state = {"gpus": [gpu(), gpu(lost=True), gpu()]}
    fake = FakeNvml(state)
    session = nvml.Session(fake)
    assert session.count == 3 and session.model == "NVIDIA A100-SXM4-40GB"
    assert [s.lost for s in session.sample()] == [False, True, False]
    state["gpus"][2]["lost"] = True
    assert [s.lost for s in session.sample()] == [False, True, True]
    session.close()


def test_xid_faults_reach_the_callback_and_application_xids_do_not() -> None:
    state = {"gpus": [gpu(), gpu(), gpu(unsupported=["events"])], "events": []}
    fake = FakeNvml(state)
    session = nvml.Session(fake)
    seen: list[tuple[int, int]] = []
    arrived = threading.Event()

    def on_fault(index: int, xid: int) -> None:
        seen.append((index, xid))
        if xid == 79:
            arrived.set()

    watcher = nvml.XidWatcher(session, on_fault)
    try:
        assert watcher.watched == [0, 1]  # GPU 2 does not deliver events: skipped, not fatal
        state["events"] = [{"id": 1, "gpu": 1, "xid": 13},   # an application's illegal access
                           {"id": 2, "gpu": 2, "xid": 48},   # a GPU not registered: never delivered
                           {"id": 3, "gpu": 1, "xid": 79}]   # fallen off the bus
        assert arrived.wait(10)
        assert seen == [(1, 79)]
    finally:
        watcher.close()
        session.close()
