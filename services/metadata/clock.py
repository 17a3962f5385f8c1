"""UTC time in one place, so every stored and returned timestamp is timezone-aware UTC."""

from __future__ import annotations

from datetime import datetime, timezone

from google.protobuf import timestamp_pb2


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def as_utc(value: datetime) -> datetime:
    """SQLite hands datetimes back without tzinfo; every stored value was UTC, so say so."""
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def to_timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    """None stays None so that callers leave the message field unset."""
    if value is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(as_utc(value))
    return stamp


def from_timestamp(stamp: timestamp_pb2.Timestamp) -> datetime:
    """Microsecond precision: what both databases keep."""
    return stamp.ToDatetime(tzinfo=timezone.utc)
