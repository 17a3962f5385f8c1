"""Scheduler leadership: one lease (holder, address, epoch, expires_at), taken by compare-and-set.

Acquire by the holder renews it (the epoch stays); by another holder it succeeds only once the
lease has expired, and the epoch increments. Each call is one transaction holding the lease row
locked (PostgreSQL: SELECT ... FOR UPDATE; SQLite: the database's single writer), so two
schedulers can never both win one epoch. ``epoch_now`` is what CommitPlan fences on.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from silod.v1 import metadata_pb2

from services.metadata.clock import as_utc, to_timestamp, utc_now
from services.metadata.database import Database
from services.metadata.models import SchedulerLease
from services.runtime.errors import InvalidArgument

LEASE = "scheduler"
MIN_TTL_S, MAX_TTL_S = 0.5, 300.0


def epoch_now(session: Session, *, lock: bool = False) -> int:
    """The lease's epoch (0 = never held); ``lock`` holds the row against a takeover until the
    transaction ends (a commit fenced on it cannot interleave with an acquire)."""
    query = select(SchedulerLease.epoch).where(SchedulerLease.name == LEASE)
    if lock:
        query = query.with_for_update(read=True)
    return session.scalar(query) or 0


class LeadershipStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def acquire(self, holder: str, address: str, ttl_s: float) -> metadata_pb2.Leadership:
        if not holder or len(holder) > 128:
            raise InvalidArgument("must be 1..128 characters", field="holder")
        if len(address) > 256:
            raise InvalidArgument("must be at most 256 characters", field="address")
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise InvalidArgument(f"must be in {MIN_TTL_S}..{MAX_TTL_S} seconds", field="ttl_s")
        try:
            return self._acquire(holder, address, ttl_s)
        except IntegrityError:  # two first acquirers raced to insert the row: the loser reads it
            return self._acquire(holder, address, ttl_s)

    def _acquire(self, holder: str, address: str, ttl_s: float) -> metadata_pb2.Leadership:
        with self._db.write() as session:
            now = utc_now()
            row = session.scalar(select(SchedulerLease).where(SchedulerLease.name == LEASE).with_for_update())
            if row is None:
                row = SchedulerLease(name=LEASE, holder=holder, address=address, epoch=1,
                                     expires_at=now + timedelta(seconds=ttl_s))
                session.add(row)
                session.flush()
                return _proto(row, held=True)
            if row.holder == holder and as_utc(row.expires_at) > now:  # renewal: same epoch
                row.address, row.expires_at = address, now + timedelta(seconds=ttl_s)
                return _proto(row, held=True)
            if as_utc(row.expires_at) <= now:  # expired (ours or another's): a new epoch
                row.holder, row.address, row.epoch = holder, address, row.epoch + 1
                row.expires_at = now + timedelta(seconds=ttl_s)
                return _proto(row, held=True)
            return _proto(row, held=False)

    def get(self) -> metadata_pb2.Leadership:
        with self._db.read() as session:
            row = session.get(SchedulerLease, LEASE)
            return _proto(row, held=False) if row is not None else metadata_pb2.Leadership()


def _proto(row: SchedulerLease, *, held: bool) -> metadata_pb2.Leadership:
    return metadata_pb2.Leadership(holder=row.holder, address=row.address, epoch=row.epoch,
                                   expires_at=to_timestamp(as_utc(row.expires_at)), held=held)


__all__ = ["LeadershipStore", "epoch_now"]
