"""deploy/compose.yaml: valid for Compose v2 and consistent with the silod code it runs.

The schema check uses the compose-spec JSON schema that check-jsonschema ships
(``--builtin-schema vendor.compose-spec``; Apache-2.0, from github.com/compose-spec/compose-spec),
so it runs offline. The rest runs every silod command line of the file through the real CLI
parser and settings classes and checks the wiring between services.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy_checks import (
    ADDRESS_TARGETS,
    CLIENT_ADDRESS_TARGETS,
    DEPLOY,
    check_advertised_cache,
    check_client_command,
    check_gpus_per_node,
    compose_interpolate,
    each_address,
    host_port,
    load_service,
    parse_cli,
    port_of,
    shutdown_needs_s,
)

COMPOSE = DEPLOY / "compose.yaml"


def _compose() -> dict[str, Any]:
    return compose_interpolate(yaml.safe_load(COMPOSE.read_text()))


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "environment: use the mapping form so anchors can merge"
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _silod_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if svc.get("image", "").startswith("silod:")}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _compose()


@pytest.fixture(scope="module")
def loaded(compose: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """compose service name -> (silod service, settings) for every long-running silod service.

    Module-scoped: building the parser imports each service module, which takes seconds.
    """
    out = {}
    for name, svc in _silod_services(compose).items():
        argv = svc.get("command")
        if argv is None or parse_cli(argv).__dict__.get("service") is None:
            continue
        out[name] = load_service(argv, _env(svc), where=f"compose service {name}")
    return out


def _check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True, text=True, timeout=120,
    )


def test_compose_file_matches_the_compose_spec_schema() -> None:
    result = _check_jsonschema(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_broken_compose_file(tmp_path: Path) -> None:
    # Guards the test above against passing vacuously (wrong schema, validator not running).
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["metadata"]["depends_on"]["migrate"]["condition"] = "service_finished"
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = _check_jsonschema(path)
    assert result.returncode != 0
    assert "service_finished" in result.stdout + result.stderr


def test_every_silod_command_parses_and_its_settings_load(compose: dict[str, Any], loaded: dict[str, tuple[str, Any]]) -> None:
    assert {s for s, _ in loaded.values()} == {"metadata", "estimator", "scheduler", "cache-server", "worker-agent",
                                                  "dashboard"}
    for name, svc in _silod_services(compose).items():
        if name not in loaded:  # one-shot or CLI containers: client commands
            if "command" in svc:
                check_client_command(svc["command"], _env(svc), where=f"compose service {name}")
    for name, (_, settings) in loaded.items():
        # A container must listen on all interfaces to be reachable by its service name.
        assert host_port(settings.listen)[0] == "0.0.0.0", f"{name}: listen {settings.listen}"


def test_healthchecks_use_silod_health_on_the_port_the_service_listens_on(compose: dict[str, Any], loaded: dict[str, tuple[str, Any]]) -> None:
    for name, (_, settings) in loaded.items():
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "silod", f"{name}: healthcheck {test}"
        args = parse_cli(test[2:])
        assert args.handler.__name__ == "_health", f"{name}: healthcheck is not `silod health`"
        assert port_of(args.address) == port_of(settings.listen), f"{name}: checks {args.address}, listens {settings.listen}"
    pg = compose["services"]["postgres"]["healthcheck"]["test"]
    assert pg[1:4] == ["pg_isready", "-h", "127.0.0.1"]


def test_migration_runs_once_before_metadata_on_the_same_database(compose: dict[str, Any], loaded: dict[str, tuple[str, Any]]) -> None:
    services = compose["services"]
    migrate = services["migrate"]
    args = parse_cli(migrate["command"])
    assert (args.command, args.db_command) == ("db", "upgrade")
    assert migrate["restart"] == "no"
    assert services["metadata"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    _, metadata = loaded["metadata"]
    assert metadata.auto_migrate is False, "metadata must not migrate concurrently with the migrate service"
    assert metadata.db == _env(migrate)["SILOD_DB"]
    assert metadata.db.startswith("postgresql")


def test_depends_on_targets_exist_and_conditions_fit_them(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, svc in services.items():
        for target, spec in svc.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown service {target}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target} to be healthy; it has no healthcheck"
            if spec["condition"] == "service_completed_successfully":
                assert services[target].get("restart") == "no", f"{target} must be one-shot"


def test_addresses_name_a_service_listening_on_that_port(compose: dict[str, Any], loaded: dict[str, tuple[str, Any]]) -> None:
    listening = {name: (svc, port_of(settings.listen)) for name, (svc, settings) in loaded.items()}
    pointers: list[tuple[str, str, str]] = []
    for name, (kind, settings) in loaded.items():
        pointers += [(name, ADDRESS_TARGETS[k], v) for k, v in each_address(settings)]
        if getattr(settings, "advertise_address", ""):  # an agent's or a scheduler's own address
            pointers.append((name, kind, settings.advertise_address))
    for name, svc in compose["services"].items():
        env = _env(svc)
        pointers += [(name, CLIENT_ADDRESS_TARGETS[k], env[k]) for k in CLIENT_ADDRESS_TARGETS if env.get(k)]
    assert pointers
    for source, kind, address in pointers:
        host, port = host_port(address)
        assert host in listening, f"{source}: {address} names no silod compose service"
        assert listening[host] == (kind, port), f"{source}: {address} is {listening[host]}, expected a {kind} on {port}"


def test_each_agent_pairs_with_its_nodes_cache_server_and_sees_its_files(compose: dict[str, Any], loaded: dict[str, tuple[str, Any]]) -> None:
    agents = {n: s for n, (kind, s) in loaded.items() if kind == "worker-agent"}
    assert len(agents) >= 2, "the example shows at least two nodes"
    node_names = set()
    for name, agent in agents.items():
        cache_host = host_port(agent.cache_address)[0]
        kind, cache = loaded[cache_host]
        assert kind == "cache-server"
        assert cache.node == agent.node_name, f"{name} is node {agent.node_name}, its cache server says {cache.node}"
        check_advertised_cache(agent, cache, where=name)
        node_names.add(agent.node_name)
        # Jobs open leased files by path: the tiers must be the same volumes at the same paths.
        cache_mounts = _mounts(compose["services"][cache_host])
        agent_mounts = _mounts(compose["services"][name])
        for directory in (cache.disk_cache_dir, cache.memory_cache_dir):
            assert directory in cache_mounts, f"{cache_host}: {directory} is not a volume"
            assert agent_mounts.get(directory) == cache_mounts[directory], f"{name} does not mount {directory}"
    assert len(node_names) == len(agents), "two agents register the same node name"


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> volume name."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        out[target] = source
    return out


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        for source in _mounts(svc).values():
            if not source.startswith((".", "/", "$")):
                assert source in compose["volumes"], f"{name}: volume {source} is not declared"


@pytest.mark.parametrize("service", ["metadata", "scheduler", "scheduler-2"])
def test_host_ports_are_published_on_loopback_only(compose: dict[str, Any], service: str) -> None:
    # The published ports are for the operator's CLI on the host; without a token they must
    # not be open to the network.
    for mapping in compose["services"][service]["ports"]:
        assert mapping.startswith("127.0.0.1:"), mapping


def test_stop_grace_period_covers_the_services_own_shutdown(compose: dict[str, Any],
                                                            loaded: dict[str, tuple[str, Any]]) -> None:
    for name, (service, settings) in loaded.items():
        period = compose["services"][name].get("stop_grace_period", "10s")  # Docker's default
        assert period.endswith("s") and period[:-1].isdigit(), f"{name}: write stop_grace_period in seconds"
        assert int(period[:-1]) > shutdown_needs_s(service, settings), f"{name}: killed during its shutdown grace"


def test_estimator_assumes_the_nodes_gpu_count(loaded: dict[str, tuple[str, Any]]) -> None:
    check_gpus_per_node(list(loaded.values()), where="compose.yaml")


def test_an_inference_node_whose_idle_gpus_the_default_policy_lends(loaded: dict[str, tuple[str, Any]]) -> None:
    # The demo's mix (elastic training beside bursts of inference tasks) needs a node of the
    # inference pool, and a policy that lends its idle GPUs to training: deepboot does, the
    # others leave them idle between tasks.
    pools = sorted(settings.pool for kind, settings in loaded.values() if kind == "worker-agent")
    assert pools.count("training") >= 2 and pools.count("inference") >= 1, pools
    _, scheduler = loaded["scheduler"]
    assert scheduler.policy == "deepboot"


def test_host_ports_do_not_collide(compose: dict[str, Any]) -> None:
    published = [m.rsplit(":", 1)[0] for svc in compose["services"].values() for m in svc.get("ports", [])]
    assert len(published) == len(set(published)), published


def _schedulers(loaded: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    return {name: settings for name, (kind, settings) in loaded.items() if kind == "scheduler"}


def test_two_schedulers_elect_a_leader_on_postgresql(loaded: dict[str, tuple[str, Any]]) -> None:
    """High availability: two schedulers, both with --leader-election, each advertising the name
    the nodes reach it at (its own service and port: a container's hostname is its id), on a
    metadata store on PostgreSQL (the election needs it: docs/operators.md)."""
    schedulers = _schedulers(loaded)
    assert len(schedulers) == 2, sorted(schedulers)
    for name, settings in schedulers.items():
        assert settings.leader_election, f"{name}: without --leader-election two schedulers would both act"
        assert host_port(settings.advertise_address) == (name, port_of(settings.listen)), \
            f"{name}: advertises {settings.advertise_address!r}"
        # The lease outlives a renewal or two: a slow round-trip is not a failover.
        assert settings.lease_ttl_s >= 3 * settings.lease_renew_s, name
    assert len({s.policy for s in schedulers.values()}) == 1, "a failover must not change the policy"
    _, metadata = loaded["metadata"]
    assert metadata.db.startswith("postgresql")


def test_every_node_follows_every_scheduler_and_waits_for_both(compose: dict[str, Any],
                                                                loaded: dict[str, tuple[str, Any]]) -> None:
    advertised = sorted(s.advertise_address for s in _schedulers(loaded).values())
    nodes = {name: settings for name, (kind, settings) in loaded.items() if kind in ("worker-agent", "cache-server")}
    assert len(nodes) >= 4
    for name, settings in nodes.items():
        given = [a.strip() for a in settings.scheduler_address.split(",")]
        assert sorted(given) == advertised, f"{name}: --scheduler-address {settings.scheduler_address}"
        depends = compose["services"][name]["depends_on"]
        for scheduler in _schedulers(loaded):
            assert depends.get(scheduler, {}).get("condition") == "service_healthy", f"{name} does not wait for {scheduler}"
