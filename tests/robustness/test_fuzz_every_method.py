"""Every method of every silod service, taken from the protobuf descriptors, answers generated and
edge-case requests with a proper status, on a real cluster (tests/robustness/conftest.py).

The methods are enumerated from ``silod.v1``'s file descriptors and the services found on each
process by gRPC reflection, so a new method (or service) is fuzzed without editing this file.
Requests are built from the request type's descriptor: hypothesis draws each field (strings
mixing the cluster's real ids with "", NUL, 4 KB, path tricks and random text; integers at
both ends of their range; NaN and infinities; unknown enum numbers; nested messages; repeated
and map fields), and every method also gets fixed edge cases: the empty request, every field
at one extreme, and deep repeats (hundreds of elements in every repeated field). Server streams
are read a few messages, then cancelled; client streams send a few generated messages.

A method fails the test if it answers INTERNAL, UNKNOWN or UNIMPLEMENTED, if a unary call or
the first answer of a stream takes past the deadline, or if afterwards a service is not
SERVING or no longer answers a known-good request.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from silod.v1 import (
    cache_pb2,
    cache_pb2_grpc,
    estimator_pb2,
    estimator_pb2_grpc,
    metadata_pb2,
    metadata_pb2_grpc,
    scheduler_pb2_grpc,
    worker_agent_pb2,
    worker_agent_pb2_grpc,
)
from tests.robustness.conftest import APPLICATION, DATASET, NODE, Cluster
from tests.support import contracts

EXAMPLES = int(os.environ.get("SILOD_FUZZ_EXAMPLES", "40"))  # generated requests per method, beside the edge cases
# The suite's run draws the same requests every time; SILOD_FUZZ_RANDOM=1 draws new ones (a hunt).
DERANDOMIZE = not os.environ.get("SILOD_FUZZ_RANDOM")
UNARY_DEADLINE_S = 10.0  # far above any answer of this cluster: past it, the call hung
STREAM_FIRST_S = 3.0  # for a stream's first message or status; a stream that has none to send yet may wait
STREAM_MESSAGES = 1  # then cancel: Watch and WatchJob stream for as long as asked
FAILING = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED}


SERVICES = contracts.services()
METHODS = contracts.methods()


# --- generated requests ----------------------------------------------------------------------

EDGE_STRINGS = [
    "", "\x00", "a\x00b", "x" * 4096, "é" * 2048, "..", "../../../etc/passwd", "/abs/path", "a b", "-rf",
    "\u202e\ufeff", "%s%n%x", "'; DROP TABLE jobs; --", "\n", "*", "s3://bucket/key", "file:///",
]
INT32 = [0, 1, -1, 2**31 - 1, -(2**31)]
INT64 = [0, 1, -1, 2**63 - 1, -(2**63)]
UINT32 = [0, 1, 2**32 - 1]
UINT64 = [0, 1, 2**64 - 1]
FLOATS = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, 5e-324]
UNKNOWN_ENUMS = [99, -1, 2**31 - 1]


def _known(cluster: Cluster) -> dict[str, list[str]]:
    """Real values by field name: requests that name them reach past the lookups."""
    return {
        "job_id": [cluster.job_id], "task_id": [cluster.job_id], "released_jobs": [cluster.job_id],
        "dataset": [DATASET], "name": [DATASET, NODE], "node": [NODE], "lease_id": [cluster.lease_id],
        "keys": cluster.keys, "key": cluster.keys, "application": [APPLICATION], "tenant": ["default"],
    }


class Generator:
    """Hypothesis strategies and fixed edge cases for any message type, from its descriptor."""

    def __init__(self, known: dict[str, list[str]]) -> None:
        self.known = known
        self._cache: dict[tuple[str, int], st.SearchStrategy[Any]] = {}

    def message(self, descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
        key = (descriptor.full_name, depth)
        if key not in self._cache:
            cls = message_factory.GetMessageClass(descriptor)
            if depth > 3:
                strategy = st.builds(cls)
            else:
                optional = {f.name: self._field(f, depth) for f in descriptor.fields}
                strategy = st.fixed_dictionaries({}, optional=optional).map(lambda values: _build(cls, values))
            self._cache[key] = strategy
        return self._cache[key]

    def _field(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            return st.dictionaries(self._scalar(key, depth), self._scalar(value, depth), max_size=3)
        element = self._scalar(field, depth)
        if field.is_repeated:
            return st.lists(element, max_size=3)
        return element

    def _scalar(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
        t = field.type
        if t == FieldDescriptor.TYPE_MESSAGE:
            return self.message(field.message_type, depth + 1)
        if t == FieldDescriptor.TYPE_STRING:
            known = self.known.get(field.name, [])
            return st.one_of(st.sampled_from(known or [""]), st.sampled_from(EDGE_STRINGS), st.text(max_size=24))
        if t == FieldDescriptor.TYPE_BYTES:
            return st.one_of(st.sampled_from([b"", b"\x00" * 4096]), st.binary(max_size=32))
        if t == FieldDescriptor.TYPE_BOOL:
            return st.booleans()
        if t == FieldDescriptor.TYPE_ENUM:
            return st.sampled_from([v.number for v in field.enum_type.values] + UNKNOWN_ENUMS)
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            width = 32 if t == FieldDescriptor.TYPE_FLOAT else 64
            return st.one_of(st.sampled_from(FLOATS if width == 64 else FLOATS[:-2]), st.floats(width=width),
                             st.floats(-10, 1000, width=width))
        low, high, edges = _int_range(t)
        return st.one_of(st.sampled_from(edges), st.integers(max(low, -3), min(high, 100)), st.integers(low, high))

    def edge_cases(self, descriptor: Descriptor) -> list[tuple[str, Any]]:
        cls = message_factory.GetMessageClass(descriptor)
        cases: list[tuple[str, Any]] = [("empty", cls())]
        for name, value in (("NUL", "\x00"), ("4 KB strings", "x" * 4096), ("known ids", None)):
            cases.append((name, _fill(descriptor, lambda f, v=value: self._string_edge(f, v), repeat=2)))
        for name, pick in (("minimum numbers", 0), ("maximum numbers", -1), ("minus one", 2)):
            cases.append((name, _fill(descriptor, lambda f, i=pick: _number_edge(f, i), repeat=2)))
        for name, value in (("NaN", math.nan), ("infinity", math.inf), ("-infinity", -math.inf)):
            cases.append((name, _fill(descriptor, lambda f, v=value: v if _is_float(f) else None, repeat=1)))
        cases.append(("unknown enums", _fill(descriptor, lambda f: 99 if f.type == f.TYPE_ENUM else None, repeat=1)))
        cases.append(("deep repeats", _fill(descriptor, lambda f: self._string_edge(f, None) or _number_edge(f, 3),
                                            repeat=300, nested_repeat=2)))
        return cases

    def _string_edge(self, field: FieldDescriptor, value: str | None) -> Any:
        if field.type != field.TYPE_STRING:
            return None
        if value is None:
            known = self.known.get(field.name)
            return known[0] if known else "x"
        return value


def _int_range(t: int) -> tuple[int, int, list[int]]:
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return -(2**31), 2**31 - 1, INT32
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return 0, 2**32 - 1, UINT32
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return 0, 2**64 - 1, UINT64
    return -(2**63), 2**63 - 1, INT64


def _is_float(field: FieldDescriptor) -> bool:
    return field.type in (field.TYPE_DOUBLE, field.TYPE_FLOAT)


def _number_edge(field: FieldDescriptor, pick: int) -> Any:
    """pick 0: the type's minimum, -1: its maximum, 2: -1 where it fits, 3: a small valid-looking 1."""
    if field.type in (field.TYPE_STRING, field.TYPE_BYTES, field.TYPE_MESSAGE, field.TYPE_BOOL):
        return True if field.type == field.TYPE_BOOL and pick == -1 else None
    if field.type == field.TYPE_ENUM:
        return field.enum_type.values[-1].number if pick == -1 else None
    if _is_float(field):
        return {0: -1e300, -1: 1e300, 2: -1.0, 3: 1.0}[pick] if field.type == field.TYPE_DOUBLE else \
            {0: -3e38, -1: 3e38, 2: -1.0, 3: 1.0}[pick]
    low, high, _ = _int_range(field.type)
    return {0: low, -1: high, 2: max(low, -1), 3: 1}[pick]


def _fill(descriptor: Descriptor, value_of: Callable[[FieldDescriptor], Any], *, repeat: int, nested_repeat: int = 0,
          depth: int = 0) -> Any:
    """A message whose every field (recursively, 4 levels) is ``value_of(field)`` where that is not None."""
    message = message_factory.GetMessageClass(descriptor)()
    count = repeat if depth == 0 or not nested_repeat else nested_repeat
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = (value_of(field.message_type.fields_by_name[n]) for n in ("key", "value"))
            if key is not None and value is not None:
                getattr(message, field.name)[key] = value
            continue
        if field.message_type is not None:
            if depth >= 3:
                continue
            inner = [_fill(field.message_type, value_of, repeat=repeat, nested_repeat=nested_repeat, depth=depth + 1)]
            if field.is_repeated:
                getattr(message, field.name).extend(inner * count)
            else:
                getattr(message, field.name).CopyFrom(inner[0])
            continue
        value = value_of(field)
        if value is None:
            continue
        if field.is_repeated:
            getattr(message, field.name).extend([value] * count)
        else:
            setattr(message, field.name, value)
    return message


def _build(cls: type, values: dict[str, Any]) -> Any:
    message = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name) if field.is_repeated or field.message_type is not None else None
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for k, v in value.items():
                if value_field.message_type is not None:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif field.is_repeated:
            target.extend(value)
        elif field.message_type is not None:
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


# --- calling ---------------------------------------------------------------------------------


class Outcome(Exception):
    """A failing answer, with what was sent."""


def _call(channel: grpc.Channel, method: MethodDescriptor, requests: list[Any]) -> grpc.StatusCode:
    """Send ``requests`` (one unless the method takes a stream); the status code of the answer."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    response_cls = message_factory.GetMessageClass(method.output_type)
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    stub = kind(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_cls.FromString)
    argument = iter(requests) if method.client_streaming else requests[0]
    started = time.monotonic()
    try:
        if not method.server_streaming:
            stub(argument, timeout=UNARY_DEADLINE_S)
            return grpc.StatusCode.OK
        stream = stub(argument, timeout=STREAM_FIRST_S)
        try:
            for count, _ in enumerate(stream, 1):
                if count >= STREAM_MESSAGES:
                    break
        finally:
            stream.cancel()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        if code in FAILING:
            raise Outcome(f"{path} answered {code.name}: {exc.details()}") from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and not method.server_streaming:
            raise Outcome(f"{path} hung: no answer within {time.monotonic() - started:.1f}s") from None
        return code


# --- the cluster stays up and useful ------------------------------------------------------------


def _canaries(cluster: Cluster) -> dict[str, Callable[[grpc.Channel], object]]:
    """A request each process must still answer with OK after being fuzzed."""
    return {
        "metadata": lambda c: metadata_pb2_grpc.MetadataServiceStub(c).GetDataset(
            metadata_pb2.GetDatasetRequest(name=DATASET), timeout=10),
        "scheduler": lambda c: scheduler_pb2_grpc.JobServiceStub(c).GetJob(
            metadata_pb2.GetJobRequest(job_id=cluster.job_id), timeout=10),
        "estimator": lambda c: estimator_pb2_grpc.EstimatorServiceStub(c).Predict(estimator_pb2.PredictRequest(
            queries=[estimator_pb2.PredictQuery(application=APPLICATION, candidates=[
                estimator_pb2.CandidateAllocation(gpus=1)])]), timeout=10),
        "cache-server": lambda c: cache_pb2_grpc.CacheServiceStub(c).Lease(cache_pb2.LeaseRequest(
            job_id=cluster.job_id, dataset=DATASET, keys=cluster.keys[:1]), timeout=10),
        "worker-agent": lambda c: worker_agent_pb2_grpc.WorkerAgentServiceStub(c).GetNodeStatus(
            worker_agent_pb2.GetNodeStatusRequest(), timeout=10),
    }


def assert_cluster_healthy(cluster: Cluster) -> None:
    canaries = _canaries(cluster)
    for name, proc in cluster.procs.items():
        assert proc.running(), f"{name} exited with code {proc.proc.returncode}:\n{proc.log()[-5000:]}"
        with grpc.insecure_channel(proc.address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, f"{name}: {reply}"
                canaries[name](channel)
            except grpc.RpcError as exc:
                pytest.fail(f"{name} stopped answering after the fuzz: {exc.code().name}: {exc.details()}")


# --- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(cluster: Cluster) -> dict[str, str]:
    """Service full name -> address of the process serving it, by reflection."""
    where: dict[str, str] = {}
    for proc in cluster.procs.values():
        with grpc.insecure_channel(proc.address) as channel:
            for name in ProtoReflectionDescriptorDatabase(channel).get_services():
                where.setdefault(name, proc.address)
    return where


@pytest.fixture(scope="module")
def generator(cluster: Cluster) -> Generator:
    return Generator(_known(cluster))


@pytest.fixture(scope="module")
def channels(served: dict[str, str]) -> Iterator[dict[str, grpc.Channel]]:
    opened = {address: grpc.insecure_channel(address) for address in set(served.values())}
    yield opened
    for channel in opened.values():
        channel.close()


def test_every_service_of_the_contracts_is_served(served: dict[str, str]) -> None:
    assert set(SERVICES) <= set(served), f"not served by any process of the cluster: {set(SERVICES) - set(served)}"


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.containing_service.name}.{m.name}")
def test_method_answers_every_request_properly(
    method: MethodDescriptor, cluster: Cluster, served: dict[str, str], generator: Generator,
    channels: dict[str, grpc.Channel],
) -> None:
    channel = channels[served[method.containing_service.full_name]]
    codes: Counter[str] = Counter()

    def send(requests: list[Any], what: str) -> None:
        try:
            codes[_call(channel, method, requests).name] += 1
        except Outcome as exc:
            raise AssertionError(f"{exc} for {what}: {[str(r)[:600] for r in requests]}") from None

    for name, request in generator.edge_cases(method.input_type):
        send([request] * (2 if method.client_streaming else 1), f"the edge case {name!r}")

    strategy = generator.message(method.input_type)
    if method.client_streaming:
        strategy = st.lists(strategy, min_size=1, max_size=3)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
              suppress_health_check=list(HealthCheck))
    @given(drawn=strategy)
    def generated(drawn: Any) -> None:
        send(drawn if method.client_streaming else [drawn], "a generated request")

    generated()
    assert_cluster_healthy(cluster)
    print(f"{method.full_name}: {dict(codes)}")


def test_the_cluster_is_healthy_after_the_fuzz(cluster: Cluster) -> None:
    assert_cluster_healthy(cluster)
