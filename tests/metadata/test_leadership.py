"""Scheduler leadership lease (store/leadership.py) and CommitPlan's epoch fencing, on both databases."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.metadata.store import MetadataStore
from services.runtime.errors import FailedPrecondition, InvalidArgument
from silod.v1 import metadata_pb2
from tests.metadata.metadata_samples import plan


def test_first_acquire_wins_epoch_1_and_renewal_keeps_it(store: MetadataStore) -> None:
    assert store.leadership.get().epoch == 0
    a = store.leadership.acquire("a", "host-a:1", 5.0)
    assert (a.held, a.epoch, a.holder, a.address) == (True, 1, "a", "host-a:1")
    b = store.leadership.acquire("b", "host-b:1", 5.0)
    assert (b.held, b.epoch, b.holder, b.address) == (False, 1, "a", "host-a:1")
    renewed = store.leadership.acquire("a", "host-a:1", 5.0)
    assert renewed.held and renewed.epoch == 1 and renewed.expires_at.ToDatetime() >= a.expires_at.ToDatetime()
    assert store.leadership.get().holder == "a"


def test_takeover_after_expiry_increments_the_epoch(store: MetadataStore) -> None:
    assert store.leadership.acquire("a", "host-a:1", 0.5).epoch == 1
    time.sleep(0.6)
    b = store.leadership.acquire("b", "host-b:1", 5.0)
    assert (b.held, b.epoch, b.holder) == (True, 2, "b")
    late = store.leadership.acquire("a", "host-a:1", 5.0)  # the deposed holder cannot renew
    assert (late.held, late.epoch, late.holder) == (False, 2, "b")


def test_concurrent_takeover_has_one_winner(store: MetadataStore) -> None:
    store.leadership.acquire("old", "x:1", 0.5)
    time.sleep(0.6)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda h: store.leadership.acquire(h, f"{h}:1", 5.0), ["a", "b", "c", "d"]))
    winners = [r for r in replies if r.held]
    assert len(winners) == 1 and winners[0].epoch == 2
    assert {r.holder for r in replies} == {winners[0].holder}


def test_bad_requests_are_refused(store: MetadataStore) -> None:
    with pytest.raises(InvalidArgument):
        store.leadership.acquire("", "x:1", 5.0)
    with pytest.raises(InvalidArgument):
        store.leadership.acquire("a", "x:1", 0.0)


def test_commit_from_an_older_epoch_is_refused(store: MetadataStore) -> None:
    store.plans.commit(plan(1))  # no lease yet: epoch 0 commits (one scheduler, no election)
    store.leadership.acquire("a", "a:1", 0.5)
    store.plans.commit(plan(2, epoch=1))
    time.sleep(0.6)
    assert store.leadership.acquire("b", "b:1", 5.0).epoch == 2
    with pytest.raises(FailedPrecondition, match="epoch 1 is older"):
        store.plans.commit(plan(3, epoch=1))  # the deposed leader
    with pytest.raises(FailedPrecondition):
        store.plans.commit(plan(3))  # nor a scheduler without election, once a lease exists
    committed = store.plans.commit(plan(3, epoch=2))
    assert committed.epoch == 2 and store.plans.latest().epoch == 2


def test_rpcs(stub, db_url: str) -> None:  # type: ignore[no-untyped-def]
    if db_url.startswith("sqlite"):  # one metadata service on one file: no standby scheduler
        with pytest.raises(grpc.RpcError) as refused:
            stub.AcquireLeadership(metadata_pb2.AcquireLeadershipRequest(holder="a", address="a:1", ttl_s=5))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "needs the metadata store on PostgreSQL" in refused.value.details()
        assert stub.GetLeadership(metadata_pb2.GetLeadershipRequest()).epoch == 0
        return
    reply = stub.AcquireLeadership(metadata_pb2.AcquireLeadershipRequest(holder="a", address="a:1", ttl_s=5))
    assert reply.held and reply.epoch == 1
    assert stub.GetLeadership(metadata_pb2.GetLeadershipRequest()).address == "a:1"
    with pytest.raises(grpc.RpcError) as exc:
        stub.AcquireLeadership(metadata_pb2.AcquireLeadershipRequest(holder="b", address="b:1", ttl_s=0))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
