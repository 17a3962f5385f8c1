"""silod's data API for training scripts: a PyTorch dataset and sampler over a registered dataset.

    from silod.data import SilodDataset, EpochShuffleSampler
    ds = SilodDataset("imagenet-mini", transform=decode)
    loader = DataLoader(ds, batch_size=256, sampler=EpochShuffleSampler(ds, seed=0), num_workers=4)

On a GPU, ``silod.data.loader(ds, ..., device=device)`` is that DataLoader with pinned host
memory, and ``silod.data.to_device(batch, device)`` moves a batch with asynchronous copies.

Reads go through the node's cache server (``SILOD_CACHE_ADDR``): one Lease call per batch,
then the cached files are read directly. Without a cache server (off-cluster) or when it is
down, the remote store is read directly. See docs/cache.md.

torch is imported only when :class:`SilodDataset` or :class:`EpochShuffleSampler` is used (a
clear ImportError says so when the job's environment lacks it):
``silod.data.store``, ``silod.data.keys`` and ``silod.data.catalog`` work without it (the cache
server uses them).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SilodDataset", "EpochShuffleSampler", "ElasticSampler", "loader", "to_device"]


def _require_torch(name: str) -> None:
    """PyTorch is the job's own dependency (its build must match the job's hardware), not silod's."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ImportError(
            f"silod.data.{name} is a PyTorch dataset/sampler and needs torch in the job's environment "
            "(pip install torch); silod does not install it"
        ) from None


def __getattr__(name: str) -> Any:
    if name in __all__:
        _require_torch(name)
    if name == "SilodDataset":
        from silod.data.dataset import SilodDataset

        return SilodDataset
    if name == "ElasticSampler":
        from silod.data.elastic import ElasticSampler

        return ElasticSampler
    if name == "EpochShuffleSampler":
        from silod.data.sampler import EpochShuffleSampler

        return EpochShuffleSampler
    if name in ("loader", "to_device"):
        from silod.data import batches

        return getattr(batches, name)
    raise AttributeError(f"module 'silod.data' has no attribute {name!r}")
