"""``ElasticSampler``: one global order per epoch, split over however many ranks there are now.

The order of an epoch is a permutation seeded by ``(seed, epoch)``, the same whatever the world
size. The sampler's only state is how many samples of that order the whole job has consumed
(``consumed``). A step takes the next ``batch_size`` positions of the order; rank ``r`` of a
world of ``W`` reads positions ``consumed + r``, ``consumed + r + W``, ... of them. A resize or a
restart changes ``W`` (and maybe the batch size), never the order or ``consumed``, so every
sample of an epoch is read exactly once, whatever sequence of world sizes the epoch saw. The
state goes in the checkpoint (``state_dict``); DistributedTraining broadcasts it to newcomers.

It is a *batch* sampler (``DataLoader(dataset, batch_sampler=sampler)``): each item is this
rank's share of one global step, possibly empty at the end of an epoch when the last step has
fewer samples than ranks (the rank still takes part in the step: see ``step_size``). The
training loop calls :meth:`advance` after each optimizer step; an iterator started before a
resize is thrown away, and a new one starts at ``consumed``.

When the dataset reads through a cache server, indices carry prefetch hints of this rank's
next positions (``HintedIndex``), as :class:`~silod.data.sampler.EpochShuffleSampler` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.utils.data

from silod.data.sampler import HintedIndex


class ElasticSampler(torch.utils.data.Sampler[list[int]]):
    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        prefetch: bool = True,
        prefetch_ahead: int = 1024,
    ) -> None:
        self.dataset = dataset
        self.num_samples = len(dataset)
        if self.num_samples < 1:
            raise ValueError("the dataset is empty")
        self.seed = int(seed)
        self.epoch = int(epoch)
        self.consumed = 0  # samples of this epoch's order the whole job has trained on
        self.shuffle = shuffle
        self.prefetch = prefetch
        self.prefetch_ahead = max(1, int(prefetch_ahead))
        self.rank, self.world_size, self.batch_size = 0, 1, 1
        self.resize(rank, world_size, batch_size)

    # -- the world
    def resize(self, rank: int, world_size: int, batch_size: int | None = None) -> None:
        """This process's place in a (re-formed) world, and the global batch size from now on."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if batch_size is not None:
            if batch_size < 1:
                raise ValueError(f"batch_size must be >= 1, got {batch_size}")
            self.batch_size = int(batch_size)
        self.rank, self.world_size = int(rank), int(world_size)

    # -- the order
    def order(self, epoch: int | None = None) -> np.ndarray:
        """The global order of ``epoch`` (default: the current one): independent of the world."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def step_size(self) -> int:
        """Global samples of the next step: the batch size, or what is left of the epoch."""
        return min(self.batch_size, self.num_samples - self.consumed)

    def local_indices(self, start: int, order: np.ndarray | None = None) -> list[int]:
        """This rank's share of the step that starts at position ``start`` of the order."""
        order = self.order() if order is None else order
        end = min(start + self.batch_size, self.num_samples)
        return [int(i) for i in order[start + self.rank:end:self.world_size]]

    def __len__(self) -> int:
        """Steps left in this epoch."""
        return -(-(self.num_samples - self.consumed) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        hinting = self.prefetch and getattr(self.dataset, "cache_addr", "") != "" and hasattr(self.dataset, "prefetch_hint")
        mine = order[self.consumed + self.rank::self.world_size] if hinting else None
        yielded = 0
        for start in range(self.consumed, self.num_samples, self.batch_size):
            batch: list[int] = self.local_indices(start, order)
            if hinting and batch:
                assert mine is not None
                # Every prefetch_ahead of this rank's positions, one index carries the next ones.
                before, after = yielded, yielded + len(batch)
                mark = -(-before // self.prefetch_ahead) * self.prefetch_ahead
                if mark < after:
                    first = mark == 0
                    hint = mine[mark if first else mark + self.prefetch_ahead:mark + 2 * self.prefetch_ahead].tolist()
                    if hint:
                        batch[mark - before] = HintedIndex(batch[mark - before], hint)
                yielded = after
            yield batch

    # -- progress
    def advance(self, samples: int | None = None) -> None:
        """The job trained on the next ``samples`` (default: one step) of the order; at the end
        of the order the next epoch starts."""
        samples = self.step_size() if samples is None else int(samples)
        if samples < 0 or self.consumed + samples > self.num_samples:
            raise ValueError(f"cannot advance by {samples}: {self.num_samples - self.consumed} samples left in the epoch")
        self.consumed += samples
        if self.consumed == self.num_samples:
            self.epoch += 1
            self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(f"the checkpoint's sampler covered {state['num_samples']} samples, "
                             f"the dataset has {self.num_samples}")
        self.seed, self.epoch, self.consumed = int(state["seed"]), int(state["epoch"]), int(state["consumed"])
