"""The simulated cluster: nodes, round interval, restart cost (``--cluster`` YAML).

Defaults are the Pollux artifact simulator's: 16 nodes x 4 GPUs, a scheduling round every
60 s, 30 s lost whenever a job's placement changes. A YAML file may override any field::

    nodes: 16               # identical nodes ...
    gpus_per_node: 4
    # ... or a list; "count" repeats an entry, names default to node-00, node-01, ...
    # nodes:
    #   - {count: 8, gpus: 4}
    #   - {name: big, gpus: 8}
    #   - {count: 8, gpus: 4, pool: inference}   # DeepBoot: inference-pool nodes (default pool: training)
    #   - {count: 8, gpus: 4, gpu_type: v100}     # GPU type of the node's GPUs (lower case; default: untyped)
    #   - {count: 8, gpus: 4, cpus: 64, memory_bytes: 512Gi}  # cores and memory ranks may request
    gpu_type: v100          # type of every node of a "nodes: N" cluster (default: untyped)
    cpus_per_node: .inf     # CPU cores ranks may request on every node (default .inf: no limit)
    memory_bytes_per_node: .inf  # bytes of memory ranks may request on every node ("256Gi", "512 GB"; default .inf)
    restart_cost_s: 30      # seconds without progress after every (re)placement
    job_overheads: true     # where an application's profile has overheads.csv (measured launch and
                            # exit per world size), charge those instead of restart_cost_s
    interval_s: 60          # seconds between scheduling rounds
    max_gpus_per_job: 64    # cap on any job's max_gpus (default: every GPU of the cluster)
    schedule_on_events: false  # also run a round on every arrival and completion
    stall_timeout_s: 86400  # fail when active jobs make no progress for this long
    # Cache and remote IO (issue 7). The defaults model today's GPU-only cluster: no cache
    # and unlimited storage bandwidth, which reproduces the GPU-only results exactly.
    # Numbers or strings with units: 8e9, "8 GB", "100 MB/s", "256Gi" (binary), .inf.
    cache_bytes_per_node: 0              # dataset cache on every node (a list entry may set cache_bytes)
    storage_bandwidth_bytes_per_s: .inf  # cluster-wide remote read budget
    nic_bytes_per_s: .inf                # per-node cap on remote reads (a list entry may set its own)

Every error names the offending field.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scheduler.policy import NodeInfo
from simulator.errors import SimulatorInputError

DEFAULT_NODES = 16
DEFAULT_GPUS_PER_NODE = 4
DEFAULT_INTERVAL_S = 60.0
DEFAULT_RESTART_COST_S = 30.0
DEFAULT_STALL_TIMEOUT_S = 86400.0

_FIELDS = {
    "nodes", "gpus_per_node", "restart_cost_s", "job_overheads", "interval_s", "max_gpus_per_job", "schedule_on_events", "stall_timeout_s",
    "cache_bytes_per_node", "storage_bandwidth_bytes_per_s", "nic_bytes_per_s", "gpu_type", "cpus_per_node",
    "memory_bytes_per_node",
}
_NODE_FIELDS = {"name", "gpus", "count", "cache_bytes", "nic_bytes_per_s", "pool", "gpu_type", "cpus", "memory_bytes"}
# What nodes advertise (NodeSpec.gpu_type): lower case, so "V100" is not a type of its own.
_GPU_TYPE = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")
_POOLS = ("training", "inference")


def _default_nodes() -> tuple[NodeInfo, ...]:
    return uniform_nodes(DEFAULT_NODES, DEFAULT_GPUS_PER_NODE)


def uniform_nodes(count: int, gpus: int, cache_bytes: float = 0.0, nic_bytes_per_s: float = math.inf,
                  gpu_type: str = "", cpus: float = math.inf, memory_bytes: float = math.inf) -> tuple[NodeInfo, ...]:
    width = max(2, len(str(count - 1)))
    return tuple(
        NodeInfo(name=f"node-{i:0{width}d}", gpus=gpus, cache_capacity_bytes=cache_bytes, nic_bytes_per_s=nic_bytes_per_s,
                 gpu_type=gpu_type, cpus=cpus, memory_bytes=memory_bytes)
        for i in range(count)
    )


def _gpu_type(data: dict, where: str, default: str = "") -> str:
    value = data.get("gpu_type", default)
    if value is None or value == "":
        return default
    if not isinstance(value, str) or not _GPU_TYPE.fullmatch(value):
        raise SimulatorInputError(f"{where} 'gpu_type': expected 1..32 characters of [a-z0-9._-] "
                                  f"starting with a letter or digit (such as v100), got {value!r}")
    return value


@dataclass(frozen=True)
class ClusterSpec:
    nodes: tuple[NodeInfo, ...] = field(default_factory=_default_nodes)
    restart_cost_s: float = DEFAULT_RESTART_COST_S
    interval_s: float = DEFAULT_INTERVAL_S
    max_gpus_per_job: int | None = None  # None: every GPU of the cluster
    schedule_on_events: bool = False
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    storage_bandwidth_bytes_per_s: float = math.inf  # cluster-wide remote read budget; inf = not limiting
    # A profile's measured launch and exit (estimator.profiles.read_overheads) where it has
    # them; off, every application pays restart_cost_s and finishes at its last step.
    job_overheads: bool = True

    def __post_init__(self):
        if not self.nodes:
            raise SimulatorInputError("cluster field 'nodes': need at least one node")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise SimulatorInputError(f"cluster field 'nodes': node name {dup!r} appears twice")
        if any(n.gpus < 1 for n in self.nodes):
            raise SimulatorInputError("cluster field 'nodes': every node needs at least 1 GPU")
        if not (math.isfinite(self.restart_cost_s) and self.restart_cost_s >= 0):
            raise SimulatorInputError(f"cluster field 'restart_cost_s': must be a number >= 0, got {self.restart_cost_s!r}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise SimulatorInputError(f"cluster field 'interval_s': must be a number > 0, got {self.interval_s!r}")
        if self.max_gpus_per_job is not None and self.max_gpus_per_job < 1:
            raise SimulatorInputError(f"cluster field 'max_gpus_per_job': must be >= 1, got {self.max_gpus_per_job!r}")
        if not self.stall_timeout_s > 0:
            raise SimulatorInputError(f"cluster field 'stall_timeout_s': must be > 0, got {self.stall_timeout_s!r}")
        if not self.storage_bandwidth_bytes_per_s > 0:
            raise SimulatorInputError(
                f"cluster field 'storage_bandwidth_bytes_per_s': must be > 0 (.inf = unlimited), got {self.storage_bandwidth_bytes_per_s!r}"
            )
        for n in self.nodes:
            if not (math.isfinite(n.cache_capacity_bytes) and n.cache_capacity_bytes >= 0):
                raise SimulatorInputError(f"cluster field 'cache_bytes_per_node': node {n.name} needs a finite number >= 0, got {n.cache_capacity_bytes!r}")
            if not n.nic_bytes_per_s > 0:
                raise SimulatorInputError(f"cluster field 'nic_bytes_per_s': node {n.name} needs a number > 0 (.inf = unlimited), got {n.nic_bytes_per_s!r}")
            for name, value in (("cpus", n.cpus), ("memory_bytes", n.memory_bytes)):
                if not value >= 0:
                    raise SimulatorInputError(f"cluster field '{name}': node {n.name} needs a number >= 0 (.inf = no limit), got {value!r}")

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def gpus_per_node(self) -> int:
        """The largest node's GPU count (what ``predict`` packs against)."""
        return max(n.gpus for n in self.nodes)

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """Distinct GPU types of the nodes, sorted ("" = untyped nodes)."""
        return tuple(sorted({n.gpu_type for n in self.nodes}))

    @property
    def total_cache_bytes(self) -> float:
        return float(sum(n.cache_capacity_bytes for n in self.nodes))

    @property
    def training_gpus(self) -> int:
        """GPUs of the training pool (inference-pool GPUs are only lent, DeepBoot)."""
        return sum(n.gpus for n in self.nodes if n.pool == "training")

    @property
    def inference_nodes(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.pool == "inference")

    @property
    def io_limited(self) -> bool:
        """Whether remote IO can ever limit a job (a finite budget or NIC)."""
        return math.isfinite(self.storage_bandwidth_bytes_per_s) or any(math.isfinite(n.nic_bytes_per_s) for n in self.nodes)

    @property
    def job_gpu_cap(self) -> int:
        cap = self.total_gpus
        return min(cap, self.max_gpus_per_job) if self.max_gpus_per_job else cap

    def describe(self) -> dict[str, Any]:
        """JSON-ready description (summary.json)."""
        shapes: dict[int, int] = {}
        for n in self.nodes:
            shapes[n.gpus] = shapes.get(n.gpus, 0) + 1
        by_type: dict[str, int] = {}
        for n in self.nodes:
            by_type[n.gpu_type] = by_type.get(n.gpu_type, 0) + n.gpus
        return {
            "nodes": len(self.nodes),
            "gpus": self.total_gpus,
            "nodes_by_gpus": {str(g): c for g, c in sorted(shapes.items())},
            "gpus_by_type": {t or "untyped": c for t, c in sorted(by_type.items())},
            "inference_gpus": self.total_gpus - self.training_gpus,
            "restart_cost_s": self.restart_cost_s,
            "job_overheads": self.job_overheads,
            "interval_s": self.interval_s,
            "max_gpus_per_job": self.job_gpu_cap,
            "schedule_on_events": self.schedule_on_events,
            "cache_bytes": self.total_cache_bytes,
            "storage_bandwidth_bytes_per_s": self.storage_bandwidth_bytes_per_s,
        }


def _number(data: dict, key: str, default: float, *, integer: bool = False, where: str = "cluster field") -> Any:
    value = data.get(key, default)
    if value is None:
        return default
    if isinstance(value, str):
        value = _quantity(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SimulatorInputError(f"{where} {key!r}: expected a number, got {value!r}")
    if math.isnan(value):
        raise SimulatorInputError(f"{where} {key!r}: expected a number, got NaN")
    if integer:
        if float(value) != int(value):
            raise SimulatorInputError(f"{where} {key!r}: expected a whole number, got {value!r}")
        return int(value)
    return float(value)


_UNITS = {"": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40, "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30,
          "tib": 2.0**40}


def _quantity(text: str) -> float | str:
    """``"8e9"``, ``"8 GB"``, ``"100 MB/s"``, ``"256Gi"``, ``"inf"`` -> a number (decimal units, and binary
    ones: Ki, Mi, Gi, Ti, with or without B); other text unchanged.

    YAML 1.1 reads ``8e9`` (no sign in the exponent) as a string, hence the plain numbers too.
    """
    word = text.strip().lower().replace(" ", "")
    if word in ("inf", ".inf", "infinity", "unlimited"):
        return math.inf
    if word.endswith("/s"):
        word = word[:-2]
    for unit in sorted(_UNITS, key=len, reverse=True):
        if unit and word.endswith(unit) or not unit:
            try:
                return float(word[: len(word) - len(unit)] if unit else word) * _UNITS[unit]
            except ValueError:
                continue
    return text


def _non_negative(data: dict, key: str, default: float, where: str) -> float:
    value = _number(data, key, default, where=where)
    if not (math.isfinite(value) and value >= 0):
        raise SimulatorInputError(f"{where} {key!r}: must be a finite number >= 0, got {value!r}")
    return value


def _capacity(data: dict, key: str, default: float, where: str, *, whole: bool = False) -> float:
    """Cores or bytes a node offers: a number >= 0, .inf = no limit (bytes: whole, or with a unit)."""
    value = _number(data, key, default, where=where)
    if not value >= 0:
        raise SimulatorInputError(f"{where} {key!r}: must be a number >= 0 (.inf = no limit), got {value!r}")
    if whole and math.isfinite(value) and value != int(value):
        raise SimulatorInputError(f"{where} {key!r}: expected whole bytes, got {value!r}")
    return value


def _positive_int(data: dict, key: str, default: int, where: str) -> int:
    value = _number(data, key, default, integer=True, where=where)
    if value < 1:
        raise SimulatorInputError(f"{where} {key!r}: must be >= 1, got {value}")
    return value


def cluster_from_dict(data: dict[str, Any] | None, source: str = "cluster spec") -> ClusterSpec:
    """Validate a parsed YAML mapping; ``SimulatorInputError`` naming the field on any problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SimulatorInputError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - _FIELDS)
    if unknown:
        raise SimulatorInputError(f"{source}: unknown field {unknown[0]!r}; known: {', '.join(sorted(_FIELDS))}")
    gpus_per_node = _positive_int(data, "gpus_per_node", DEFAULT_GPUS_PER_NODE, "cluster field")
    cache = _non_negative(data, "cache_bytes_per_node", 0.0, "cluster field")
    nic = _number(data, "nic_bytes_per_s", math.inf)
    gpu_type = _gpu_type(data, "cluster field")
    cpus = _capacity(data, "cpus_per_node", math.inf, "cluster field")
    memory = _capacity(data, "memory_bytes_per_node", math.inf, "cluster field", whole=True)
    raw_nodes = data.get("nodes", DEFAULT_NODES)
    if isinstance(raw_nodes, list):
        if "gpus_per_node" in data:
            raise SimulatorInputError("cluster field 'gpus_per_node': give GPUs per entry when 'nodes' is a list")
        nodes: list[NodeInfo] = []
        for i, entry in enumerate(raw_nodes):
            where = f"cluster field 'nodes[{i}]'"
            if not isinstance(entry, dict):
                raise SimulatorInputError(f"{where}: expected a mapping like {{gpus: 4, count: 2}}, got {entry!r}")
            bad = sorted(set(map(str, entry)) - _NODE_FIELDS)
            if bad:
                raise SimulatorInputError(f"{where}: unknown field {bad[0]!r}; known: {', '.join(sorted(_NODE_FIELDS))}")
            if "gpus" not in entry:
                raise SimulatorInputError(f"{where}: field 'gpus' is required")
            gpus = _positive_int(entry, "gpus", 0, where + " field")
            count = _positive_int(entry, "count", 1, where + " field")
            name = entry.get("name")
            if name is not None and (not isinstance(name, str) or not name):
                raise SimulatorInputError(f"{where} field 'name': expected a non-empty string, got {name!r}")
            if name is not None and count > 1:
                raise SimulatorInputError(f"{where}: 'name' and 'count' > 1 cannot go together")
            pool = entry.get("pool", "training")
            if pool not in _POOLS:
                raise SimulatorInputError(f"{where} field 'pool': expected one of {', '.join(_POOLS)}, got {pool!r}")
            node_cache = _non_negative(entry, "cache_bytes", cache, where + " field")
            node_nic = _number(entry, "nic_bytes_per_s", nic, where=where + " field")
            node_type = _gpu_type(entry, where + " field", gpu_type)
            node_cpus = _capacity(entry, "cpus", cpus, where + " field")
            node_memory = _capacity(entry, "memory_bytes", memory, where + " field", whole=True)
            for _ in range(count):
                nodes.append(NodeInfo(name=name or "", gpus=gpus, pool=pool, cache_capacity_bytes=node_cache,
                                      nic_bytes_per_s=node_nic, gpu_type=node_type, cpus=node_cpus, memory_bytes=node_memory))
        width = max(2, len(str(len(nodes) - 1)))
        nodes = [n if n.name else dataclasses.replace(n, name=f"node-{i:0{width}d}") for i, n in enumerate(nodes)]
        node_tuple = tuple(nodes)
    else:
        count = _positive_int(data, "nodes", DEFAULT_NODES, "cluster field")
        node_tuple = uniform_nodes(count, gpus_per_node, cache, nic, gpu_type, cpus, memory)
    flag = data.get("schedule_on_events", False)
    if not isinstance(flag, bool):
        raise SimulatorInputError(f"cluster field 'schedule_on_events': expected true or false, got {flag!r}")
    overheads = data.get("job_overheads", True)
    if not isinstance(overheads, bool):
        raise SimulatorInputError(f"cluster field 'job_overheads': expected true or false, got {overheads!r}")
    max_gpus = data.get("max_gpus_per_job")
    if max_gpus is not None:
        max_gpus = _positive_int(data, "max_gpus_per_job", 1, "cluster field")
    return ClusterSpec(
        nodes=node_tuple,
        restart_cost_s=_number(data, "restart_cost_s", DEFAULT_RESTART_COST_S),
        job_overheads=overheads,
        interval_s=_number(data, "interval_s", DEFAULT_INTERVAL_S),
        max_gpus_per_job=max_gpus,
        schedule_on_events=flag,
        stall_timeout_s=_number(data, "stall_timeout_s", DEFAULT_STALL_TIMEOUT_S),
        storage_bandwidth_bytes_per_s=_number(data, "storage_bandwidth_bytes_per_s", math.inf),
    )


def load_cluster(path: str | Path | None) -> ClusterSpec:
    """The cluster described by the YAML file at ``path``; the defaults when ``path`` is None."""
    if path is None:
        return ClusterSpec()
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SimulatorInputError(f"cluster spec {path}: no such file") from None
    except OSError as exc:
        raise SimulatorInputError(f"cluster spec {path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise SimulatorInputError(f"cluster spec {path}:{where} not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    return cluster_from_dict(data, f"cluster spec {path}")
