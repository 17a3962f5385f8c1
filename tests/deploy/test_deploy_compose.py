"""deploy/compose.yaml: valid for Compose v2 and consistent with the silod code it runs.

The schema check uses the compose-spec JSON schema that check-jsonschema ships
(``--builtin-schema vendor.compose-spec``; Apache-2.0, from github.com/compose-spec/compose-spec),
so it runs offline. The rest runs every silod command line of the file through the real CLI
parser and settings classes and checks the wiring between services.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy_checks import (
    address_target,
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
    """The services that run `silod` (the image's entrypoint; node-dirs runs a shell instead)."""
    return {name: svc for name, svc in compose["services"].items()
            if svc.get("image", "").startswith("silod:") and "entrypoint" not in svc}


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
    assert {s for s, _ in loaded.values()} == {"metadata", "estimator", "scheduler", "allocation", "cache-server",
                                                  "worker-agent", "dashboard"}
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


def test_only_the_store_and_the_metadata_service_are_waited_for_healthy(compose: dict[str, Any]) -> None:
    """The silod services wait for one another by themselves (a scheduler for the metadata service,
    nodes for the allocation service): were each to wait for the one before it to be healthy,
    `up --wait` would cost a health interval per service down the chain (74 s against 34.5 s)."""
    waited = {target for svc in compose["services"].values() for target, spec in svc.get("depends_on", {}).items()
              if spec["condition"] == "service_healthy"}
    assert waited == {"postgres", "metadata", "objectstore"}


def test_addresses_name_a_service_listening_on_that_port(compose: dict[str, Any], loaded: dict[str, tuple[str, Any]]) -> None:
    listening = {name: (svc, port_of(settings.listen)) for name, (svc, settings) in loaded.items()}
    pointers: list[tuple[str, str, str]] = []
    for name, (kind, settings) in loaded.items():
        pointers += [(name, address_target(kind, k), v) for k, v in each_address(settings)]
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
        # Jobs open leased files by path, in containers of their own that the agent starts on the
        # Docker host: the tiers must be host directories at their host paths in both services.
        for directory in (cache.disk_cache_dir, cache.memory_cache_dir):
            for service in (cache_host, name):
                assert _host_path(compose, service, directory) == directory, \
                    f"{service}: {directory} is not the host's directory of that path"
            assert _mounts(compose["services"][cache_host])[directory] == _mounts(compose["services"][name])[directory]
    assert len(node_names) == len(agents), "two agents register the same node name"


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> volume name or host path."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        out[target] = source
    return out


def _host_path(compose: dict[str, Any], service: str, target: str) -> str:
    """The Docker host's directory mounted at ``target``: a bind's source, or the directory a named
    volume binds (driver_opts type none, o bind); "" for a volume in Docker's data root."""
    source = _mounts(compose["services"][service]).get(target, "")
    if source.startswith("/") or not source:
        return source
    options = (compose["volumes"][source] or {}).get("driver_opts", {})
    return options["device"] if (options.get("type"), options.get("o")) == ("none", "bind") else ""


def test_agents_run_ranks_as_containers_of_the_host_engine_in_their_own_network(
        compose: dict[str, Any], loaded: dict[str, tuple[str, Any]]) -> None:
    """runtime: container through the host's Engine (its socket mounted at docker_host), as root (the
    runtime gives each job's uid its directories); the work and checkpoint directories, which the
    ranks' containers mount by path, host directories at their host paths (the checkpoints the same
    for every agent); each rank in the agent container's network namespace (the container compose
    names <project>-<service>-1), so that it resolves the services' names."""
    agents = {n: s for n, (kind, s) in loaded.items() if kind == "worker-agent"}
    checkpoint_roots = set()
    for name, agent in agents.items():
        service = compose["services"][name]
        assert agent.runtime == "container" and service["user"] == "root", name
        assert agent.container_network == f"container:silod-{name}-1", (name, agent.container_network)
        assert agent.docker_host.startswith("unix://")
        mounts = _mounts(service)
        assert mounts[agent.docker_host.removeprefix("unix://")] == "/var/run/docker.sock", name
        for directory in (agent.work_dir, agent.checkpoint_root):
            assert _host_path(compose, name, directory) == directory, f"{name}: {directory} is not the host's"
        checkpoint_roots.add(agent.checkpoint_root)
        # A job that names no image runs in the default image: the silod image unless SILOD_JOB_IMAGE.
        assert agent.default_image == compose["services"][name]["image"] == "silod:latest"
    assert len(checkpoint_roots) == 1, "a job moved to another node resumes from the same checkpoints"
    # The Docker socket is root on the host: no other service gets it.
    for name, service in compose["services"].items():
        if name not in agents:
            assert "/var/run/docker.sock" not in _mounts(service), name


def test_node_dirs_makes_every_host_directory_the_nodes_mount_before_they_start(
        compose: dict[str, Any], loaded: dict[str, tuple[str, Any]]) -> None:
    """The host directories the node services bind (under SILOD_HOST_DIR and SILOD_HOST_MEM_DIR) are
    made by the one-shot node-dirs, the cache tiers owned by the image's silod user (10001), the
    user the cache servers run as; the node services wait for it."""
    services = compose["services"]
    node_dirs = services["node-dirs"]
    assert node_dirs["restart"] == "no" and node_dirs["user"] == "root"
    script = node_dirs["command"][0]
    for variable, value in node_dirs["environment"].items():  # the shell's (compose wrote $$ for $)
        script = script.replace(f"${variable}", value)
    roots = set(_mounts(node_dirs))
    assert roots == {"/var/lib/silod-compose", "/dev/shm/silod-compose"}
    made = _made_by(script)
    for name, (kind, settings) in loaded.items():
        if kind not in ("cache-server", "worker-agent"):
            continue
        binds = [target for target in _mounts(services[name]) if _host_path(compose, name, target)
                 and target != "/var/run/docker.sock"]
        assert binds, name
        for directory in binds:
            assert any(directory.startswith(root + "/") for root in roots), f"{name}: {directory}"
            assert directory in made, f"node-dirs does not make {directory} ({name} mounts it)"
        if kind == "cache-server":
            assert services[name]["depends_on"]["node-dirs"]["condition"] == "service_completed_successfully"
            assert "user" not in services[name]  # the image's: silod
            for directory in (settings.disk_cache_dir, settings.memory_cache_dir):
                assert made[directory] == "10001", f"{directory} is not the silod user's"


def _made_by(script: str) -> dict[str, str]:
    """directory -> its owner ("" for root) of node-dirs' script: its `for node in ...` loop unrolled
    and every `install -d [-o OWNER] ... DIRS`."""
    import shlex

    loop = re.match(r"for node in ([\w -]+); do (.*?); done && (.*)$", script)
    assert loop, script
    commands = [loop.group(2).replace("$node", n) for n in loop.group(1).split()] + [loop.group(3)]
    made: dict[str, str] = {}
    for command in commands:
        for part in re.split(r"&&|\|\|", command):
            words = shlex.split(part.strip())
            if words[:2] != ["install", "-d"]:
                continue
            owner = words[words.index("-o") + 1] if "-o" in words else ""
            for word in words[2:]:
                if word.startswith("/"):
                    made[word] = owner
    return made


def test_every_image_is_a_variable_with_the_official_default() -> None:
    """Where no registry is at hand, SILOD_*_IMAGE name local stand-ins (deploy/local-images)."""
    raw = yaml.safe_load(COMPOSE.read_text())
    images = {name: svc["image"] for name, svc in raw["services"].items() if "image" in svc}
    assert raw["x-silod"]["image"] == "${SILOD_IMAGE:-silod:latest}"
    assert {images[n] for n in ("postgres", "objectstore", "prometheus")} == {
        "${SILOD_POSTGRES_IMAGE:-postgres:17}", "${SILOD_OBJECTSTORE_IMAGE:-motoserver/moto:5.2.5}",
        "${SILOD_PROMETHEUS_IMAGE:-prom/prometheus:v2.53.4}"}
    assert all(image.startswith("${SILOD_") for image in images.values()), images
    for stand_in in ("postgres", "objectstore", "prometheus", "digits-job"):
        assert (DEPLOY / "local-images" / stand_in / "Dockerfile").is_file(), stand_in


def test_the_compose_network_takes_addresses_from_198_19() -> None:
    """198.19.0.0/16 is reserved for testing (198.18.0.0/15): never a private range a site routes."""
    import ipaddress

    networks = _compose()["networks"]
    assert set(networks) == {"default"}
    subnets = [c["subnet"] for c in networks["default"]["ipam"]["config"]]
    assert subnets and all(ipaddress.ip_network(s).subnet_of(ipaddress.ip_network("198.19.0.0/16")) for s in subnets)


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


def test_the_allocation_service_follows_every_scheduler_and_the_nodes_follow_it(
        compose: dict[str, Any], loaded: dict[str, tuple[str, Any]]) -> None:
    """The nodes' plan watches, acks and reports are served apart from the rounds: the allocation
    service follows both schedulers (started after them), the nodes are given its address alone."""
    advertised = sorted(s.advertise_address for s in _schedulers(loaded).values())
    (allocation,) = [(name, settings) for name, (kind, settings) in loaded.items() if kind == "allocation"]
    name, settings = allocation
    assert sorted(a.strip() for a in settings.scheduler_address.split(",")) == advertised
    for scheduler in _schedulers(loaded):
        assert compose["services"][name]["depends_on"][scheduler]["condition"] == "service_started"
    nodes = {n: s for n, (kind, s) in loaded.items() if kind in ("worker-agent", "cache-server")}
    assert len(nodes) >= 4
    for node, node_settings in nodes.items():
        assert node_settings.scheduler_address == f"{name}:{port_of(settings.listen)}", node
        depends = compose["services"][node]["depends_on"]
        assert depends.get(name, {}).get("condition") == "service_started", f"{node} does not start after {name}"
