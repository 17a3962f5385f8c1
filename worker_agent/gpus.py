"""GPU discovery and the node's GPU table: which local task holds which device right now.

The table enforces the invariant "a GPU is held by at most one task at any instant": acquiring
a device that another task still holds raises :class:`GpuConflict` (a bug in the caller, never
a wait). Every acquire/release is appended to ``history`` and, when a path is given, to a JSON
lines audit file, so tests and operators can check the invariant after the fact.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from worker_agent import nvml


class GpuConflict(RuntimeError):
    pass


def detect_gpus(configured: int, nvml_module: str = "") -> tuple[int, str]:
    """(count, model) from NVML (worker_agent.nvml) when it loads and finds devices, else (configured, "emulated")."""
    session = nvml.open_session(nvml_module)
    if session is None:
        return configured, "emulated"
    try:
        return session.count, session.model
    finally:
        session.close()


_VENDOR_WORDS = {"nvidia", "tesla", "quadro"}
_FAMILY_TOKEN = re.compile(r"^[a-z]{1,3}\d{1,4}[a-z]?$")  # a100, v100, h100, l40s, a10g, k80, t4


def gpu_type_from_model(model: str) -> str:
    """The type policies see for an NVML model name: its family token, lower case.

    "NVIDIA A100-SXM4-40GB" -> "a100", "Tesla V100-SXM2-16GB" -> "v100", "NVIDIA L40S" -> "l40s";
    a name without such a token becomes a slug ("NVIDIA GeForce RTX 4090" -> "geforce-rtx-4090").
    Memory and form-factor variants share a type on purpose: throughput models are per family."""
    words = [w for w in re.split(r"[^a-z0-9]+", model.lower()) if w and w not in _VENDOR_WORDS]
    for word in words:
        if _FAMILY_TOKEN.match(word):
            return word
    return "-".join(words)[:32].strip("-._")


def resolve_gpu_type(configured: str, model: str) -> str:
    """The node's GPU type: the configured one if set, else derived from the NVML model; untyped
    ("") for emulated GPUs without a configured type."""
    if configured:
        return configured
    return "" if model == "emulated" else gpu_type_from_model(model)


class GpuTable:
    def __init__(self, count: int, audit_path: Path | None = None) -> None:
        self.count = count
        self._holder: dict[int, str] = {}
        self.history: list[dict[str, Any]] = []
        self._audit = audit_path

    def holder(self, index: int) -> str | None:
        return self._holder.get(index)

    def free(self) -> list[int]:
        return [i for i in range(self.count) if i not in self._holder]

    def busy(self, indices: list[int], task: str) -> list[int]:
        """Indices in ``indices`` held by a task other than ``task``."""
        return [i for i in indices if self._holder.get(i, task) != task]

    def acquire(self, task: str, indices: list[int]) -> None:
        bad = [i for i in indices if not 0 <= i < self.count]
        if bad:
            raise GpuConflict(f"gpu_indices: {bad} outside 0..{self.count - 1}")
        held = {i: self._holder[i] for i in indices if i in self._holder and self._holder[i] != task}
        if held:
            raise GpuConflict(f"gpu_indices: {sorted(held)} still held by {sorted(set(held.values()))}")
        for i in indices:
            self._holder[i] = task
        self._record("acquire", task, indices)

    def release(self, task: str) -> list[int]:
        freed = sorted(i for i, t in self._holder.items() if t == task)
        for i in freed:
            del self._holder[i]
        if freed:
            self._record("release", task, freed)
        return freed

    def _record(self, event: str, task: str, indices: list[int]) -> None:
        entry = {"t": time.time(), "event": event, "task": task, "gpus": sorted(indices)}
        self.history.append(entry)
        if self._audit is not None:
            with open(self._audit, "a") as f:
                f.write(json.dumps(entry) + "\n")


def check_exclusive(history: list[dict[str, Any]]) -> None:
    """Replay a GPU table history; raise AssertionError if a GPU was ever held by two tasks."""
    holder: dict[int, str] = {}
    for e in history:
        for i in e["gpus"]:
            if e["event"] == "acquire":
                if i in holder and holder[i] != e["task"]:
                    raise AssertionError(f"gpu {i} acquired by {e['task']} while held by {holder[i]}")
                holder[i] = e["task"]
            elif holder.get(i) == e["task"]:
                del holder[i]
