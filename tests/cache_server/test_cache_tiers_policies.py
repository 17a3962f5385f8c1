"""Tiers (atomic files, journal, re-index, verification), policies, the token bucket and the
fetch-cost model, without any service."""

from __future__ import annotations

import asyncio

import os
from pathlib import Path

import pytest

from cache_server.policies import FetchCostModel, LrfuCostPartition, LruPartition, UniformPartition
from cache_server.ratelimit import TokenBucket
from cache_server.tiers import Entry, Tier, TierLocked, entry_name


def _put(tier: Tier, key: str, data: bytes, dataset: str = "ds") -> Entry:
    name = f"{entry_name(dataset, key, 'e1')}.x"
    digest, mtime = tier.write(name, data)
    entry = Entry(dataset, key, "e1", len(data), tier, name, digest, mtime)
    tier.journal_put(entry)
    tier.used += len(data)
    return entry


def test_tier_reindexes_and_verifies_after_restart(tmp_path: Path) -> None:
    tier = Tier("disk", str(tmp_path / "t"), 1 << 20)
    assert tier.open() == []
    a = _put(tier, "a", b"A" * 100)
    b = _put(tier, "b", b"B" * 100)
    c = _put(tier, "c", b"C" * 100)
    d = _put(tier, "d", b"D" * 100)
    tier.journal_del(d)
    os.unlink(d.path)
    with pytest.raises(TierLocked):  # a second server on the same directory
        Tier("disk", str(tmp_path / "t"), 1 << 20).open()
    tier.close()

    # While stopped: b's bytes flipped in place (size and mtime restored: only the checksum
    # can tell), c truncated, an orphan file and a half-written temp file appear.
    st = os.stat(b.path)
    with open(b.path, "r+b") as f:
        f.seek(10)
        f.write(b"X")
    os.utime(b.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    Path(c.path).write_bytes(b"C" * 50)
    orphan = Path(tier.path_of("ff" + "0" * 38 + ".y"))
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"orphan")
    (tmp_path / "t" / "tmp" / "half").write_bytes(b"half")

    again = Tier("disk", str(tmp_path / "t"), 1 << 20)
    entries = {e.key: e for e in again.open()}
    assert sorted(entries) == ["a", "b"]  # c (size changed) and d (deleted) dropped
    assert not orphan.exists() and not (tmp_path / "t" / "tmp" / "half").exists()
    assert again.used == 200
    assert all(not e.verified for e in entries.values())
    assert again.verify(entries["a"]) is True
    assert again.verify(entries["b"]) is False  # the flipped byte is caught by the sha256
    again.close()


def test_tier_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = Tier("disk", str(tmp_path / "t"), 1 << 20)
    tier.open()
    name = f"{entry_name('ds', 'k', 'e')}.z"

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError):
        tier.write(name, b"data")
    assert not os.path.exists(tier.path_of(name))
    assert os.listdir(tmp_path / "t" / "tmp") == []
    tier.close()


class _T:
    name = "disk"

    def path_of(self, name: str) -> str:
        return "/nonexistent/" + name


def _entry(key: str, size: int = 10) -> Entry:
    return Entry("ds", key, "e", size, _T(), key, "", 0)  # type: ignore[arg-type]


def test_uniform_admits_until_full_and_never_evicts() -> None:
    part = UniformPartition("job", 30)
    for key in "abc":
        assert part.plan_admission(10, 1.0, 0.0) == []
        part.add(_entry(key), 0.0)
    assert part.plan_admission(10, 1.0, 0.0) is None
    part.capacity = 15  # a new plan cuts the quota: the newest objects go first
    assert [e.key for e in part.shrink_victims()] == ["c", "b"]


def test_lru_evicts_least_recently_used_but_never_pinned() -> None:
    part = LruPartition("job", 30)
    entries = {k: _entry(k) for k in "abc"}
    for e in entries.values():
        part.add(e, 0.0)
    part.on_hit(entries["a"], 1.0)
    assert [e.key for e in part.plan_admission(10, 1.0, 2.0)] == ["b"]
    entries["b"].pins = 1
    assert [e.key for e in part.plan_admission(20, 1.0, 2.0)] == ["c", "a"]
    entries["c"].pins = entries["a"].pins = 1
    assert part.plan_admission(10, 1.0, 2.0) is None  # everything pinned
    assert part.plan_admission(40, 1.0, 2.0) is None  # bigger than the partition


def test_lrfu_cost_keeps_frequent_and_expensive_objects() -> None:
    part = LrfuCostPartition("job", 30, half_life_s=100.0)
    cheap, dear, hot = _entry("cheap"), _entry("dear"), _entry("hot")
    cheap.cost_s, dear.cost_s, hot.cost_s = 0.001, 0.1, 0.001
    for e in (cheap, dear, hot):
        part.add(e, 0.0)
    for t in range(1, 200):  # hot is read a lot: its frequency outweighs its low cost
        part.on_hit(hot, float(t) / 100)
    victims = part.plan_admission(10, 0.01, 2.0)
    assert [e.key for e in victims] == ["cheap"]
    part.remove(cheap)
    newcomer = _entry("new")
    newcomer.cost_s = 0.01
    part.add(newcomer, 2.0)
    # A newcomer cheaper than everything cached is not admitted at their expense ...
    assert part.plan_admission(10, 0.0001, 2.0) is None
    # ... until the old objects' scores have decayed (freshness): then it displaces the lowest.
    assert [e.key for e in part.plan_admission(10, 0.0001, 1000.0)] == ["new"]


def test_token_bucket_paces_to_the_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(1000.0, burst_s=0.05, clock=lambda: now[0])
    waits = [bucket.reserve(100) for _ in range(20)]  # 2000 bytes at 1000 B/s
    assert waits[0] == 0.0
    assert waits[-1] == pytest.approx(1.9, abs=1e-9)  # 19 * 0.1 s: a new bucket starts without burst credit
    now[0] = 100.0  # idle for long: the burst does not accumulate beyond burst_s
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(100) == pytest.approx(0.05)


def test_token_bucket_books_a_background_transfer_only_when_idle() -> None:
    """A background (prefetch) transfer waits until nothing is booked beyond now, and waits again
    if a reader booked meanwhile: the reader is never queued behind it."""
    async def scenario() -> list[tuple[str, float]]:
        bucket = TokenBucket(1000.0, burst_s=0.0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        done: list[tuple[str, float]] = []

        async def transfer(name: str, background: bool) -> None:
            await (bucket.acquire_when_idle(100) if background else bucket.acquire(100))
            done.append((name, loop.time() - start))

        bucket.reserve(100)  # a read in transfer until 0.1 s
        prefetch = asyncio.ensure_future(transfer("prefetch", True))
        await asyncio.sleep(0.05)
        read = asyncio.ensure_future(transfer("read", False))  # booked 0.1-0.2 s, ahead of the prefetch
        await asyncio.gather(prefetch, read)
        return done

    done = asyncio.run(scenario())
    assert [name for name, _ in done] == ["read", "prefetch"]
    assert done[0][1] < done[1][1] and done[1][1] >= 0.2 - 1e-3  # after the read's 100 bytes, never sooner


def test_fetch_cost_model_separates_latency_and_bandwidth() -> None:
    model = FetchCostModel()
    for i in range(64):
        size = 10_000 * (1 + i % 8)
        model.observe(size, 0.02 + size / 50e6)
    assert model.latency == pytest.approx(0.02, rel=1e-3)
    assert model.bandwidth == pytest.approx(50e6, rel=1e-3)
    assert model.cost(100_000) == pytest.approx(0.022, rel=1e-3)


def test_fetch_cost_model_follows_the_store_once_its_window_is_full() -> None:
    model = FetchCostModel(window=64)
    fits = 0
    real_fit = model._fit

    def counting_fit() -> None:
        nonlocal fits
        fits += 1
        real_fit()

    model._fit = counting_fit  # type: ignore[method-assign]
    for i in range(640):  # ten windows of a 50 MB/s store ...
        size = 10_000 * (1 + i % 8)
        model.observe(size, 0.02 + size / 50e6)
    assert fits <= 15 + 640 // 16  # refitted every 16th fetch, not on every fetch of a full window
    for i in range(64):  # ... then the store slows to 10 MB/s: one window later the model says so
        size = 10_000 * (1 + i % 8)
        model.observe(size, 0.02 + size / 10e6)
    assert model.bandwidth == pytest.approx(10e6, rel=1e-3)


def test_journal_lines_reach_the_file_without_a_close(tmp_path: Path) -> None:
    tier = Tier("memory", str(tmp_path / "m"), 1 << 20, fsync=False)
    tier.open()
    entries = [_put(tier, f"k{i}", bytes([i]) * 10) for i in range(5)]
    tier.flush_journal()  # the cache core does this every second; a crash loses at most that much
    on_disk = (tmp_path / "m" / "journal.jsonl").read_text()
    assert all(e.name in on_disk for e in entries)
    tier.close()
