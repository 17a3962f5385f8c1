"""``EpochShuffleSampler``: a fresh random order every epoch (what the SiloD model assumes),
optionally sharded across ranks, that tells the cache server what comes next."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.utils.data


class HintedIndex(int):
    """An index that carries the positions the job will read next (a prefetch hint). It pickles
    with its hint, so the hint reaches the DataLoader worker that reads the index."""

    prefetch_hint: list[int]

    def __new__(cls, value: int, hint: list[int]) -> HintedIndex:
        obj = super().__new__(cls, value)
        obj.prefetch_hint = hint
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (HintedIndex, (int(self), self.prefetch_hint))


class EpochShuffleSampler(torch.utils.data.Sampler[int]):
    """Yields a permutation of the dataset's indices, seeded by ``(seed, epoch)``.

    Call :meth:`set_epoch` before each epoch (as with DistributedSampler). With
    ``num_replicas``/``rank`` each rank gets every ``num_replicas``-th index of the same
    permutation (padded by wrapping around unless ``drop_last``).

    When the dataset reads through a cache server (a :class:`SilodDataset` with a cache
    address) the sampler hints what comes next: every ``prefetch_ahead`` indices, one index is
    a :class:`HintedIndex` carrying the following ``prefetch_ahead`` positions (the first one
    carries two chunks); the process that reads that index sends them with its batch's Lease
    call. The server fetches them in the background no faster than the job consumes
    (docs/cache.md, best-effort mode).
    """

    def __init__(
        self,
        dataset: Any,
        seed: int = 0,
        epoch: int = 0,
        *,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        prefetch: bool = True,
        prefetch_ahead: int = 1024,
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas), got rank={rank}, num_replicas={num_replicas}")
        if prefetch_ahead < 1:
            raise ValueError(f"prefetch_ahead must be >= 1, got {prefetch_ahead}")
        self.dataset = dataset
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.prefetch_ahead = prefetch_ahead

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _total(self) -> int:
        n = len(self.dataset)
        if self.drop_last:
            return (n // self.num_replicas) * self.num_replicas
        return -(-n // self.num_replicas) * self.num_replicas

    def __len__(self) -> int:
        return self._total() // self.num_replicas

    def order(self) -> np.ndarray:
        """This rank's indices for the current epoch."""
        n = len(self.dataset)
        if self.shuffle:
            indices = np.random.default_rng([self.seed, self.epoch]).permutation(n)
        else:
            indices = np.arange(n)
        total = self._total()
        if total > n:
            indices = np.concatenate([indices, indices[: total - n]])
        else:
            indices = indices[:total]
        return indices[self.rank : total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        hinting = self.prefetch and getattr(self.dataset, "cache_addr", "") != ""
        hinting = hinting and hasattr(self.dataset, "prefetch_hint")
        ahead = self.prefetch_ahead
        for i, index in enumerate(order):
            if hinting and i % ahead == 0:
                start = i if i == 0 else i + ahead
                hint = order[start : i + 2 * ahead].tolist()
                if hint:
                    yield HintedIndex(int(index), hint)
                    continue
            yield int(index)
