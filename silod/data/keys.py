"""Object keys: what a key may look like, so that no reader can name a path outside its dataset."""

from __future__ import annotations

MAX_KEY_BYTES = 1024  # the S3 limit


class BadKey(ValueError):
    """A key that can never name an object of a dataset; the message says why (without the field)."""


def key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid object key, or None if it is.

    Keys are relative paths below the dataset root: not empty, no NUL, not absolute, no ``..``
    component. (Containment after symlinks is checked where a file is opened: see store.py.)
    """
    if not key:
        return "must not be empty"
    if "\x00" in key:
        return "must not contain NUL"
    if key.startswith(("/", "\\")):
        return f"must be relative to the dataset root, got absolute {key!r}"
    if ".." in key and ".." in key.replace("\\", "/").split("/"):
        return f"must not contain a '..' component, got {key!r}"
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"must be at most {MAX_KEY_BYTES} bytes"
    return None


def check_key(key: str) -> str:
    problem = key_problem(key)
    if problem is not None:
        raise BadKey(problem)
    return key
