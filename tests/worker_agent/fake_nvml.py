"""A stand-in for pynvml that answers from a JSON state: the only mock of the GPU tests.

A real agent process loads it through its test hook, ``--nvml-module
tests.worker_agent.fake_nvml:nvml``; it then reads the state from the file named by the
``FAKE_NVML_STATE`` environment variable at every call, so a test changes the GPUs' answers
(figures, ECC counts, a lost GPU, Xid events) by rewriting that file (:func:`write_state`).
In-process tests build a :class:`FakeNvml` around a dict instead.

State: ``{"gpus": [GPU, ...], "events": [{"id": 1, "gpu": 0, "xid": 79}, ...]}`` where a GPU is
``{"name": "NVIDIA A100-SXM4-40GB", "util": 37, "mem_used": .., "mem_total": .., "temp": 41,
"ecc": 0, "lost": false, "unsupported": ["temperature", "ecc", "utilization", "memory",
"events"]}``. Each event is delivered once, in id order, by nvmlEventSetWait (to GPUs registered
for events).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

STATE_ENV = "FAKE_NVML_STATE"


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's names
    def __init__(self) -> None:
        super().__init__(3)


class NVMLError_Timeout(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(10)


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(15)


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Replace the state file at once (rename), so the agent never reads half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def gpu(name: str = "NVIDIA A100-SXM4-40GB", **figures: Any) -> dict[str, Any]:
    """One GPU's state with plausible figures; ``figures`` override them."""
    return {"name": name, "util": 37, "mem_used": 3 * 2**30, "mem_total": 40 * 2**30, "temp": 41, "ecc": 0,
            "lost": False, "unsupported": [], **figures}


class FakeNvml:
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 0x8

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self._state = state
        self._delivered: set[int] = set()
        self._registered: set[int] = set()
        self._lock = threading.Lock()
        self.initialised = 0

    # ---- the state -------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        if self._state is not None:
            return self._state
        path = os.environ.get(STATE_ENV)
        if not path:
            raise NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED: as a machine without a driver
        return json.loads(Path(path).read_text())

    def _gpu(self, handle: int, figure: str) -> dict[str, Any]:
        g = self.state()["gpus"][handle]
        if g.get("lost"):
            raise NVMLError_GpuIsLost()
        if figure in g.get("unsupported", []):
            raise NVMLError_NotSupported()
        return g

    # ---- pynvml's functions ----------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802
        self.state()
        self.initialised += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.state()["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        if self.state()["gpus"][index].get("lost"):
            raise NVMLError_GpuIsLost()
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:  # noqa: N802
        return handle

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return self._gpu(handle, "name")["name"].encode()  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802
        g = self._gpu(handle, "utilization")
        return SimpleNamespace(gpu=g["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        g = self._gpu(handle, "memory")
        return SimpleNamespace(used=g["mem_used"], total=g["mem_total"], free=g["mem_total"] - g["mem_used"])

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:  # noqa: N802
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "temperature")["temp"]

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:  # noqa: N802
        assert (error_type, counter_type) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC)
        return self._gpu(handle, "ecc")["ecc"]

    def nvmlEventSetCreate(self) -> str:  # noqa: N802
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, kinds: int, event_set: str) -> None:  # noqa: N802
        assert kinds & self.nvmlEventTypeXidCriticalError
        self._gpu(handle, "events")
        with self._lock:
            self._registered.add(handle)

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> Any:  # noqa: N802
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            with self._lock:
                for event in sorted(self.state().get("events", []), key=lambda e: e["id"]):
                    if event["id"] not in self._delivered and event["gpu"] in self._registered:
                        self._delivered.add(event["id"])
                        return SimpleNamespace(device=event["gpu"], eventType=self.nvmlEventTypeXidCriticalError,
                                               eventData=event["xid"])
            if time.monotonic() >= deadline:
                raise NVMLError_Timeout()
            time.sleep(0.05)

    def nvmlEventSetFree(self, event_set: str) -> None:  # noqa: N802
        pass


nvml = FakeNvml()  # what --nvml-module tests.worker_agent.fake_nvml:nvml loads
