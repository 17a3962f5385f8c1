"""Page sizes and opaque page tokens.

A token is URL-safe base64 of a small JSON document naming the listing it belongs to and the
position after which the next page starts (the last key returned). Clients must not parse it;
the server rejects anything it did not produce, naming "page_token".
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from services.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class PageBounds:
    default: int
    maximum: int

    def size(self, requested: int, field: str = "page_size") -> int:
        """0 means the default; anything outside 1..maximum is an error, not silently clamped."""
        if requested == 0:
            return self.default
        if not 1 <= requested <= self.maximum:
            raise InvalidArgument(f"must be in 1..{self.maximum} (0 = {self.default}), got {requested}", field=field)
        return requested


# Bounds documented in metadata.proto.
DATASETS = PageBounds(default=100, maximum=1000)
DATASET_OBJECTS = PageBounds(default=1000, maximum=10000)
JOBS = PageBounds(default=100, maximum=1000)
PLANS = PageBounds(default=20, maximum=100)
JOB_EVENTS = PageBounds(default=1000, maximum=1000)
METRICS = PageBounds(default=1000, maximum=10000)


def encode_token(listing: str, *position: int | str) -> str:
    document = json.dumps({"l": listing, "p": list(position)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(document.encode()).decode().rstrip("=")


def decode_token(token: str, listing: str, *types: type) -> tuple[Any, ...]:
    """The position stored in ``token``, checked to be ``types``; empty token -> empty tuple."""
    if not token:
        return ()
    try:
        padded = token + "=" * (-len(token) % 4)
        document = json.loads(base64.b64decode(padded, altchars=b"-_", validate=True))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgument("malformed token; pass back next_page_token unchanged", field="page_token") from None
    position = document.get("p") if isinstance(document, dict) else None
    if (
        not isinstance(document, dict)
        or document.get("l") != listing
        or not isinstance(position, list)
        or len(position) != len(types)
        # bool is an int subclass; a real position never holds one.
        or not all(type(value) is expected for value, expected in zip(position, types))
        or not all(_storable(value) for value in position)
    ):
        raise InvalidArgument("token does not belong to this listing", field="page_token")
    return tuple(position)


def _storable(value: int | str) -> bool:
    """A forged token must not be able to overflow a BIGINT or smuggle NUL into a query."""
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    return "\x00" not in value
