"""The access table (services/runtime/access_rules.py) covers every gRPC method a silod process
serves, names only fields its requests have, and docs/api.md shows it."""

from __future__ import annotations

from pathlib import Path

from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from services.runtime.access_rules import RULES, All, Check
from tests.support import contracts

ROOT = Path(__file__).resolve().parents[2]


def _served_methods() -> dict[str, object]:
    """Full method name -> MethodDescriptor of every method a silod process serves."""
    methods = {f"/{m.containing_service.full_name}/{m.name}": m for m in contracts.methods()}
    for module in (health_pb2, reflection_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            methods.update({f"/{service.full_name}/{m.name}": m for m in service.methods})
    return methods


def test_every_method_has_a_row_and_every_row_a_method() -> None:
    served = _served_methods()
    missing = sorted(set(served) - set(RULES))
    assert not missing, f"methods without a row in services/runtime/access_rules.py (nobody may call them): {missing}"
    stale = sorted(set(RULES) - set(served))
    assert not stale, f"rows for methods that no longer exist: {stale}"


def _checks(rule) -> list[Check]:  # type: ignore[no-untyped-def]
    """Every check of the rule, those combined by All one by one."""
    found: list[Check] = []
    pending = [c for c in (rule.user, rule.node, rule.job) if c is not None]
    while pending:
        check = pending.pop()
        if isinstance(check, All):
            pending.extend(check.checks)
        else:
            found.append(check)
    return found


def test_rules_name_fields_the_request_has() -> None:
    served = _served_methods()
    for method, rule in RULES.items():
        descriptor = served[method].input_type  # type: ignore[attr-defined]
        for check in _checks(rule):
            for path in (getattr(check, "field", None), getattr(check, "tenant_field", None)):
                if path:
                    _assert_string_field(method, descriptor, path)


def _assert_string_field(method: str, descriptor, path: str) -> None:  # type: ignore[no-untyped-def]
    message = descriptor
    for part in path.split("."):
        field = message.fields_by_name.get(part.removesuffix("[]"))
        assert field is not None, f"{method}: {path!r} is not a field of {descriptor.full_name}"
        assert part.endswith("[]") == field.is_repeated, f"{method}: {path!r}: mark repeated fields []"
        message = field.message_type
    assert field.type == field.TYPE_STRING, f"{method}: {path!r} must be a string field"


def test_client_streaming_methods_are_decided_by_kind_or_by_their_first_message() -> None:
    """Of a client stream the interceptor reads the first message only: a rule that reads the request
    reads that one, so it fits only a stream whose first message says what the call is about."""
    first_message_decides = {"/silod.v1.MetadataService/RegisterDataset", "/silod.v1.JobService/RegisterDataset"}
    for method, descriptor in _served_methods().items():
        if descriptor.client_streaming and method not in first_message_decides:  # type: ignore[attr-defined]
            assert not any(c.reads_request for c in _checks(RULES[method])), method


def test_api_reference_shows_the_table() -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    for method in RULES:
        assert f"| `{method}` |" in api
