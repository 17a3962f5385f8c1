"""Sharded datasets (silod.data.shards): WebDataset-style tar shards registered with
``--format tar-shards``, read sample by sample through the cache server and directly, from
``file://`` and from a real S3-protocol server (moto)."""

from __future__ import annotations

import io
import os
import random
import tarfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch.utils.data

from silod.data import EpochShuffleSampler, SilodDataset
from silod.data.dataset import DataError
from silod.data.shards import ShardError, decode_sample, index_tar, parse_sample_key
from silod.data.store import ObjectChanged, ObjectStore
from silod.v1 import cache_pb2
from tests.cache_server.harness import InProcessCache, moto_s3, quota, silod_cli


def make_shard(samples: dict[str, dict[str, bytes]], tar_format: int = tarfile.USTAR_FORMAT) -> bytes:
    """A tar shard as WebDataset writes it: each sample's members consecutive, named base.ext."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tar_format) as archive:
        for base, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{base}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def make_shards(count: int, per_shard: int, seed: int) -> dict[str, tuple[bytes, dict[str, dict[str, bytes]]]]:
    """shard key -> (tar bytes, samples); samples are an image-like blob and a label."""
    rng = random.Random(seed)
    shards = {}
    for s in range(count):
        samples = {f"s{s:02d}/{i:05d}": {"jpg": rng.randbytes(rng.randint(200, 3000)), "cls": str(i % 7).encode()}
                   for i in range(per_shard)}
        shards[f"train-{s:04d}.tar"] = (make_shard(samples), samples)
    return shards


def all_samples(shards: dict[str, tuple[bytes, dict[str, dict[str, bytes]]]]) -> dict[str, dict[str, bytes]]:
    return {base: members for _, samples in shards.values() for base, members in samples.items()}


def write_shards(root: Path, shards: dict[str, tuple[bytes, dict[str, dict[str, bytes]]]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for key, (data, _) in shards.items():
        (root / key).write_bytes(data)


def as_tuple(sample: dict[str, bytes]) -> tuple[str, bytes, bytes]:
    return sample["__key__"], sample["jpg"], sample["cls"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, metadata: str) -> tuple[Path, dict[str, dict[str, bytes]]]:
    root = tmp_path_factory.mktemp("shards")
    shards = make_shards(4, 60, seed=5)
    write_shards(root, shards)
    (root / "README.txt").write_text("not a shard: ignored by --format tar-shards")
    code, out = silod_cli("dataset", "register", "sharded", f"file://{root}", "--format", "tar-shards",
                          "--metadata", metadata)
    assert code == 0, out
    assert "240 objects" in out
    return root, all_samples(shards)


def test_index_finds_each_sample_and_its_bytes_form_a_small_tar() -> None:
    samples = {"a/0001": {"jpg": b"x" * 700, "cls": b"3"}, "a/0002": {"jpg": b"y" * 10, "json": b"{}"},
               "a/0003": {"png": b"z" * 513}}
    shard = make_shard(samples)
    ranges = index_tar(io.BytesIO(shard), "s/shard.tar")
    assert [r.sample for r in ranges] == list(samples)
    for r in ranges:
        assert parse_sample_key(r.key) == r
        sample = decode_sample(shard[r.offset : r.offset + r.length])
        assert sample == {"__key__": r.sample, **samples[r.sample]}
    assert ranges[0].offset == 0 and ranges[1].offset >= ranges[0].offset + ranges[0].length
    assert parse_sample_key("plain/object.jpg") is None
    with pytest.raises(ShardError, match="s/bad.tar"):
        index_tar(io.BytesIO(b"\x01" * 4096), "s/bad.tar")


def test_decode_reads_ustar_headers_itself_and_leaves_the_rest_to_tarfile() -> None:
    from silod.data.shards import _decode_ustar, _decode_with_tarfile

    plain = {"a/0001": {"jpg": b"x" * 700, "cls": b"3", "json": b""}}
    long_name = {"d/" + "n" * 120: {"jpg": b"y" * 1025}}  # > 100 bytes: a pax (or GNU) header
    for samples, fast, tar_format in ((plain, True, tarfile.USTAR_FORMAT), (long_name, False, tarfile.PAX_FORMAT)):
        shard = make_shard(samples, tar_format)
        (r,) = index_tar(io.BytesIO(shard), "s.tar")
        data = shard[r.offset : r.offset + r.length]
        assert (_decode_ustar(data) is not None) == fast
        assert decode_sample(data) == _decode_with_tarfile(data) == {"__key__": r.sample, **samples[r.sample]}
    # A damaged header is not guessed at: tarfile's verdict stands.
    shard = make_shard(plain)
    (r,) = index_tar(io.BytesIO(shard), "s.tar")
    data = bytearray(shard[r.offset : r.offset + r.length])
    data[130] ^= 1  # inside the size field: the checksum no longer matches
    assert _decode_ustar(bytes(data)) is None


def test_registration_indexes_the_shards_into_the_manifest(sharded: tuple[Path, dict], metadata: str) -> None:
    root, samples = sharded
    dataset = SilodDataset("sharded", cache_addr="", metadata_addr=metadata)
    assert len(dataset) == len(samples)
    ranges = [parse_sample_key(key) for key in dataset.keys]
    assert all(r is not None for r in ranges)
    assert [r.sample for r in ranges] == list(samples)  # shard order, then offset order
    assert dataset.manifest.sizes == [r.length for r in ranges]
    # Off-cluster: byte-range reads of the shard files, verified against the shard's version.
    assert as_tuple(decode_sample(dataset[17])) == (ranges[17].sample, *samples[ranges[17].sample].values())


def test_samples_read_through_the_cache_in_epoch_shuffle_order(
    sharded: tuple[Path, dict], tmp_path: Path, metadata: str
) -> None:
    _, samples = sharded
    with InProcessCache(tmp_path, metadata) as cache:
        dataset = SilodDataset("sharded", cache_addr=cache.address, metadata_addr=metadata, job_id="shard-job",
                               transform=decode_sample)
        sampler = EpochShuffleSampler(dataset, seed=3, prefetch_ahead=64)
        loader = torch.utils.data.DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=2,
                                             collate_fn=list, multiprocessing_context="fork")
        for epoch in range(2):
            sampler.set_epoch(epoch)
            seen = Counter(as_tuple(s) for batch in loader for s in batch)
            assert seen == Counter((base, m["jpg"], m["cls"]) for base, m in samples.items())
        job = cache.stats("shard-job").jobs[0]
        total = sum(dataset.manifest.sizes)
        # Every sample fetched from the store once (ranged reads of its bytes, plus the tar
        # padding between samples read together), the second epoch served from the tiers.
        assert total <= job.remote_bytes <= total + 512 * len(samples)
        assert job.hits >= len(samples)


def test_prefetch_reads_adjacent_samples_of_a_shard_in_one_request(
    sharded: tuple[Path, dict], tmp_path: Path, metadata: str
) -> None:
    dataset = SilodDataset("sharded", cache_addr="", metadata_addr=metadata)
    with InProcessCache(tmp_path, metadata) as cache:
        fetches_before = _remote_fetches()
        cache.stub.Prefetch(cache_pb2.PrefetchRequest(dataset="sharded"))  # the whole dataset, shared
        deadline = time.monotonic() + 30
        while cache.stats().tiers[0].used_bytes < sum(dataset.manifest.sizes) and time.monotonic() < deadline:
            time.sleep(0.05)
        fetches = _remote_fetches() - fetches_before
        response = cache.lease("reader", "sharded", dataset.keys)
        assert all(obj.tier != "remote" for obj in response.objects)
        for obj, size in zip(response.objects, dataset.manifest.sizes):
            assert obj.size_bytes == size
        # 4 shards of ~110 KB: coalesced reads of up to 4 MiB need about one request per shard
        # (a few more where two prefetch slots started inside the same shard), not one per sample.
        assert 4 <= fetches <= 40, fetches
        leased = {parse_sample_key(obj.key).sample: decode_sample(Path(obj.path).read_bytes())
                  for obj in response.objects}
        _, samples = sharded
        assert {k: (v["jpg"], v["cls"]) for k, v in leased.items()} == {
            k: (m["jpg"], m["cls"]) for k, m in samples.items()}


def _remote_fetches() -> float:
    """The in-process cache servers' remote fetches (the counter has no job label)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("silod_cache_remote_fetches_total") or 0.0


def test_uniform_caching_hits_the_cached_fraction_of_samples(
    sharded: tuple[Path, dict], tmp_path: Path, metadata: str
) -> None:
    dataset = SilodDataset("sharded", cache_addr="", metadata_addr=metadata)
    keys = dataset.keys
    half = sum(dataset.manifest.sizes) // 2
    with InProcessCache(tmp_path, metadata) as cache:
        cache.apply_quotas([quota("u", "sharded", half, policy="uniform")], 1)
        rng = random.Random(1)
        ratios = []
        for _ in range(3):
            order = keys[:]
            rng.shuffle(order)
            hits0 = cache.stats("u").jobs[0].hits if cache.core.job("u") else 0
            for start in range(0, len(order), 20):
                response = cache.lease("u", "sharded", order[start : start + 20])
                cache.stub.ReleaseLease(cache_pb2.ReleaseLeaseRequest(lease_id=response.lease_id))
            ratios.append((cache.stats("u").jobs[0].hits - hits0) / len(order))
        job = cache.stats("u").jobs[0]
    cached_fraction = job.cached_bytes / sum(dataset.manifest.sizes)
    assert 0.4 < cached_fraction <= 0.5
    # The first epoch hits only what the read-ahead of its misses brought in (the samples that
    # follow a missed one in its shard), never more than fits.
    assert ratios[0] <= cached_fraction + 0.08
    for ratio in ratios[1:]:  # sample-granular caching: the hit ratio is the cached fraction
        assert ratio == pytest.approx(cached_fraction, abs=0.08)


def test_a_shard_replaced_after_registration_is_refused(tmp_path: Path, metadata: str) -> None:
    root = tmp_path / "replaced"
    shards = make_shards(2, 5, seed=9)
    write_shards(root, shards)
    register_code, out = silod_cli("dataset", "register", "replaced-shards", f"file://{root}", "--format",
                                   "tar-shards", "--metadata", metadata)
    assert register_code == 0, out
    dataset = SilodDataset("replaced-shards", cache_addr="", metadata_addr=metadata)
    key = dataset.keys[0]
    shard = parse_sample_key(key).shard
    (root / shard).write_bytes(make_shard({"other": {"jpg": b"new bytes"}}))
    os.utime(root / shard, ns=(1, 1))
    store = ObjectStore(f"file://{root}")
    with pytest.raises(ObjectChanged, match=shard):
        store.read(key, dataset.manifest.sizes[0], dataset.manifest.etags[0])
    with InProcessCache(tmp_path, metadata) as cache:
        cached = SilodDataset("replaced-shards", cache_addr=cache.address, metadata_addr=metadata, job_id="r")
        with pytest.raises(DataError, match="FAILED_PRECONDITION.*changed in the store"):
            cached[0]


def test_registration_errors_name_the_uri(tmp_path: Path, metadata: str) -> None:
    empty = tmp_path / "no-shards"
    empty.mkdir()
    (empty / "a.jpg").write_bytes(b"jpeg")
    code, out = silod_cli("dataset", "register", "none", f"file://{empty}", "--format", "tar-shards",
                          "--metadata", metadata)
    assert code != 0 and "uri: no .tar shards" in out and "Traceback" not in out
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "x.tar").write_bytes(b"\x07" * 2048)
    code, out = silod_cli("dataset", "register", "broken", f"file://{broken}", "--format", "tar-shards",
                          "--metadata", metadata)
    assert code != 0 and "x.tar" in out and "not a readable tar archive" in out and "Traceback" not in out
    with pytest.raises(SystemExit) as exited:  # argparse: exit 2, the flag named on stderr
        silod_cli("dataset", "register", "fmt", f"file://{broken}", "--format", "zip", "--metadata", metadata)
    assert exited.value.code == 2


def test_shards_in_s3_are_read_by_byte_range(tmp_path: Path, metadata: str) -> None:
    import boto3

    shards = make_shards(3, 20, seed=11)
    samples = all_samples(shards)
    with moto_s3() as endpoint:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="wds")
        for key, (data, _) in shards.items():
            s3.put_object(Bucket="wds", Key=f"imagenet/{key}", Body=data)
        code, out = silod_cli("dataset", "register", "s3-shards", "s3://wds/imagenet", "--format", "tar-shards",
                              "--option", f"endpoint_url={endpoint}", "--metadata", metadata)
        assert code == 0 and "60 objects" in out, out
        direct = SilodDataset("s3-shards", cache_addr="", metadata_addr=metadata, transform=decode_sample)
        assert {as_tuple(direct[i]) for i in range(0, 60, 7)} == {
            (base, *samples[base].values()) for base in (parse_sample_key(k).sample for k in direct.keys[::7])}
        with InProcessCache(tmp_path, metadata) as cache:
            cached = SilodDataset("s3-shards", cache_addr=cache.address, metadata_addr=metadata, job_id="s3j",
                                  transform=decode_sample, manifest_in_process=True)
            got = {as_tuple(s) for s in cached.__getitems__(list(range(60)))}
            assert got == {(base, m["jpg"], m["cls"]) for base, m in samples.items()}
            job = cache.stats("s3j").jobs[0]
            # The samples' bytes and the tar padding between neighbours read together; not the shards.
            total = sum(cached.manifest.sizes)
            assert total <= job.remote_bytes <= total + 512 * 60 < sum(len(d) for d, _ in shards.values())
