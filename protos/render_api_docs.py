"""Render docs/api.md from protos/silod/v1: services, RPCs, messages, fields and their comments.

Run through `make proto` (which also regenerates the code); tests/test_contracts.py fails
when docs/api.md no longer matches the protos, so the reference cannot drift.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"
FIELD_TYPES = {number: name[len("TYPE_"):].lower() for name, number in descriptor_pb2.FieldDescriptorProto.Type.items()}
# Source-info paths: file.message_type=4, message.field=2, file.enum_type=5, enum.value=2,
# file.service=6, service.method=2.
MESSAGE, FIELD, ENUM, ENUM_VALUE, SERVICE, METHOD = 4, 2, 5, 2, 6, 2


def load_descriptors() -> descriptor_pb2.FileDescriptorSet:
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "silod" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", "--include_source_info",
             f"--descriptor_set_out={out}", *protos],
            check=True,
        )
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    found = {}
    for loc in file.source_code_info.location:
        # Keep line breaks (block docs list rules line by line); table cells flatten them.
        text = "\n".join(line.strip() for line in (loc.leading_comments + loc.trailing_comments).splitlines())
        if text.strip():
            found[tuple(loc.path)] = text.strip()
    return found


def _block(text: str) -> list[str]:
    return [line + "  " if line else "" for line in text.splitlines()] + [""]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _type_name(field: descriptor_pb2.FieldDescriptorProto, maps: set[str]) -> str:
    if field.type_name:
        name = field.type_name.rsplit(".", 1)[-1]
        if field.type_name in maps:
            return "map"
    else:
        name = FIELD_TYPES[field.type]
    return f"repeated {name}" if field.label == field.LABEL_REPEATED else name


HAND_WRITTEN = PROTO_DIR / "docs" / "api_errors.md"  # the sections that are prose, not contracts


def identifier_table() -> str:
    """The identifier rules of silod/rpc/identifiers.py as a table: the code is the source."""
    from silod.rpc import identifiers

    fields: dict[str, list[str]] = {rule.kind: [] for rule in identifiers.RULES}
    for name, rule in identifiers.BY_FIELD.items():
        fields[rule.kind].append(f"`{name}`")
    for (message, name), rule in identifiers.BY_MESSAGE_FIELD.items():
        fields[rule.kind].append(f"`{message.rsplit('.', 1)[-1]}.{name}`")
    rows = ["| identifier | characters | request fields | example |", "|---|---|---|---|"]
    for rule in identifiers.RULES:
        extra = " and `" + "`, `".join(rule.extra) + "`" if rule.extra else ""
        rows.append(f"| {rule.kind} | 1..{rule.max_chars} of `A-Z a-z 0-9 . _ -`{extra} | "
                    f"{', '.join(fields[rule.kind])} | {_cell(rule.examples)} |")
    return "\n".join(rows)


def hand_written() -> list[str]:
    return HAND_WRITTEN.read_text().replace("{identifier_table}", identifier_table()).splitlines() + [""]


def access_table() -> list[str]:
    """Who may call what: services/runtime/access_rules.py's table, the one the services enforce."""
    from services.runtime import access_rules

    return ["## Who may call what", "",
            "Rendered from `services/runtime/access_rules.py`, the table every silod process enforces when auth is "
            "on (`auth_token` set; docs/operators.md \"Identities and access\"). An admin (the cluster token or an "
            "admin credential) may call every method listed; a user, node or job credential may call a method when "
            "its column has a rule and the request passes it; a method not listed may be called by nobody. "
            "A missing or unknown token is refused with UNAUTHENTICATED, a caller the table does not admit with "
            "PERMISSION_DENIED naming the request field. A user's tenants are their memberships at the time of the "
            "call; a job's tenant is its `spec.tenant` (empty: `default`). The last column says which calls the "
            "audit log records (docs/operators.md \"Audit log\"): every call of a method that changes something; "
            "of the control plane's routine ones, those a person makes; and every refused call of any method.", "",
            access_rules.markdown(), ""]


def render(descriptors: descriptor_pb2.FileDescriptorSet) -> str:
    lines = ["# API reference (silod.v1)", "",
             "Generated from `protos/silod/v1` by `protos/render_api_docs.py` (`make proto`); do not edit.",
             f"The prose sections come from `{HAND_WRITTEN.relative_to(ROOT)}`, the identifier table from "
             "`silod/rpc/identifiers.py`, the access table from `services/runtime/access_rules.py`.", ""]
    lines += hand_written()
    lines += access_table()
    for file in descriptors.file:
        if not file.name.startswith("silod/"):
            continue
        notes = _comments(file)
        lines += [f"## `{file.name}`", ""]
        for s_index, service in enumerate(file.service):
            lines += [f"### service `{service.name}`", ""]
            if (doc := notes.get((SERVICE, s_index))):
                lines += _block(doc)
            lines += ["| RPC | request | response | notes |", "|---|---|---|---|"]
            for m_index, method in enumerate(service.method):
                req = ("stream " if method.client_streaming else "") + method.input_type.rsplit(".", 1)[-1]
                resp = ("stream " if method.server_streaming else "") + method.output_type.rsplit(".", 1)[-1]
                lines.append(f"| `{method.name}` | {req} | {resp} | {_cell(notes.get((SERVICE, s_index, METHOD, m_index), ''))} |")
            lines.append("")
        for e_index, enum in enumerate(file.enum_type):
            lines += [f"### enum `{enum.name}`", ""]
            if (doc := notes.get((ENUM, e_index))):
                lines += _block(doc)
            for v_index, value in enumerate(enum.value):
                doc = _cell(notes.get((ENUM, e_index, ENUM_VALUE, v_index), ""))
                lines.append(f"- `{value.name}` = {value.number}" + (f" — {doc}" if doc else ""))
            lines.append("")
        for m_index, message in enumerate(file.message_type):
            lines += [f"### message `{message.name}`", ""]
            if (doc := notes.get((MESSAGE, m_index))):
                lines += _block(doc)
            if not message.field:
                lines += ["(no fields)", ""]
                continue
            maps = {f".{file.package}.{message.name}.{n.name}" for n in message.nested_type if n.options.map_entry}
            lines += ["| field | type | meaning and unit |", "|---|---|---|"]
            for f_index, field in enumerate(message.field):
                doc = _cell(notes.get((MESSAGE, m_index, FIELD, f_index), ""))
                lines.append(f"| `{field.name}` | {_type_name(field, maps)} | {doc} |")
            lines.append("")
    return "\n".join(lines)


def main() -> int:
    # Run as a script, protos/ comes first on sys.path and its silod/v1 (the .proto files) would
    # shadow the generated silod.v1 package that the access table's modules import.
    sys.path.insert(0, str(ROOT))
    (ROOT / "docs" / "api.md").write_text(render(load_descriptors()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
