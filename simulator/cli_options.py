"""The options ``silod simulate`` parses beyond argparse's types: policies by name with their
``--set POLICY.OPTION=VALUE`` options checked against each policy's fields, ``--cache`` modes and
``--tenant-quotas``. Each bad value raises SimulatorInputError naming it (the CLI exits 2)."""

from __future__ import annotations

import argparse
import inspect
from typing import Any


def quotas(args: argparse.Namespace):
    """Tenant -> quota from --tenant-quotas, or None."""
    if not getattr(args, "tenant_quotas", None):
        return None
    from simulator.tenant_quotas import load_quotas

    return load_quotas(args.tenant_quotas)


def policy(name: str, seed: int | None, options: dict[str, dict[str, Any]] | None = None):
    """Instantiate policy ``name`` with its ``--set`` options, and ``seed`` when its constructor takes one."""
    from scheduler.registry import get_policy

    chosen = dict((options or {}).get(name, {}))
    if seed is not None and "seed" in inspect.signature(type(get_policy(name))).parameters:
        chosen["seed"] = seed
    return get_policy(name, **chosen)


def parse_options(values: list[str], names: list[str]) -> dict[str, dict[str, Any]]:
    """``["pollux.p=-0.5", ...]`` -> ``{"pollux": {"p": -0.5}}``, checked against each policy's fields.

    Raises SimulatorInputError naming the bad ``--set`` value.
    """
    import ast
    import dataclasses

    from scheduler.registry import get_policy
    from simulator.errors import SimulatorInputError

    parsed: dict[str, dict[str, Any]] = {}
    for value in values:
        target, sep, raw = value.partition("=")
        policy, dot, key = target.rpartition(".")
        if not sep or not key:
            raise SimulatorInputError(f"--set {value!r}: expected POLICY.OPTION=VALUE")
        if not dot:
            if len(names) != 1:
                raise SimulatorInputError(f"--set {value!r}: name the policy (one of {', '.join(names)}), e.g. pollux.{key}")
            policy = names[0]
        if policy not in names:
            raise SimulatorInputError(f"--set {value!r}: policy {policy!r} is not being run ({', '.join(names)})")
        fields = {f.name for f in dataclasses.fields(type(get_policy(policy)))}
        if key not in fields:
            raise SimulatorInputError(f"--set {value!r}: {policy} has no option {key!r}; options: {', '.join(sorted(fields))}")
        if raw.strip().lower() in ("true", "false"):  # lend=false must not become the (truthy) string "false"
            parsed_value = raw.strip().lower() == "true"
        else:
            try:
                parsed_value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                parsed_value = raw  # plain words, e.g. penalty_model=age
        parsed.setdefault(policy, {})[key] = parsed_value
    for policy, options in parsed.items():
        for key, parsed_value in options.items():  # one at a time first, so the error names the option
            try:
                get_policy(policy, **{key: parsed_value})
            except (TypeError, ValueError) as exc:
                raise SimulatorInputError(f"--set {policy}.{key}={parsed_value!r}: {exc}") from None
        try:
            get_policy(policy, **options)
        except (TypeError, ValueError) as exc:
            raise SimulatorInputError(f"--set: bad options for {policy}: {exc}") from None
    return parsed


def cache_modes(value: str) -> list[str]:
    """``--cache`` as a list of modes (``all`` = every mode, independent ones first)."""
    from simulator.cacheio import CACHE_MODES
    from simulator.errors import SimulatorInputError

    modes = list(CACHE_MODES) if value.strip() == "all" else [m.strip() for m in value.split(",") if m.strip()]
    for mode in modes:
        if mode not in CACHE_MODES:
            raise SimulatorInputError(f"--cache: unknown cache mode {mode!r}; known: {', '.join(CACHE_MODES)}, all")
    if not modes or len(set(modes)) != len(modes):
        raise SimulatorInputError(f"--cache {value!r}: give each mode once")
    return modes


def check_policies(names: list[str]) -> str | None:
    from scheduler.registry import policy_names

    known = policy_names()
    for name in names:
        if name not in known:
            return f"unknown policy {name!r}; known: {', '.join(known)}"
    return None
