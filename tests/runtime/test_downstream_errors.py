"""The one rule for errors of a downstream service (services/runtime/downstream.py), the status
details that carry every problem (silod/rpc/errors.py) and the identifier check every server
runs before its servicers (silod/rpc/identifiers.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from estimator.model_store import ModelStore
from estimator.servicer import EstimatorServicer
from services.runtime import errors
from services.runtime.downstream import PASS_THROUGH, translate
from services.runtime.server import ServiceDefinition
from silod.rpc import identifiers
from silod.rpc.errors import DETAILS_KEY, FieldViolation, field_violations, status_details
from silod.v1 import common_pb2, metadata_pb2, plan_pb2, worker_agent_pb2, worker_agent_pb2_grpc
from tests.support import contracts
from tests.support.servicers import serving


def rpc_error(code: grpc.StatusCode, details: str, violations: list[FieldViolation] = ()) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if violations:
        trailing = grpc.aio.Metadata((DETAILS_KEY, status_details(code, details, violations)))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)


REFUSED_JOB_ID = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "job_id: must not contain NUL characters",
                           [FieldViolation("job_id", "must not contain NUL characters")])


@pytest.mark.parametrize(
    ("downstream", "fields", "code", "message"),
    [
        # The caller's field: the same code, the caller's path.
        (REFUSED_JOB_ID, {"job_id": "queries[2].job_id"}, grpc.StatusCode.INVALID_ARGUMENT,
         "queries[2].job_id: must not contain NUL characters"),
        (rpc_error(grpc.StatusCode.NOT_FOUND, "model.job_id: no job 'job-1'"), {"model.job_id": "job_id"},
         grpc.StatusCode.NOT_FOUND, "job_id: no job 'job-1'"),
        (rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "plan.version: must follow 7", [
            FieldViolation("plan.version", "must follow 7"), FieldViolation("plan.jobs[0].job_id", "unknown job")]),
         {"plan": "plan"}, grpc.StatusCode.FAILED_PRECONDITION, "plan.version: must follow 7; plan.jobs[0].job_id: unknown job"),
        (rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "name: bad"), PASS_THROUGH, grpc.StatusCode.INVALID_ARGUMENT, "name: bad"),
        # A field this service made up, or no mapping at all: this service's bug.
        (REFUSED_JOB_ID, {"name": "dataset"}, grpc.StatusCode.INTERNAL, None),
        (REFUSED_JOB_ID, None, grpc.StatusCode.INTERNAL, None),
        # Retryable stays retryable.
        (rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"), PASS_THROUGH, grpc.StatusCode.UNAVAILABLE, None),
        (rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"), None, grpc.StatusCode.DEADLINE_EXCEEDED, None),
        (rpc_error(grpc.StatusCode.ABORTED, "version taken"), None, grpc.StatusCode.ABORTED, "version taken"),
        # Credentials between services are the operator's to fix; downstream bugs are bugs.
        (rpc_error(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"), PASS_THROUGH, grpc.StatusCode.UNAVAILABLE, None),
        (rpc_error(grpc.StatusCode.INTERNAL, "boom"), PASS_THROUGH, grpc.StatusCode.INTERNAL, None),
        (rpc_error(grpc.StatusCode.UNKNOWN, "boom"), PASS_THROUGH, grpc.StatusCode.INTERNAL, None),
    ],
)
def test_the_downstream_rule(downstream: grpc.aio.AioRpcError, fields, code: grpc.StatusCode, message: str | None) -> None:
    answer = translate(downstream, "metadata Call", fields)
    assert answer.code == code
    if message is not None:
        assert str(answer) == message


class _RefusingMetadata:
    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        self.error = error

    async def GetJobModel(self, request):  # noqa: N802
        raise self.error

    async def PutJobModel(self, request):  # noqa: N802
        raise self.error


@pytest.mark.parametrize(
    ("error", "code", "field"),
    [
        (REFUSED_JOB_ID, grpc.StatusCode.INVALID_ARGUMENT, "job_id"),  # issue 17: was RuntimeError -> INTERNAL
        (rpc_error(grpc.StatusCode.UNAVAILABLE, "down"), grpc.StatusCode.UNAVAILABLE, None),
        (rpc_error(grpc.StatusCode.INTERNAL, "bug"), grpc.StatusCode.INTERNAL, None),
    ],
)
def test_estimator_answers_a_metadata_refusal_by_the_rule(error: grpc.aio.AioRpcError, code: grpc.StatusCode,
                                                           field: str | None) -> None:
    store = ModelStore("metadata:1")
    store.attach(_RefusingMetadata(error))
    servicer = EstimatorServicer(store)
    with pytest.raises(errors.ServiceError) as answered:
        asyncio.run(servicer.GetJobModel(common_pb2.GetJobModelRequest(job_id="job-1"), None))
    assert answered.value.code == code
    assert answered.value.field == field


def _leaking(error: grpc.aio.AioRpcError) -> ServiceDefinition:
    class Leaky(worker_agent_pb2_grpc.WorkerAgentServiceServicer):
        async def GetDirective(self, request, context):  # type: ignore[no-untyped-def]
            raise error  # a downstream failure nobody translated

    return ServiceDefinition(
        name="leaky", service_names=["silod.v1.WorkerAgentService"],
        register=lambda server: worker_agent_pb2_grpc.add_WorkerAgentServiceServicer_to_server(Leaky(), server))


@pytest.mark.parametrize(
    ("leaked", "code"),
    [
        (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),  # retryable, not UNKNOWN
        (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL),  # nobody said it was the caller's field
    ],
)
def test_a_leaked_downstream_error_is_answered_by_the_rule(leaked: grpc.StatusCode, code: grpc.StatusCode) -> None:
    async def scenario() -> None:
        async with serving(_leaking(rpc_error(leaked, "downstream says no"))) as server:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="job-1"), timeout=10)
                assert failed.value.code() == code

    asyncio.run(scenario())


def test_the_runtime_refuses_malformed_identifiers_with_every_field_in_the_details() -> None:
    async def scenario() -> None:
        async with serving(_leaking(REFUSED_JOB_ID)) as server:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="a/../b"), timeout=10)
                assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field_violations(failed.value) == [
                    FieldViolation("job_id", identifiers.JOB_ID.problem("a/../b"))]
                assert failed.value.details() == f"job_id: {identifiers.JOB_ID.problem('a/../b')}"

    asyncio.run(scenario())


def test_identifier_fields_of_nested_and_repeated_messages_are_found() -> None:
    plan = plan_pb2.AllocationPlan(
        jobs=[plan_pb2.JobAllocation(job_id="ok-1"), plan_pb2.JobAllocation(job_id="bad id",
              placements=[plan_pb2.GpuPlacement(node="n/1")])],
        replicas=[plan_pb2.InferenceReplica(replica_id="bert#3", node="n1", task_id="..")])
    found = dict(identifiers.message_problems(metadata_pb2.CommitPlanRequest(plan=plan)))
    assert set(found) == {"plan.jobs[1].job_id", "plan.jobs[1].placements[0].node", "plan.replicas[0].task_id"}
    spec = common_pb2.DatasetSpec(name="x" * 129)
    assert [f for f, _ in identifiers.message_problems(metadata_pb2.RegisterDatasetRequest(spec=spec))] == ["spec.name"]


def test_every_identifier_looking_request_field_has_a_rule() -> None:
    """A request field named like an identifier (…_id, node, dataset, tenant) is checked: a new
    RPC that takes one is covered by the runtime without more code."""
    unchecked = []
    for method in contracts.methods():
        stack, seen = [method.input_type], set()
        while stack:
            message = stack.pop()
            if message.full_name in seen:
                continue
            seen.add(message.full_name)
            for field in message.fields:
                if field.message_type is not None:
                    stack.append(field.message_type)
                elif field.type == field.TYPE_STRING and (
                        field.name.endswith("_id") or field.name in ("node", "dataset", "tenant")) \
                        and field.name not in ("client_request_id",) \
                        and identifiers.rule_for(message.full_name, field.name) is None:
                    unchecked.append(f"{message.full_name}.{field.name}")
    assert not unchecked, f"identifier-like fields without a rule in silod/rpc/identifiers.py: {unchecked}"


def test_an_answer_with_many_long_problems_fits_the_trailer_limit() -> None:
    """50 problems of 1 KB each: the client still gets INVALID_ARGUMENT with the first problems in
    the message and the details (gRPC clients refuse trailers over 8 KiB with RESOURCE_EXHAUSTED,
    found by the metadata fuzz test on CommitPlan)."""
    violations = [FieldViolation(f"jobs[{i}].replicas[0].replica_id", "x" * 1000) for i in range(50)]

    class Refusing(worker_agent_pb2_grpc.WorkerAgentServiceServicer):
        async def GetDirective(self, request, context):  # type: ignore[no-untyped-def]
            raise errors.InvalidArgument(violations=violations)

    definition = ServiceDefinition(
        name="refusing", service_names=["silod.v1.WorkerAgentService"],
        register=lambda server: worker_agent_pb2_grpc.add_WorkerAgentServiceServicer_to_server(Refusing(), server))

    async def scenario() -> None:
        async with serving(definition) as server:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = worker_agent_pb2_grpc.WorkerAgentServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.GetDirective(worker_agent_pb2.GetDirectiveRequest(job_id="j"), timeout=10)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value
        assert failed.value.details().startswith("jobs[0].replicas[0].replica_id: xxx")
        assert failed.value.details().endswith("more problems)")
        got = field_violations(failed.value)
        assert got and got[0].field == "jobs[0].replicas[0].replica_id"

    asyncio.run(scenario())
