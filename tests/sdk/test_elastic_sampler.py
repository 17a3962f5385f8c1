"""ElasticSampler: whatever sequence of world sizes, batch sizes, restarts and resizes an epoch
sees, every sample of it is read exactly once, in an order that depends only on (seed, epoch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from silod.data.elastic import ElasticSampler
from silod.data.sampler import HintedIndex


class Items:
    def __init__(self, n: int, cache_addr: str = "") -> None:
        self.n, self.cache_addr = n, cache_addr

    def __len__(self) -> int:
        return self.n

    def prefetch_hint(self, positions) -> None:  # type: ignore[no-untyped-def]
        pass


# A segment: (world size, global batch size, steps to run, restart from a checkpoint before it).
segments = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 40), st.integers(1, 30), st.booleans()),
                    min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**31), plan=segments)
def test_every_sample_of_an_epoch_is_read_once_whatever_the_worlds(n: int, seed: int, plan) -> None:  # type: ignore[no-untyped-def]
    data = Items(n)
    ranks = [ElasticSampler(data, 1, seed=seed)]
    reads: dict[int, list[int]] = {}  # epoch -> positions read, in order
    for world, batch, steps, restart in plan:
        state = ranks[0].state_dict()
        # The new world: restarted processes load the checkpoint; survivors keep their object.
        ranks = [ranks[0] if r == 0 and not restart else ElasticSampler(data, batch, seed=seed)
                 for r in range(world)]
        for r, sampler in enumerate(ranks):
            sampler.load_state_dict(state)
            sampler.resize(r, world, batch)
        for _ in range(steps):
            epoch = ranks[0].epoch
            iterators = [iter(s) for s in ranks]  # a resize throws old iterators away
            shares = [next(it) for it in iterators]
            size = ranks[0].step_size()
            assert sum(len(s) for s in shares) == size
            # The step's samples, as the global order lists them: rank r has every W-th from r.
            merged = [shares[k % world][k // world] for k in range(size)]
            assert merged == ranks[0].order()[ranks[0].consumed:ranks[0].consumed + size].tolist()
            reads.setdefault(epoch, []).extend(merged)
            for sampler in ranks:
                sampler.advance(size)
            assert len({(s.epoch, s.consumed) for s in ranks}) == 1
    for epoch, positions in reads.items():
        assert len(positions) == len(set(positions)), "a sample read twice in one epoch"
        finished = epoch < ranks[0].epoch
        if finished:
            assert sorted(positions) == list(range(n)), "an epoch that ended skipped samples"
        assert positions == ranks[0].order(epoch)[:len(positions)].tolist()


def test_the_order_does_not_depend_on_the_world_and_changes_every_epoch() -> None:
    a = ElasticSampler(Items(50), 8, rank=0, world_size=1, seed=3)
    b = ElasticSampler(Items(50), 8, rank=2, world_size=4, seed=3)
    assert np.array_equal(a.order(), b.order())
    assert not np.array_equal(a.order(0), a.order(1))
    assert sorted(a.order(1).tolist()) == list(range(50))


def test_state_round_trips_and_refuses_another_dataset() -> None:
    s = ElasticSampler(Items(20), 6, seed=1)
    s.advance()
    s.advance()
    assert s.state_dict() == {"seed": 1, "epoch": 0, "consumed": 12, "num_samples": 20}
    assert (s.step_size(), len(s)) == (6, 2)
    s.advance()
    assert s.step_size() == 2
    s.advance()
    assert (s.epoch, s.consumed) == (1, 0)
    other = ElasticSampler(Items(21), 6)
    with pytest.raises(ValueError, match="21"):
        other.load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="rank"):
        s.resize(3, 3)
    with pytest.raises(ValueError, match="cannot advance"):
        s.advance(100)


def test_indices_carry_prefetch_hints_of_this_ranks_next_positions() -> None:
    data = Items(100, cache_addr="127.0.0.1:1")
    sampler = ElasticSampler(data, 10, rank=1, world_size=2, seed=0, prefetch_ahead=8)
    batches = list(sampler)
    mine = sampler.order()[1::2].tolist()
    flat = [i for b in batches for i in b]
    assert [int(i) for i in flat] == mine
    hinted = [(k, i.prefetch_hint) for k, i in enumerate(flat) if isinstance(i, HintedIndex)]
    assert hinted[0] == (0, mine[0:16])  # the first hint covers two chunks
    assert hinted[1] == (8, mine[16:24])  # later ones the chunk after the next
    assert [k for k, _ in hinted] == [0, 8, 16, 24, 32, 40]  # at 48 nothing is left to hint
    assert not any(isinstance(i, HintedIndex) for b in ElasticSampler(Items(100), 10) for i in b)
