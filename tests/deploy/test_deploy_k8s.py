"""deploy/k8s: schema-valid for a recent Kubernetes and consistent with the silod code it runs.

kubernetes-validate ships the Kubernetes OpenAPI schemas, so this runs offline. Beyond the
schema: silod command lines and SILOD_* environments go through the real CLI parser and
settings classes; Services select exactly one workload and target its gRPC port; addresses
name a Service on the right port; references to ConfigMaps, Secrets and volumes resolve.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

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

K8S = DEPLOY / "k8s"
# A recent release whose schemas kubernetes-validate ships (>= 1.34 in pyproject's dev extra).
K8S_VERSION = "1.34.0"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
# Stand-ins for values only the cluster knows (downward API fields).
FIELD_REFS = {"spec.nodeName": "gpu-node-1", "status.podIP": "10.1.2.3", "metadata.name": "silod-scheduler-0"}


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _documents() -> list[dict[str, Any]]:
    return [doc for path in _manifest_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _documents() if d["kind"] == kind}


def _workloads() -> list[dict[str, Any]]:
    return [d for d in _documents() if d["kind"] in WORKLOADS]


def _silod_containers(workload: dict[str, Any], *, init: bool = False) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    containers = spec.get("initContainers", []) if init else spec["containers"]
    # Containers that override the entrypoint (chown helpers) do not run silod.
    return [c for c in containers if c["image"] == "silod" and "command" not in c]


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    """The environment the container gets, with Secret values and downward-API fields stubbed."""
    config_maps = _by_kind("ConfigMap")
    secrets = _by_kind("Secret")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in config_maps, f"{container['name']}: ConfigMap {name} is not in deploy/k8s"
        env.update(config_maps[name]["data"])
    for var in container.get("env", []):
        if "value" in var:
            # Kubernetes expands $(VAR) from variables defined earlier in the list.
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] in secrets, f"{container['name']}: Secret {ref['name']} is not in deploy/k8s"
            assert ref["key"] in secrets[ref["name"]]["stringData"], f"{container['name']}: no key {ref['key']}"
            env[var["name"]] = secrets[ref["name"]]["stringData"][ref["key"]]
        else:
            env[var["name"]] = FIELD_REFS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


@pytest.fixture(scope="module")
def loaded() -> dict[str, tuple[str, Any, dict[str, Any], dict[str, Any]]]:
    """workload name -> (silod service, settings, workload, container); module-scoped because
    building the parser imports each service module."""
    out = {}
    for workload in _workloads():
        containers = _silod_containers(workload)
        assert len(containers) == 1, f"{workload['metadata']['name']}: expected one silod container"
        container = containers[0]
        service, settings = load_service(container["args"], _container_env(container),
                                         where=f"{workload['kind']} {workload['metadata']['name']}")
        out[workload["metadata"]["name"]] = (service, settings, workload, container)
    return out


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        # strict: unknown fields (a misspelt key Kubernetes would silently drop) are errors.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_schema_validation_rejects_a_misspelt_field() -> None:
    # Guards the test above against passing vacuously.
    deployment = copy.deepcopy(next(d for d in _workloads() if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 7070}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_kustomization_applies_every_manifest_but_the_example_secret() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    expected = {p.name for p in _manifest_files()} - {"secret.example.yaml"}
    assert set(kustomization["resources"]) == expected


def test_control_plane_are_deployments_and_node_services_daemonsets(loaded: dict[str, Any]) -> None:
    kinds = {service: workload["kind"] for service, _, workload, _ in loaded.values()}
    assert kinds == {"metadata": "Deployment", "estimator": "Deployment", "scheduler": "StatefulSet", "dashboard": "Deployment",
                     "allocation": "Deployment", "cache-server": "DaemonSet", "worker-agent": "DaemonSet"}


def _serving_port_name(service: str) -> str:
    return "http" if service == "dashboard" else "grpc"  # the dashboard is the one HTTP server


def test_probes_and_ports_match_the_listen_address(loaded: dict[str, Any]) -> None:
    for name, (service, settings, _, container) in loaded.items():
        host, port = host_port(settings.listen)
        assert host == "0.0.0.0", f"{name}: listen {settings.listen} is unreachable from other pods"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        serving = _serving_port_name(service)
        assert ports[serving] == port, f"{name}: containerPort {serving} {ports[serving]} != listen port {port}"
        assert ports["metrics"] == settings.metrics_port, f"{name}: metrics port"
        for probe in ("readinessProbe", "livenessProbe"):
            if serving == "grpc":
                assert container[probe]["grpc"]["port"] == port, f"{name}: {probe} on another port"
            else:
                check = container[probe]["httpGet"]
                assert check["path"] == "/healthz" and ports.get(check["port"], check["port"]) == port, name


def test_services_select_one_workload_and_target_its_grpc_port(loaded: dict[str, Any]) -> None:
    workloads = {name: workload for name, (_, _, workload, _) in loaded.items()}
    for service in _by_kind("Service").values():
        selector = service["spec"]["selector"]
        matches = [n for n, w in workloads.items()
                   if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {service['metadata']['name']} selects {matches}"
        silod_service, _, _, container = loaded[matches[0]]
        by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            target = by_name[target] if isinstance(target, str) else target
            serving = by_name[_serving_port_name(silod_service)]
            assert target == port["port"] == serving, f"Service {service['metadata']['name']}: {port}"


def test_workload_selectors_match_their_pod_labels() -> None:
    for workload in _workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()


def _reachable_names(loaded: dict[str, Any]) -> dict[str, tuple[str, int]]:
    """DNS name -> (silod service behind it, its port): every Service, and a StatefulSet's pods
    under its headless Service (POD.SERVICE)."""
    behind = {}
    for service in _by_kind("Service").values():
        selector = service["spec"]["selector"]
        for kind, _, workload, _ in loaded.values():
            if selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items():
                name, port = service["metadata"]["name"], service["spec"]["ports"][0]["port"]
                behind[name] = (kind, port)
                if workload["kind"] == "StatefulSet" and workload["spec"]["serviceName"] == name:
                    for i in range(workload["spec"]["replicas"]):
                        behind[f"{workload['metadata']['name']}-{i}.{name}"] = (kind, port)
    return behind


def test_addresses_name_a_service_of_the_right_kind_and_port(loaded: dict[str, Any]) -> None:
    behind = _reachable_names(loaded)
    pointers = 0
    for name, (kind, settings, _, _) in loaded.items():
        for key, address in each_address(settings):
            host, port = host_port(address)
            assert behind.get(host) == (address_target(kind, key), port), f"{name}: {key}={address}"
            pointers += 1
    assert pointers >= 6


def test_agent_advertises_its_pod_ip_and_shares_the_cache_servers_host_paths(loaded: dict[str, Any]) -> None:
    by_kind = {kind: (settings, workload, container) for kind, settings, workload, container in loaded.values()}
    cache, cache_workload, cache_container = by_kind["cache-server"]
    agent, agent_workload, agent_container = by_kind["worker-agent"]
    assert agent.advertise_address == f"{FIELD_REFS['status.podIP']}:{port_of(agent.listen)}"
    # Both name the node after the Kubernetes node, so the plan's node names agree.
    assert cache.node == agent.node_name == FIELD_REFS["spec.nodeName"]
    check_advertised_cache(agent, cache, where="worker-agent DaemonSet")

    def host_paths(workload: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        return {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"] for m in container["volumeMounts"]
                if "hostPath" in volumes[m["name"]]}

    cache_paths = host_paths(cache_workload, cache_container)
    agent_paths = host_paths(agent_workload, agent_container)
    for directory in (cache.disk_cache_dir, cache.memory_cache_dir):
        # Jobs in the agent's pod open the files the cache server leases, by path.
        assert directory in cache_paths, f"cache server's {directory} is not on a hostPath"
        assert agent_paths.get(directory) == cache_paths[directory], f"agent does not see {directory}"
    assert agent.work_dir in agent_paths, "the work dir (logs, checkpoints) must outlive the pod"
    # Both DaemonSets must land on the same nodes.
    assert (cache_workload["spec"]["template"]["spec"]["nodeSelector"]
            == agent_workload["spec"]["template"]["spec"]["nodeSelector"])


def test_volume_mounts_refer_to_declared_volumes() -> None:
    for workload in _workloads():
        spec = workload["spec"]["template"]["spec"]
        declared = {v["name"] for v in spec.get("volumes", [])}
        for container in spec["containers"] + spec.get("initContainers", []):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in declared, f"{workload['metadata']['name']}/{container['name']}: {mount['name']}"


def test_metadata_migrates_in_an_init_container_on_the_same_database(loaded: dict[str, Any]) -> None:
    _, metadata, workload, container = loaded["silod-metadata"]
    (init,) = _silod_containers(workload, init=True)
    env = _container_env(init)
    args = check_client_command(init["args"], env, where="metadata init container")
    assert (args.command, args.db_command) == ("db", "upgrade")
    assert env["SILOD_DB"] == metadata.db
    assert metadata.auto_migrate is False
    assert workload["spec"]["strategy"]["type"] == "Recreate"


def test_auth_token_comes_from_the_secret_in_every_silod_container(loaded: dict[str, Any]) -> None:
    for name, (_, _, _, container) in loaded.items():
        (token,) = [v for v in container["env"] if v["name"] == "SILOD_AUTH_TOKEN"]
        ref = token["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"], ref.get("optional")) == ("silod", "auth-token", True), name


def test_termination_grace_covers_the_services_own_shutdown(loaded: dict[str, Any]) -> None:
    for name, (service, settings, workload, _) in loaded.items():
        period = workload["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)  # k8s default
        assert period > shutdown_needs_s(service, settings), f"{name}: killed during its shutdown grace"


def test_estimator_assumes_the_nodes_gpu_count(loaded: dict[str, Any]) -> None:
    check_gpus_per_node([(kind, settings) for kind, settings, _, _ in loaded.values()], where="deploy/k8s")


def _scheduler(loaded: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    (found,) = [(settings, workload) for kind, settings, workload, _ in loaded.values() if kind == "scheduler"]
    return found


def test_two_schedulers_elect_a_leader_each_reachable_by_its_pods_name(loaded: dict[str, Any]) -> None:
    """High availability: a StatefulSet of 2 schedulers with --leader-election (the metadata
    store is the Secret's PostgreSQL); each advertises its pod's DNS name under the headless
    Service, which lists pods before they are ready."""
    settings, workload = _scheduler(loaded)
    assert workload["spec"]["replicas"] >= 2
    assert settings.leader_election
    assert settings.lease_ttl_s >= 3 * settings.lease_renew_s
    headless = _by_kind("Service")[workload["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    # FIELD_REFS stands in for metadata.name: the first pod's own name.
    assert settings.advertise_address == f"{FIELD_REFS['metadata.name']}.{headless['metadata']['name']}:{port_of(settings.listen)}"
    assert workload["spec"]["podManagementPolicy"] == "Parallel"
    anti = workload["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    _, metadata, _, _ = loaded["silod-metadata"]
    assert metadata.db.startswith("postgresql"), "leader election needs the metadata store on PostgreSQL"


def test_the_allocation_service_follows_every_scheduler_pod_and_the_nodes_follow_it(loaded: dict[str, Any]) -> None:
    settings, workload = _scheduler(loaded)
    pods = sorted(f"{workload['metadata']['name']}-{i}.{workload['spec']['serviceName']}:{port_of(settings.listen)}"
                  for i in range(workload["spec"]["replicas"]))
    (allocation,) = [s for kind, s, _, _ in loaded.values() if kind == "allocation"]
    assert sorted(a.strip() for a in allocation.scheduler_address.split(",")) == pods
    nodes = [(kind, s) for kind, s, _, _ in loaded.values() if kind in ("worker-agent", "cache-server")]
    assert len(nodes) == 2
    for kind, node in nodes:  # the allocation service's Service, alone
        assert node.scheduler_address == f"silod-allocation:{port_of(allocation.listen)}", f"{kind}: {node.scheduler_address}"


def test_a_disruption_budget_keeps_one_scheduler() -> None:
    (budget,) = _by_kind("PodDisruptionBudget").values()
    scheduler = _by_kind("StatefulSet")["silod-scheduler"]
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == scheduler["spec"]["selector"]["matchLabels"]


def test_kustomize_renders_the_two_schedulers() -> None:
    """`kubectl kustomize deploy/k8s` (what `kubectl apply -k` applies), where kubectl is installed."""
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        from tests.support.ci import missing

        missing("kubectl is not installed")
    done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    expected = [d for d in _documents() if d["kind"] != "Secret"]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == \
        sorted((d["kind"], d["metadata"]["name"]) for d in expected)
    (scheduler,) = [d for d in rendered if d["kind"] == "StatefulSet"]
    assert scheduler["spec"]["replicas"] == 2
    assert "--leader-election" in scheduler["spec"]["template"]["spec"]["containers"][0]["args"]
