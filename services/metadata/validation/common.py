"""Checks shared by every kind of request."""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import timestamp_pb2
from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

from services.runtime.errors import InvalidArgument
from silod.rpc import identifiers

GPU_TYPE_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")
MAX_JOB_GPU_TYPES = 16
MAX_BYTES = 2**60  # far beyond any real disk or link, yet nowhere near int64 overflow when summed
# google.protobuf.Timestamp's documented range: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59Z.
_MIN_TIMESTAMP_S = -62135596800
_MAX_TIMESTAMP_S = 253402300799


def check_identifier(value: str, rule: identifiers.Rule, field: str, *, required: bool = True) -> str:
    """A job id, dataset or node name, ...: silod/rpc/identifiers.py's rule for its kind."""
    problem = identifiers.problem(rule, value, required=required)
    if problem is not None:
        raise InvalidArgument(problem, field=field)
    return value


def check_gpu_type(value: str, field: str) -> str:
    """A GPU type as nodes advertise it and jobs name it: lower case, so "A100" is not a type of its own."""
    if not GPU_TYPE_PATTERN.fullmatch(value):
        raise InvalidArgument(f"must be 1..32 characters of [a-z0-9._-] starting with a letter or digit "
                              f"(a GPU type such as a100), got {_show(value)}", field=field)
    return value


def check_gpu_types(values: Sequence[str], field: str) -> None:
    if len(values) > MAX_JOB_GPU_TYPES:
        raise InvalidArgument(f"at most {MAX_JOB_GPU_TYPES} GPU types, got {len(values)}", field=field)
    for index, value in enumerate(values):
        check_gpu_type(value, f"{field}[{index}]")
    if len(set(values)) != len(values):
        raise InvalidArgument("must not repeat a GPU type", field=field)


def check_text(value: str, field: str, *, max_chars: int, required: bool = False) -> str:
    if required and not value.strip():
        raise InvalidArgument("must not be empty", field=field)
    if len(value) > max_chars:
        raise InvalidArgument(f"must be at most {max_chars} characters, got {len(value)}", field=field)
    return value


def check_label(value: str, field: str, *, max_chars: int, required: bool = False) -> str:
    """Free text shown to people (a job's name, an application): bounded, no control characters."""
    check_text(value, field, max_chars=max_chars, required=required)
    bad = next((ch for ch in value if unicodedata.category(ch) == "Cc"), None)
    if bad is not None:
        raise InvalidArgument(f"must not contain control characters, got {bad!r} in {_show(value)}", field=field)
    return value


def check_int(value: int, field: str, *, minimum: int, maximum: int) -> int:
    if not minimum <= value <= maximum:
        raise InvalidArgument(f"must be in {minimum}..{maximum}, got {value}", field=field)
    return value


def check_float(value: float, field: str, *, minimum: float, maximum: float) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(f"must be a finite number, got {value}", field=field)
    if not minimum <= value <= maximum:
        raise InvalidArgument(f"must be in {minimum:g}..{maximum:g}, got {value:g}", field=field)
    return value


def check_enum(value: int, enum: EnumDescriptor, field: str, *, allow_unspecified: bool = True) -> int:
    """proto3 enums are open: a client can send any number, which must not reach the store."""
    if value not in enum.values_by_number:
        raise InvalidArgument(f"unknown {enum.name} value {value}", field=field)
    if value == 0 and not allow_unspecified:
        raise InvalidArgument(f"required: {enum.name} must not be {enum.values_by_number[0].name}", field=field)
    return value


def check_timestamp(stamp: timestamp_pb2.Timestamp, field: str) -> None:
    if not _MIN_TIMESTAMP_S <= stamp.seconds <= _MAX_TIMESTAMP_S or not 0 <= stamp.nanos <= 999_999_999:
        raise InvalidArgument(
            f"timestamp out of range (seconds={stamp.seconds}, nanos={stamp.nanos})", field=field
        )


def check_string_map(
    mapping: Mapping[str, str], field: str, *, max_entries: int, max_key_chars: int = 128, max_value_chars: int = 1024
) -> None:
    if len(mapping) > max_entries:
        raise InvalidArgument(f"at most {max_entries} entries, got {len(mapping)}", field=field)
    for key, value in mapping.items():
        if not key or len(key) > max_key_chars:
            raise InvalidArgument(f"keys must be 1..{max_key_chars} characters, got {_show(key)}", field=field)
        if len(value) > max_value_chars:
            raise InvalidArgument(f"value of {_show(key)} exceeds {max_value_chars} characters", field=f"{field}[{key!r}]")


def reject_nul_characters(message: Message, path: str = "") -> None:
    """PostgreSQL cannot store NUL in text; refuse it anywhere in a request, naming where."""
    found = _find_nul(message, path)
    if found is not None:
        raise InvalidArgument("must not contain NUL characters", field=found)


def _find_nul(message: Message, path: str) -> str | None:
    for field, kind in _string_bearing_fields(message.DESCRIPTOR):
        name = f"{path}.{field.name}" if path else field.name
        value = getattr(message, field.name)
        if kind == "map":
            found = _find_nul_in_map(value, name, field.message_type.fields_by_name["value"])
        elif kind == "strings":
            found = next((f"{name}[{index}]" for index, item in enumerate(value) if "\x00" in item), None)
        elif kind == "string":
            found = name if "\x00" in value else None
        elif kind == "messages":
            found = next((hit for index, item in enumerate(value) if (hit := _find_nul(item, f"{name}[{index}]"))), None)
        else:  # "message"
            found = _find_nul(value, name) if message.HasField(field.name) else None
        if found is not None:
            return found
    return None


@functools.lru_cache(maxsize=None)
def _string_bearing_fields(descriptor: Any) -> tuple[tuple[FieldDescriptor, str], ...]:
    """The fields of ``descriptor`` that hold a string, directly or within: (field, kind), kind
    one of string, strings, message, messages, map. Worked out once per message type, so a
    request of thousands of entries (a plan) is walked through its strings only, not every
    number of every entry."""
    return _string_bearing_fields_of(descriptor, frozenset())


def _string_bearing_fields_of(descriptor: Any, visiting: frozenset[str]) -> tuple[tuple[FieldDescriptor, str], ...]:
    steps: list[tuple[FieldDescriptor, str]] = []
    for field in descriptor.fields:
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_STRING:
            steps.append((field, "strings" if repeated else "string"))
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            inner = field.message_type
            if inner.GetOptions().map_entry:
                key, value = inner.fields_by_name["key"], inner.fields_by_name["value"]
                if FieldDescriptor.TYPE_STRING in (key.type, value.type) or value.type == FieldDescriptor.TYPE_MESSAGE:
                    steps.append((field, "map"))
            elif inner.full_name in visiting or _string_bearing_fields_of(inner, visiting | {descriptor.full_name}):
                # A recursive type (Struct, Value) is assumed to hold strings.
                steps.append((field, "messages" if repeated else "message"))
    return tuple(steps)


def _find_nul_in_map(mapping: Mapping[Any, Any], path: str, value_descriptor: FieldDescriptor) -> str | None:
    for key, value in mapping.items():
        if isinstance(key, str) and "\x00" in key:
            return path
        found = _find_nul_in_value(value, value_descriptor, f"{path}[{key!r}]")
        if found is not None:
            return found
    return None


def _find_nul_in_value(value: Any, descriptor: FieldDescriptor, path: str) -> str | None:
    if descriptor.type == FieldDescriptor.TYPE_STRING:
        return path if "\x00" in value else None
    if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
        return _find_nul(value, path)
    return None


def _show(value: str, limit: int = 40) -> str:
    """Quote a client string for an error message without echoing megabytes back."""
    return repr(value if len(value) <= limit else value[:limit] + "...")
