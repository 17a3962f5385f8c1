"""NVML, the only place silod talks to it: GPU discovery, per-GPU figures and fatal-fault signals.

The library is ``pynvml`` (package ``nvidia-ml-py``) or, for tests, any object with the same
names that the agent's ``nvml_module`` setting names ("package.module:attribute"): tests feed
GPU answers through such an object, since the agent runs as a process of its own. Without
either, :func:`open_session` returns None and the node's GPUs are emulated.

NVML supports different figures on different GPUs (no ECC on consumer cards, no Xid events on
some drivers): every figure is asked of every GPU on its own, and one that raises
NVMLError_NotSupported (or any other NVMLError) is left unset for that GPU alone. A GPU that
answers GPU_IS_LOST has fallen off the bus: it is reported ``lost``, a fatal fault.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger("silod.worker_agent.nvml")

# NVML's return codes, for libraries (or fakes) whose errors carry only ``value``.
_ERROR_NOT_SUPPORTED = 3
_ERROR_TIMEOUT = 10
_ERROR_GPU_IS_LOST = 15
_XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_MEMORY_ERROR_TYPE_UNCORRECTED = 1  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED
_VOLATILE_ECC = 0  # NVML_VOLATILE_ECC: since the last driver load or GPU reset

# Critical Xids that user code causes (illegal memory access, MMU fault from a bad pointer, a
# kernel killed or timed out, ...): the GPU itself is fine. NVIDIA's Kubernetes device plugin
# skips the same ones when it marks GPUs unhealthy.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


@dataclass(frozen=True)
class GpuSample:
    """One GPU's figures at one instant; None = NVML does not give that figure for this GPU."""

    index: int
    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    ecc_uncorrectable_errors: int | None = None
    lost: bool = False


def load(spec: str = "") -> Any | None:
    """The NVML library: the object ``spec`` names ("module:attribute"; a bare module also
    works), else ``pynvml``; None when it cannot be imported. A ``spec`` that names nothing
    importable raises ImportError: a test hook set wrong must not pass for "no GPUs"."""
    if spec:
        module_name, _, attribute = spec.partition(":")
        module = importlib.import_module(module_name)
        return getattr(module, attribute) if attribute else module
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


class Session:
    """An initialised NVML (nvmlInit ... :meth:`close`) and the handles of its GPUs."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        lib.nvmlInit()
        try:
            self.count = int(lib.nvmlDeviceGetCount())
            self.handles: list[Any] = []
            for i in range(self.count):
                try:
                    self.handles.append(lib.nvmlDeviceGetHandleByIndex(i))
                except Exception as exc:  # noqa: BLE001 - a lost GPU keeps its index, without a handle
                    if not self.is_error(exc):
                        raise
                    _log.warning("NVML has no handle for GPU %d: %s", i, exc)
                    self.handles.append(None)
            self.model = self._model()
        except BaseException:
            lib.nvmlShutdown()
            raise
        self._closed = False

    def _model(self) -> str:
        for handle in self.handles:
            if handle is None:
                continue
            try:
                name = self._ask(self.lib.nvmlDeviceGetName, handle)
            except Exception as exc:  # noqa: BLE001 - a lost GPU names nothing; ask the next one
                if not self.is_lost(exc):
                    raise
                continue
            if name is not None:
                return name.decode() if isinstance(name, bytes) else str(name)
        return "unknown"

    def minor_numbers(self) -> dict[int, int]:
        """GPU index -> the minor number of its /dev/nvidiaN (they need not agree); GPUs NVML
        cannot tell are left out (their index is used)."""
        minors: dict[int, int] = {}
        call = getattr(self.lib, "nvmlDeviceGetMinorNumber", None)
        for index, handle in enumerate(self.handles):
            if handle is None or call is None:
                continue
            try:
                minors[index] = int(call(handle))
            except Exception as exc:  # noqa: BLE001 - not answered: the index stands in
                if not self.is_error(exc):
                    raise
        return minors

    # ---- errors ------------------------------------------------------------------------
    def is_error(self, exc: BaseException) -> bool:
        base = getattr(self.lib, "NVMLError", None)
        return isinstance(exc, base) if isinstance(base, type) else hasattr(exc, "value")

    def _code_is(self, exc: BaseException, class_name: str, code: int) -> bool:
        cls = getattr(self.lib, class_name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return True
        return getattr(exc, "value", None) == code

    def is_lost(self, exc: BaseException) -> bool:
        return self._code_is(exc, "NVMLError_GpuIsLost", _ERROR_GPU_IS_LOST)

    def _ask(self, call: Any, *args: Any) -> Any:
        """``call(*args)``, or None where NVML does not support it; GPU_IS_LOST propagates."""
        try:
            return call(*args)
        except Exception as exc:  # noqa: BLE001 - only NVML's own errors are tolerated
            if not self.is_error(exc) or self.is_lost(exc):
                raise
            if not self._code_is(exc, "NVMLError_NotSupported", _ERROR_NOT_SUPPORTED):
                _log.debug("NVML call %s failed: %s", getattr(call, "__name__", call), exc)
            return None

    def _constant(self, name: str, default: int) -> int:
        return int(getattr(self.lib, name, default))

    # ---- figures -------------------------------------------------------------------------
    def sample(self) -> list[GpuSample]:
        """Every GPU's figures now (blocking NVML calls: run it off the event loop)."""
        return [self._sample_one(i, h) for i, h in enumerate(self.handles)]

    def _sample_one(self, index: int, handle: Any) -> GpuSample:
        if handle is None:
            return GpuSample(index=index, lost=True)
        lib = self.lib
        try:
            rates = self._ask(lib.nvmlDeviceGetUtilizationRates, handle)
            memory = self._ask(lib.nvmlDeviceGetMemoryInfo, handle)
            temperature = self._ask(lib.nvmlDeviceGetTemperature, handle,
                                    self._constant("NVML_TEMPERATURE_GPU", _TEMPERATURE_GPU))
            ecc = self._ask(lib.nvmlDeviceGetTotalEccErrors, handle,
                            self._constant("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", _MEMORY_ERROR_TYPE_UNCORRECTED),
                            self._constant("NVML_VOLATILE_ECC", _VOLATILE_ECC))
        except Exception as exc:  # noqa: BLE001 - _ask lets only GPU_IS_LOST and non-NVML errors through
            if not self.is_lost(exc):
                raise
            return GpuSample(index=index, lost=True)
        return GpuSample(
            index=index,
            utilization_ratio=None if rates is None else min(max(float(rates.gpu) / 100.0, 0.0), 1.0),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            temperature_celsius=None if temperature is None else float(temperature),
            ecc_uncorrectable_errors=None if ecc is None else int(ecc),
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.lib.nvmlShutdown()
            except Exception as exc:  # noqa: BLE001 - nothing to do about it at shutdown
                _log.warning("nvmlShutdown failed: %s", exc)


def open_session(spec: str = "") -> Session | None:
    """An NVML session when the library loads, initialises and finds GPUs; else None."""
    lib = load(spec)
    if lib is None:
        return None
    try:
        session = Session(lib)
    except Exception as exc:  # noqa: BLE001 - no driver, no devices: emulated GPUs, as without pynvml
        _log.info("NVML unavailable (%s): emulated GPUs", exc)
        return None
    if session.count <= 0:
        session.close()
        return None
    return session


class XidWatcher:
    """Waits for critical Xid events of the session's GPUs in a thread of its own and calls
    ``on_fault(gpu_index, xid)`` (from that thread) for those that are GPU faults.

    GPUs whose driver does not deliver the events are skipped (NVMLError_NotSupported on
    registration); when none does, no thread is started."""

    WAIT_MS = 500  # how often the thread checks whether it should stop

    def __init__(self, session: Session, on_fault: Any) -> None:
        self.session = session
        self.on_fault = on_fault
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set: Any = None
        self.watched: list[int] = []  # GPUs whose Xid events arrive
        lib = session.lib
        kind = int(getattr(lib, "nvmlEventTypeXidCriticalError", _XID_CRITICAL_ERROR))
        try:
            self._set = lib.nvmlEventSetCreate()
        except Exception as exc:  # noqa: BLE001 - no events at all: figures and ECC counts still work
            if not session.is_error(exc):
                raise
            _log.info("NVML events unavailable: %s", exc)
            return
        for index, handle in enumerate(session.handles):
            if handle is None:
                continue
            try:
                lib.nvmlDeviceRegisterEvents(handle, kind, self._set)
                self.watched.append(index)
            except Exception as exc:  # noqa: BLE001 - per GPU: NotSupported on some
                if not session.is_error(exc):
                    raise
                _log.info("no Xid events from GPU %d: %s", index, exc)
        if self.watched:
            self._thread = threading.Thread(target=self._run, name="nvml-xid", daemon=True)
            self._thread.start()

    def _index_of(self, device: Any) -> int | None:
        # pynvml's handles are ctypes pointers: a second pointer to the same device is not ==
        # to ours, so ask NVML; equality is the fallback for libraries without GetIndex.
        try:
            return int(self.session.lib.nvmlDeviceGetIndex(device))
        except Exception:  # noqa: BLE001 - a NULL device (an event of no one GPU), or no GetIndex
            pass
        for index, handle in enumerate(self.session.handles):
            if handle is not None and handle == device:
                return index
        return None

    def _run(self) -> None:
        lib = self.session.lib
        while not self._stop.is_set():
            try:
                data = lib.nvmlEventSetWait(self._set, self.WAIT_MS)
            except Exception as exc:  # noqa: BLE001
                if self.session._code_is(exc, "NVMLError_Timeout", _ERROR_TIMEOUT):
                    continue
                if self._stop.is_set():
                    return
                _log.warning("waiting for NVML events failed: %s", exc)
                self._stop.wait(1.0)
                continue
            xid = int(getattr(data, "eventData", 0))
            if xid in APPLICATION_XIDS:
                _log.info("Xid %d (an application error, not a GPU fault)", xid)
                continue
            index = self._index_of(getattr(data, "device", None))
            # An event NVML does not tie to a GPU is every GPU's (as NVIDIA's device plugin reads it).
            for i in ([index] if index is not None else self.watched):
                try:
                    self.on_fault(i, xid)
                except Exception:  # noqa: BLE001 - the watcher must outlive a bad callback
                    _log.exception("Xid fault callback failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.WAIT_MS / 1000 + 1)
        if self._set is not None:
            try:
                self.session.lib.nvmlEventSetFree(self._set)
            except Exception:  # noqa: BLE001 - at shutdown
                pass
            self._set = None
