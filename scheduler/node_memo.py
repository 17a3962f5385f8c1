"""What is worked out from a snapshot's node tuple, once per tuple: the live scheduler hands the
same tuple round after round while no node changes (5,000 nodes), and the simulator while its
cluster stands, so a mapping or a flag over every node is made once, not per call.

An entry holds its tuple, so the tuple's id stays its own while the entry is kept. Only tuples
are kept (a list could change in place). Read-only values: they are shared by every caller.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")
KEPT = 64  # entries, all kinds together (a tenant's slice of the nodes is a new tuple every call)

_LOCK = threading.Lock()
_MEMO: dict[tuple[int, Hashable], tuple[tuple, object]] = {}


def of_nodes(nodes: tuple, what: Hashable, compute: Callable[[tuple], T]) -> T:
    """``compute(nodes)``, made once per node tuple and ``what`` (which value of it)."""
    key = (id(nodes), what)
    found = _MEMO.get(key)
    if found is not None and found[0] is nodes:
        return found[1]  # type: ignore[return-value]
    value = compute(nodes)
    if type(nodes) is tuple:
        with _LOCK:
            if len(_MEMO) >= KEPT:
                _MEMO.pop(next(iter(_MEMO)))
            _MEMO[key] = (nodes, value)
    return value
