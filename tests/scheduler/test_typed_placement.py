"""Typed clusters: one GPU type per job, the fastest type with room, constraints and stickiness."""

from __future__ import annotations

import dataclasses

from estimator.gpu_types import typed_models
from scheduler.placement import TypeRoom, place, type_preferences
from scheduler.registry import get_policy
from tests.scheduler.conftest import assert_sound, make_job, make_nodes, make_snapshot, model


def typed(nodes, gpu_type):
    return tuple(dataclasses.replace(n, gpu_type=gpu_type) for n in nodes)


def cluster(k80=2, v100=2, gpus=4):
    return typed(make_nodes(k80, gpus, prefix="k"), "k80") + typed(make_nodes(v100, gpus, prefix="v"), "v100")


def tjob(job_id, application="imagenet", **fields):
    return make_job(job_id, application, type_models=typed_models(model(application), ["k80", "v100"]), **fields)


def types_of(snapshot, placement):
    return {snapshot.node(node).gpu_type for node, _ in placement}


def test_a_job_goes_to_the_fastest_type_with_room():
    snap = make_snapshot(cluster(), [tjob("a", gpus=4)])
    assert type_preferences(snap, {"a": 4}) == {"a": ("v100", "k80")}
    assert types_of(snap, place(snap, {"a": 4}).placements["a"]) == {"v100"}


def test_a_job_never_spans_types_even_when_only_both_together_have_room():
    snap = make_snapshot(cluster(1, 1), [tjob("big", gpus=6), tjob("a", gpus=3)])
    result = place(snap, {"big": 6, "a": 3}, ["big", "a"])
    assert result.unplaced == ("big",)
    assert types_of(snap, result.placements["a"]) == {"v100"}


def test_when_the_fast_type_is_full_the_slow_one_is_used():
    snap = make_snapshot(cluster(1, 1), [tjob("a", gpus=4), tjob("b", gpus=4)])
    result = place(snap, {"a": 4, "b": 4}, ["a", "b"])
    assert [types_of(snap, result.placements[j]) for j in "ab"] == [{"v100"}, {"k80"}]


def test_a_job_limited_to_some_types_goes_nowhere_else():
    snap = make_snapshot(cluster(), [tjob("old", gpus=2, gpu_types=("k80",))])
    assert types_of(snap, place(snap, {"old": 2}).placements["old"]) == {"k80"}


def test_a_running_job_stays_on_its_type():
    snap = make_snapshot(cluster(), [tjob("a", gpus=2)], current={"a": [("k0", (0, 1))]})
    assert type_preferences(snap, {"a": 2})["a"][0] == "k80"
    assert place(snap, {"a": 2}).placements["a"] == (("k0", (0, 1)),)
    # ... unless the policy names another type.
    moved = place(snap, {"a": 2}, preferences={"a": ("v100",)}).placements["a"]
    assert types_of(snap, moved) == {"v100"}


def test_type_room_claims_whole_counts_from_one_type():
    room = TypeRoom(make_snapshot(cluster(1, 1), []))
    assert room.claim(6, ("v100", "k80")) is None
    assert room.claim(3, ("v100", "k80")) == "v100"
    assert room.claim(3, ("v100", "k80")) == "k80"
    assert room.total == 2


def test_untyped_clusters_place_as_before():
    snap = make_snapshot(make_nodes(2, 4), [make_job("a", gpus=6)])
    assert type_preferences(snap, {"a": 6}) == {"a": ("",)}
    assert sum(len(ix) for _, ix in place(snap, {"a": 6}).placements["a"]) == 6


def test_rigid_policies_admit_per_type_and_backfill():
    # 2 x 4 k80 + 1 x 4 v100; a 6-GPU job fits the total of neither type alone... it fits k80 (8).
    nodes = typed(make_nodes(2, 4, prefix="k"), "k80") + typed(make_nodes(1, 4, prefix="v"), "v100")
    jobs = [tjob("wide", gpus=6), tjob("a", gpus=4, submit=1), tjob("b", gpus=4, submit=2)]
    snap = make_snapshot(nodes, jobs)
    for name in ("fifo", "sjf", "tiresias", "themis"):
        plan = get_policy(name).schedule(snap)
        assert_sound(snap, plan, rigid=True)
        for job_id, a in plan.allocations.items():
            assert len(types_of(snap, a.placement)) == 1, (name, job_id)
            assert a.gpu_type in ("k80", "v100")
        assert sum(a.gpus for a in plan.allocations.values()) >= 8, name


def test_silod_codesign_keeps_working_on_a_typed_cluster():
    # Cache and a tight storage budget on a k80 + v100 cluster: every co-designing policy
    # still grants cache and IO within capacity (check_plan), with one type per job.
    nodes = tuple(dataclasses.replace(n, cache_capacity_bytes=4e9) for n in cluster(1, 1))
    jobs = [tjob(f"j{k}", app, gpus=2, dataset=app) for k, app in enumerate(["imagenet", "cifar10", "deepspeech2"])]
    snap = make_snapshot(nodes, jobs, storage_bandwidth_bytes_per_s=50e6)
    for name in ("fifo", "sjf", "tiresias", "themis", "gavel", "pollux"):
        plan = get_policy(name, codesign=True).schedule(snap)
        assert_sound(snap, plan)
        assert plan.allocations, name
        for a in plan.allocations.values():
            assert len(types_of(snap, a.placement)) == 1, name
        assert any(a.remote_io_bytes_per_s < float("inf") for a in plan.allocations.values()), name
