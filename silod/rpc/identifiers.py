"""The identifier rules: what a job id, a dataset or node name, a tenant, a replica or lease id
may look like. One module, used wherever an identifier enters silod: every service checks the
identifier fields of every request against it before a servicer runs (services/runtime), the
metadata store checks them again before they reach the database, and the CLI checks its
arguments before it calls anything. docs/api.md "Identifiers" is rendered from :data:`RULES`.

An identifier is 1..N characters of ``A-Z a-z 0-9 . _ -`` that does not start with ``.`` or
``-``: it can be a file name on every file system silod writes to (no separator, no ``..``,
no hidden file, no option-like word), a URL path segment and a database key, in any locale.
Only grpcio/protobuf-free Python here: the client install uses it too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache
from operator import attrgetter
from typing import Any

_BODY = "A-Za-z0-9._"  # and "-", written last in a character class


@dataclass(frozen=True)
class Rule:
    kind: str  # "job id", "dataset name", ...
    max_chars: int
    extra: str = ""  # characters allowed beyond A-Za-z0-9._-
    examples: str = ""

    @cached_property  # every identifier of every request is matched: a 5,000-job plan has 10,000
    def pattern(self) -> re.Pattern[str]:
        return _pattern(self.max_chars, self.extra)

    @property
    def description(self) -> str:
        extra = " " + " ".join(self.extra) if self.extra else ""
        return f"1..{self.max_chars} characters of A-Z a-z 0-9 . _ -{extra}, not starting with . or -"

    def problem(self, value: str) -> str | None:
        """Why ``value`` is not a valid identifier of this kind, or None if it is."""
        if self.pattern.fullmatch(value):
            return None
        if not value:
            return f"must not be empty (a {self.kind}: {self.description})"
        if len(value) > self.max_chars:
            return f"a {self.kind} has at most {self.max_chars} characters, got {len(value)}"
        allowed = re.compile(f"[{_BODY}{re.escape(self.extra)}-]")
        bad = next((ch for ch in value if not allowed.fullmatch(ch)), None)
        if bad is not None:
            return f"a {self.kind} may not contain {bad!r} ({self.description}), got {show(value)}"
        return f"a {self.kind} must not start with {value[0]!r} ({self.description}), got {show(value)}"


@lru_cache(maxsize=None)
def _pattern(max_chars: int, extra: str) -> re.Pattern[str]:
    return re.compile(f"[A-Za-z0-9_{re.escape(extra)}][{_BODY}{re.escape(extra)}-]{{0,{max_chars - 1}}}")


JOB_ID = Rule("job id", 64, examples="job-3f9c2a1b7d4e (made by the metadata service)")
DATASET_NAME = Rule("dataset name", 128, examples="imagenet-train, librispeech.v2")
NODE_NAME = Rule("node name", 128, examples="node-0, gpu-host-17.rack3")
TENANT = Rule("tenant", 128, examples="default, team-vision")
# "<application>#<n>" (scheduler/deepboot/replicas.py makes them from the application's name).
REPLICA_ID = Rule("replica id", 160, extra="#", examples="resnet50#3")
LEASE_ID = Rule("lease id", 192, examples="node-0-1f-9a3c01be (made by the cache server)")

RULES = (JOB_ID, DATASET_NAME, NODE_NAME, TENANT, REPLICA_ID, LEASE_ID)

# Request fields that carry an identifier, by field name (any message), and for the fields
# named just "name", by message. A new RPC whose fields follow these names is checked
# without further ado; tests/runtime checks that every such field of every request is listed.
BY_FIELD: dict[str, Rule] = {
    "job_id": JOB_ID,
    "task_id": JOB_ID,  # an inference replica's serving job
    "released_jobs": JOB_ID,
    "dataset": DATASET_NAME,
    "node": NODE_NAME,
    "tenant": TENANT,
    "replica_id": REPLICA_ID,
    "lease_id": LEASE_ID,
}
BY_MESSAGE_FIELD: dict[tuple[str, str], Rule] = {
    ("silod.v1.DatasetSpec", "name"): DATASET_NAME,
    ("silod.v1.GetDatasetRequest", "name"): DATASET_NAME,
    ("silod.v1.ListDatasetObjectsRequest", "name"): DATASET_NAME,
    ("silod.v1.NodeSpec", "name"): NODE_NAME,
}


def show(value: str, limit: int = 40) -> str:
    """A client string quoted for a message, without echoing kilobytes back."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def rule_for(message_name: str, field_name: str) -> Rule | None:
    return BY_MESSAGE_FIELD.get((message_name, field_name)) or BY_FIELD.get(field_name)


def problem(rule: Rule, value: str, *, required: bool = True) -> str | None:
    """Like :meth:`Rule.problem`; an empty value passes unless ``required``."""
    if not value and not required:
        return None
    return rule.problem(value)


# --- checking whole protobuf messages -------------------------------------------------------


@lru_cache(maxsize=None)
def _plan(descriptor: Any) -> tuple[tuple[Any, Rule | None], ...]:
    """The fields of ``descriptor`` to visit: (field, rule) for identifier strings, (field, None)
    for message fields that (transitively) hold one. Computed once per message type."""
    return _plan_of(descriptor, frozenset())


def _plan_of(descriptor: Any, visiting: frozenset[str]) -> tuple[tuple[Any, Rule | None], ...]:
    steps: list[tuple[Any, Rule | None]] = []
    for field in descriptor.fields:
        if field.type == field.TYPE_STRING:
            rule = rule_for(descriptor.full_name, field.name)
            if rule is not None:
                steps.append((field, rule))
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            inner = field.message_type
            if inner.full_name not in visiting and _plan_of(inner, visiting | {descriptor.full_name}):
                steps.append((field, None))
    return tuple(steps)


def message_problems(message: Any, path: str = "", limit: int = 50) -> Iterator[tuple[str, str]]:
    """(field path, problem) for every malformed identifier in ``message`` (empty ones pass:
    whether a field is required is the method's business), at most ``limit`` of them."""
    seen: dict[tuple[int, str], str | None] = {}  # a large batch repeats the same few ids
    count = 0
    for found in _walk(message, (path,) if path else (), seen):
        yield found
        count += 1
        if count >= limit:
            return


# A path is a tuple of field names and indices, spelt out only for a problem: a plan of 5,000
# entries has 15,000 places to look and, as a rule, nothing to report.
Path = tuple[Any, ...]


def _spell(path: Path) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _walk(message: Any, path: Path, seen: dict[tuple[int, str], str | None]) -> Iterator[tuple[str, str]]:
    for field, rule in _plan(message.DESCRIPTOR):
        name = field.name
        if rule is not None:
            if field.is_repeated:
                yield from _column(list(getattr(message, name)), rule, (*path, name, None), seen)
            else:
                value = getattr(message, name)
                if value:
                    key = (id(rule), value)
                    problem = seen[key] if key in seen else seen.setdefault(key, rule.problem(value))
                    if problem is not None:
                        yield _spell((*path, name)), problem
        elif field.is_repeated:
            items = getattr(message, name)
            inner = _plan(field.message_type)
            if all(r is not None for _, r in inner):
                # A batch of flat messages (Predict's queries): by column, each distinct value once.
                for leaf, leaf_rule in inner:
                    if leaf.is_repeated:
                        for index, item in enumerate(items):
                            yield from _column(list(getattr(item, leaf.name)), leaf_rule,
                                               (*path, name, index, leaf.name, None), seen)
                    else:
                        yield from _column(list(map(attrgetter(leaf.name), items)), leaf_rule,
                                           (*path, name, None, leaf.name), seen)
            else:
                for index, item in enumerate(items):
                    yield from _walk(item, (*path, name, index), seen)
        elif message.HasField(name):
            yield from _walk(getattr(message, name), (*path, name), seen)


def _column(values: list[str], rule: Rule, path: Path, seen: dict[tuple[int, str], str | None]) -> Iterator[tuple[str, str]]:
    """Problems of ``values`` (one field across a batch); ``path`` has None where the index goes."""
    bad = set()
    for value in set(values):
        if not value:
            continue
        key = (id(rule), value)
        if key not in seen:
            seen[key] = rule.problem(value)
        if seen[key] is not None:
            bad.add(value)
    if not bad:
        return
    for index, value in enumerate(values):
        if value in bad:
            yield _spell(tuple(index if part is None else part for part in path)), seen[(id(rule), value)]  # type: ignore[misc]
