"""Policies by name: the simulator's ``--policy`` and the live scheduler's ``--policy`` use the same table."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from scheduler.policy import Policy

_POLICIES: dict[str, type] = {}
# Modules that register policies when imported; imported lazily so that `silod --help`
# does not pay for scipy and friends.
_POLICY_MODULES = (
    "scheduler.policies.fifo",
    "scheduler.policies.sjf",
    "scheduler.policies.tiresias",
    "scheduler.policies.gavel",
    "scheduler.policies.themis",
    "scheduler.policies.pollux",
    "scheduler.policies.deepboot",
)

P = TypeVar("P", bound=type)


def register(name: str) -> Callable[[P], P]:
    """Class decorator: make a policy available as ``name``."""

    def decorate(cls: P) -> P:
        if name in _POLICIES and _POLICIES[name] is not cls:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name  # type: ignore[attr-defined]
        _POLICIES[name] = cls
        return cls

    return decorate


def _load_all() -> None:
    for module in _POLICY_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a real missing dependency, not a policy still to be written
                raise


def policy_names() -> list[str]:
    _load_all()
    return sorted(_POLICIES)


def get_policy(name: str, **options: Any) -> Policy:
    """Instantiate policy ``name``; ``KeyError`` listing the known names if there is none."""
    _load_all()
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(_POLICIES))}") from None
    return cls(**options)
