"""The silod.v1 contracts as descriptors: every service and method, for tests that must cover
each one without a list to keep up to date."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import silod.v1


def services() -> dict[str, Any]:
    """Every service of the silod.v1 contracts (ServiceDescriptor), by full name."""
    found = {}
    for module in pkgutil.iter_modules(silod.v1.__path__):
        if module.name.endswith("_pb2"):
            descriptor = importlib.import_module(f"silod.v1.{module.name}").DESCRIPTOR
            found.update({s.full_name: s for s in descriptor.services_by_name.values()})
    return found


def methods() -> list[Any]:
    """Every method (MethodDescriptor) of every service."""
    return [m for service in services().values() for m in service.methods]
