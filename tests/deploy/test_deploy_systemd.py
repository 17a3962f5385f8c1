"""deploy/systemd: one unit per service, whose command lines and EnvironmentFiles are exactly
what the real CLI parser and settings classes accept, and whose addresses fit together."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.ci import missing
from deploy_checks import (
    address_target,
    DEPLOY,
    check_advertised_cache,
    check_client_command,
    check_gpus_per_node,
    each_address,
    host_port,
    load_service,
    port_of,
    shutdown_needs_s,
)

SYSTEMD = DEPLOY / "systemd"
SILOD = "/opt/silod/bin/silod"


def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (keys such as EnvironmentFile repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path.name}: keep each directive on one line"
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: cannot read {raw!r}"
        current.setdefault(key, []).append(value)
    return sections


def _env_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: {raw!r} is not KEY=VALUE"
            env[key] = value
    return env


def _environment(unit: dict[str, dict[str, list[str]]], instance: str = "") -> dict[str, str]:
    env: dict[str, str] = {}
    for name in unit["Service"]["EnvironmentFile"]:
        local = SYSTEMD / Path(name.lstrip("-").replace("%i", instance)).name
        assert local.is_file(), f"EnvironmentFile {name}: no example {local.name} in deploy/systemd"
        env.update(_env_file(local))  # later files override earlier ones, as in systemd
    return env


def _argv(command: str) -> list[str]:
    exe, *argv = command.split()
    assert exe == SILOD, f"{command!r} does not run {SILOD}"
    return argv


def _instances(path: Path) -> list[str]:
    """A template unit's instances: one per example ``<service>-<instance>.env`` (%i); [""] else."""
    if "@." not in path.name:
        return [""]
    prefix = path.name.removeprefix("silod-").split("@")[0] + "-"
    return sorted(p.stem.removeprefix(prefix) for p in SYSTEMD.glob(f"{prefix}*.env"))


@pytest.fixture(scope="module")
def units() -> dict[str, tuple[str, Any, dict[str, dict[str, list[str]]]]]:
    """unit name (a template's per instance: silod-scheduler@1.service) -> (silod service,
    settings, parsed unit); module-scoped because building the parser imports each service module."""
    out = {}
    for path in sorted(SYSTEMD.glob("*.service")):
        unit = _unit(path)
        (start,) = unit["Service"]["ExecStart"]
        for instance in _instances(path):
            name = path.name.replace("@.", f"@{instance}.")
            service, settings = load_service(_argv(start), _environment(unit, instance), where=name)
            out[name] = (service, settings, unit)
    return out


def _first_machine(units: dict[str, Any]) -> dict[str, Any]:
    """The units one machine may run together in the examples: all but the second instance
    of a template (the second scheduler runs on a second control machine)."""
    return {name: u for name, u in units.items() if "@" not in name or "@1." in name}


def test_one_unit_per_service(units: dict[str, Any]) -> None:
    from services.runtime.config_reference import service_settings

    assert sorted({service for service, _, _ in units.values()}) == sorted(name for name, _ in service_settings())
    for name, (service, _, _) in units.items():
        assert name == f"silod-{service}.service" or name.startswith(f"silod-{service}@"), name


def test_units_restart_on_failure_but_not_on_configuration_errors(units: dict[str, Any]) -> None:
    for name, (_, _, unit) in units.items():
        service = unit["Service"]
        assert service["Restart"] == ["on-failure"], name
        # silod exits 2 on a configuration error (services/runtime/server.py, silod/cli/main.py).
        assert service["RestartPreventExitStatus"] == ["2"], name
        # The worker agent runs as root to contain its ranks (a uid, namespaces and a cgroup
        # each, in cgroups delegated to it); every other service as silod.
        if name == "silod-worker-agent.service":
            assert (service["User"], service["Delegate"]) == (["root"], ["yes"]), name
        else:
            assert service["User"] == ["silod"], name
        assert unit["Install"]["WantedBy"] == ["multi-user.target"], name


def test_metadata_migrates_before_it_starts(units: dict[str, Any]) -> None:
    _, metadata, unit = units["silod-metadata.service"]
    (pre,) = unit["Service"]["ExecStartPre"]
    env = _environment(unit)
    args = check_client_command(_argv(pre), {"SILOD_DB": env["SILOD_DB"]}, where="ExecStartPre")
    assert (args.command, args.db_command) == ("db", "upgrade")
    assert metadata.auto_migrate is False
    assert metadata.db.startswith("postgresql")


def test_addresses_point_at_the_ports_the_services_listen_on(units: dict[str, Any]) -> None:
    listen = {service: port_of(settings.listen) for service, settings, _ in units.values()}
    metrics = [settings.metrics_port for _, settings, _ in _first_machine(units).values()]
    # On one machine every service needs its own metrics port.
    assert len(set(metrics)) == len(metrics) and 0 not in metrics
    checked = 0
    for name, (service, settings, _) in units.items():
        for key, address in each_address(settings):
            assert port_of(address) == listen[address_target(service, key)], f"{name}: {key}={address}"
            checked += 1
    assert checked >= 6


def test_agent_and_cache_server_agree_on_the_node_name(units: dict[str, Any]) -> None:
    _, cache, _ = units["silod-cache-server.service"]
    _, agent, _ = units["silod-worker-agent.service"]
    # Both default to the hostname when empty; a name set on one only would split the node.
    assert cache.node == agent.node_name
    check_advertised_cache(agent, cache, where="worker-agent.env")


def test_stop_timeout_covers_the_services_own_shutdown(units: dict[str, Any]) -> None:
    for name, (service, settings, unit) in units.items():
        (timeout,) = unit["Service"]["TimeoutStopSec"]
        assert int(timeout) > shutdown_needs_s(service, settings), f"{name}: killed during its shutdown grace"


def test_estimator_assumes_the_nodes_gpu_count(units: dict[str, Any]) -> None:
    check_gpus_per_node([(kind, settings) for kind, settings, _ in units.values()], where="deploy/systemd")


def test_the_clients_fallback_ports_are_the_deployed_ones() -> None:
    """A client command with nothing else to go on tries this machine at the port a bare-metal
    install (these unit files) gives the service."""
    from silod.cli.locate import SERVICES

    deployed = {}
    for unit, service in (("metadata", "metadata"), ("scheduler", "scheduler"), ("cache-server", "cache")):
        line = next(l for l in (SYSTEMD / f"{unit}.env").read_text().splitlines()
                    if l.startswith("SILOD_LISTEN="))
        deployed[service] = line.rsplit(":", 1)[1]
    assert {name: s.default.rsplit(":", 1)[1] for name, s in SERVICES.items()} == deployed


def _schedulers(units: dict[str, Any]) -> dict[str, Any]:
    return {name: settings for name, (service, settings, _) in units.items() if service == "scheduler"}


def test_two_scheduler_instances_elect_a_leader_on_postgresql(units: dict[str, Any]) -> None:
    """High availability: silod-scheduler@1 and @2, with --leader-election (scheduler.env), each
    advertising its own machine, on a metadata store on PostgreSQL (the election needs it)."""
    schedulers = _schedulers(units)
    assert sorted(schedulers) == ["silod-scheduler@1.service", "silod-scheduler@2.service"]
    advertised = [s.advertise_address for s in schedulers.values()]
    assert len(set(advertised)) == 2 and all(advertised), advertised
    for name, settings in schedulers.items():
        assert settings.leader_election, name
        assert port_of(settings.advertise_address) == port_of(settings.listen), name
        assert settings.lease_ttl_s >= 3 * settings.lease_renew_s, name
    _, metadata, _ = units["silod-metadata.service"]
    assert metadata.db.startswith("postgresql")
    # The first runs beside the metadata service, the second on another machine.
    control = host_port(schedulers["silod-scheduler@1.service"].metadata_address)[0]
    assert host_port(advertised[0])[0] == control != host_port(advertised[1])[0]


def test_the_allocation_service_follows_both_schedulers_and_the_nodes_follow_it(units: dict[str, Any]) -> None:
    advertised = sorted(s.advertise_address for s in _schedulers(units).values())
    _, allocation, unit = units["silod-allocation.service"]
    assert sorted(a.strip() for a in allocation.scheduler_address.split(",")) == advertised
    control = host_port(allocation.metadata_address)[0]  # beside the metadata service and silod-scheduler@1
    for name in ("silod-worker-agent.service", "silod-cache-server.service"):
        _, settings, _ = units[name]
        assert settings.scheduler_address == f"{control}:{port_of(allocation.listen)}", name


def _verify(directory: Path, names: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", *[str(directory / n) for n in names]],
                          capture_output=True, text=True, timeout=120, cwd=directory)


def _units_for_verify(tmp_path: Path) -> list[str]:
    """The unit files in ``tmp_path`` with silod's path replaced by one that exists here (verify
    checks that ExecStart is executable); a template's first instance by name."""
    names = []
    for path in sorted(SYSTEMD.glob("*.service")):
        (tmp_path / path.name).write_text(path.read_text().replace(SILOD, shutil.which("true") or "/bin/true"))
        names.append(path.name.replace("@.", f"@{_instances(path)[0]}."))
    return names


def test_systemd_analyze_verify_accepts_every_unit(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        missing("systemd-analyze is not installed")
    names = _units_for_verify(tmp_path)
    done = _verify(tmp_path, names)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_systemd_analyze_verify_reports_a_misspelt_key(tmp_path: Path) -> None:
    # Guards the test above against passing vacuously.
    if shutil.which("systemd-analyze") is None:
        missing("systemd-analyze is not installed")
    names = _units_for_verify(tmp_path)
    template = next(p for p in tmp_path.glob("*@.service"))
    template.write_text(template.read_text().replace("Restart=on-failure", "Restart=on-failure\nRestartt=always"))
    done = _verify(tmp_path, names)
    assert "Restartt" in done.stdout + done.stderr
