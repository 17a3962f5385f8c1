"""Application profiles: exact at every CSV row, interpolated between neighbours, packaged data."""

import csv
from collections import defaultdict
from importlib import resources

import numpy as np
import pytest

from estimator.goodput import step_time
from estimator.profiles import MAX_EPOCHS, POLLUX_APPLICATIONS, application_names, load_profile, normalize_placement, read_datasets

APPS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")


def csv_rows(app, name):
    with resources.files("estimator.profiles").joinpath(app, name).open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_the_six_applications_are_packaged():
    assert POLLUX_APPLICATIONS == APPS
    assert application_names() == tuple(sorted(APPS + ("digits",)))  # + the DDP example, measured here
    root = resources.files("estimator.profiles")
    assert "Apache License" in root.joinpath("LICENSE").read_text(encoding="utf-8")
    assert "copied unchanged from the pollux artifact data" in root.joinpath("SOURCE.md").read_text(encoding="utf-8").lower()


@pytest.mark.parametrize("app", APPS)
def test_every_placement_row_is_exact(app):
    profile = load_profile(app)
    rows = csv_rows(app, "placements.csv")
    by_placement = defaultdict(list)
    for row in rows:
        by_placement[row["placement"]].append(row)
    for placement, group in by_placement.items():
        bsz = np.array([float(r["local_bsz"]) for r in group])
        step, sync = profile.placement_step_and_sync_time(placement, bsz)
        np.testing.assert_allclose(step, [float(r["step_time"]) for r in group], rtol=1e-12)
        np.testing.assert_allclose(sync, [float(r["sync_time"]) for r in group], rtol=1e-12)


@pytest.mark.parametrize("app", APPS)
def test_every_scalability_row_is_exact(app):
    profile = load_profile(app)
    rows = csv_rows(app, "scalability.csv")
    n, r, b, step, sync = (np.array([float(row[c]) for row in rows]) for c in ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time"))
    got_step, got_sync = profile.step_and_sync_time(n, r, b)
    np.testing.assert_allclose(got_step, step, rtol=1e-12)
    np.testing.assert_allclose(got_sync, sync, rtol=1e-12)


@pytest.mark.parametrize("app", APPS)
def test_shape_lookup_at_placement_rows_is_the_mean_over_equal_shapes(app):
    # Placements with the same node and GPU counts ("1444" and "3334") pool into one shape.
    profile = load_profile(app)
    sums = defaultdict(list)
    for row in csv_rows(app, "placements.csv"):
        p = row["placement"]
        sums[(len(p), sum(map(int, p)), float(row["local_bsz"]))].append(float(row["step_time"]))
    keys = np.array(list(sums))
    expected = np.array([np.mean(v) for v in sums.values()])
    np.testing.assert_allclose(profile.step_time(keys[:, 0], keys[:, 1], keys[:, 2]), expected, rtol=1e-12)


def _between(value, a, b):
    return min(a, b) - 1e-12 <= value <= max(a, b) + 1e-12


@pytest.mark.parametrize("app", APPS)
def test_interpolation_lies_between_neighbours(app):
    profile = load_profile(app)
    # Along the batch size, at a measured placement.
    rows = [r for r in csv_rows(app, "placements.csv") if r["placement"] == "1"]
    for lo, hi in zip(rows, rows[1:]):
        b_lo, b_hi = float(lo["local_bsz"]), float(hi["local_bsz"])
        step, sync = profile.placement_step_and_sync_time("1", (b_lo + b_hi) / 2)
        assert _between(float(step), float(lo["step_time"]), float(hi["step_time"]))
        assert _between(float(sync), float(lo["sync_time"]), float(hi["sync_time"]))
    # Along the replicas: 6 nodes measured at 8 and 10 GPUs, queried at 9.
    b = float(csv_rows(app, "scalability.csv")[0]["local_bsz"])
    at9 = profile.step_time(6, 9, b)
    assert _between(float(at9), float(profile.step_time(6, 8, b)), float(profile.step_time(6, 10, b)))
    # Along the nodes: 5 nodes lies between 4 and 6 (both measured with 8 GPUs).
    at5 = profile.step_time(5, 8, b)
    assert _between(float(at5), float(profile.step_time(4, 8, b)), float(profile.step_time(6, 8, b)))


@pytest.mark.parametrize("app", APPS)
def test_extrapolation_is_positive_and_grows_with_batch_and_scale(app):
    profile = load_profile(app)
    largest = profile.measurements.local_bsz.max()
    batches = np.array([largest, 2 * largest, 4 * largest])
    steps = profile.step_time(1, 1, batches)
    assert np.all(np.isfinite(steps)) and np.all(np.diff(steps) > 0)
    # 32 nodes / 128 GPUs is beyond the profile (16 / 64): finite, positive sync.
    step, sync = profile.step_and_sync_time(32, 128, profile.bounds.min_local_bsz)
    assert np.isfinite(step) and 0 < sync < step


def test_placement_normalization():
    assert normalize_placement("4441") == "1444"
    assert normalize_placement((4, 0, 4)) == "44"
    assert normalize_placement([2, 1, 3]) == "132"
    with pytest.raises(ValueError):
        normalize_placement("")
    with pytest.raises(ValueError):
        normalize_placement([12])


def test_rejects_impossible_shapes():
    profile = load_profile("bert")
    with pytest.raises(ValueError):
        profile.step_time(4, 2, 8)  # fewer GPUs than nodes
    with pytest.raises(ValueError):
        profile.step_time(1, 1, 0)


def test_throughput_at_measured_points_and_with_accumulation():
    profile = load_profile("imagenet")
    # One GPU, 200 samples (a measured row): 200 / step_time.
    row = next(r for r in csv_rows("imagenet", "placements.csv") if r["placement"] == "1" and r["local_bsz"] == "200")
    assert profile.throughput(1, 1, 200) == pytest.approx(200 / float(row["step_time"]))
    # 400 samples on one GPU exceed max_local_bsz = 200: two micro-batches of 200, the
    # second without a sync: 400 / (step + (step - sync)).
    step, sync = float(row["step_time"]), float(row["sync_time"])
    assert profile.throughput(1, 1, 400) == pytest.approx(400 / (2 * step - sync))


@pytest.mark.parametrize("app", APPS)
def test_dataset_bounds_and_epochs(app):
    profile = load_profile(app)
    facts = next(d for d in read_datasets() if app in d.applications)
    assert profile.dataset == facts
    assert profile.dataset.bytes_per_sample > 0 and profile.dataset.total_bytes > 0
    assert profile.max_epochs == MAX_EPOCHS[app]
    assert profile.bounds.init_batch_size == min(profile.validation)
    assert profile.bounds.max_batch_size == max(profile.validation)


def test_batch_bounds_from_the_artifact():
    assert load_profile("yolov3").bounds.max_local_bsz == 8  # the artifact's override
    assert load_profile("cifar10").bounds == (128, 4096, 32, 1024)


def test_grad_params_exact_at_validated_sizes_and_interpolated_between():
    profile = load_profile("cifar10")
    rows = csv_rows("cifar10", "validation-128.csv")
    assert profile.grad_params(128, 3) == pytest.approx((float(rows[3]["grad_sqr"]), float(rows[3]["grad_var"])))
    low, high = profile.grad_params(128, 3), profile.grad_params(256, 3)
    mid = profile.grad_params(192, 3)
    assert _between(mid.sqr, low.sqr, high.sqr) and _between(mid.var, low.var, high.var)
    typical = profile.typical_grad_params()
    assert typical.sqr > 0 and typical.var > 0


def test_unknown_application():
    with pytest.raises(KeyError, match="known"):
        load_profile("gpt5")


def test_profile_fit_follows_the_profile():
    profile = load_profile("cifar10")
    m = profile.measurements
    predicted = step_time(profile.perf_params, m.nodes, m.replicas, m.local_bsz)
    # The Pollux model simplifies the measurements: median error of a few percent.
    assert np.median(np.abs(predicted / m.step_time - 1)) < 0.1
