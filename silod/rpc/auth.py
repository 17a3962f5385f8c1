"""The client side of silod's shared-bearer-token authentication (the server side checks it in
services/runtime/auth.py)."""

from __future__ import annotations

AUTHORIZATION_KEY = "authorization"
BEARER_PREFIX = "Bearer "


def bearer_metadata(token: str) -> tuple[str, str]:
    return (AUTHORIZATION_KEY, f"{BEARER_PREFIX}{token}")
