"""The access table (services/runtime/access_rules.py) covers every gRPC method a silod process
serves, names only fields its requests have, and docs/api.md shows it."""

from __future__ import annotations

from pathlib import Path

from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from services.runtime.access_rules import RULES, Check
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
    return [c for c in (rule.user, rule.node, rule.job) if c is not None]


def test_rules_name_fields_the_request_has() -> None:
    served = _served_methods()
    for method, rule in RULES.items():
        descriptor = served[method].input_type  # type: ignore[attr-defined]
        for check in _checks(rule):
            path = getattr(check, "field", None)
            if path is None:
                continue
            message = descriptor
            for part in path.split("."):
                field = message.fields_by_name.get(part.removesuffix("[]"))
                assert field is not None, f"{method}: {path!r} is not a field of {descriptor.full_name}"
                assert part.endswith("[]") == field.is_repeated, f"{method}: {path!r}: mark repeated fields []"
                message = field.message_type
            assert field.type == field.TYPE_STRING, f"{method}: {path!r} must be a string field"


def test_client_streaming_methods_are_decided_by_kind_alone() -> None:
    """The interceptor decides before the stream is read, so such a rule cannot look at a request."""
    for method, descriptor in _served_methods().items():
        if descriptor.client_streaming:  # type: ignore[attr-defined]
            assert not any(c.reads_request for c in _checks(RULES[method])), method


def test_api_reference_shows_the_table() -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    for method in RULES:
        assert f"| `{method}` |" in api
