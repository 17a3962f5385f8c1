"""The garbage collector's pauses are measured, and a started service collects a big heap less often."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from services.runtime import gc_pauses
from services.runtime.settings import ConfigError, ServiceSettings, load_settings


def _sample(name: str, generation: str) -> float:
    return REGISTRY.get_sample_value(name, {"generation": generation}) or 0.0


def _count(generation: str) -> float:
    return _sample("silod_gc_pause_seconds_count", generation)


@pytest.fixture
def gc_state() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_each_collection_is_observed_once_by_generation() -> None:
    gc_pauses.measure()
    gc_pauses.measure()  # a second server in the process must not count collections twice
    before = _count("2")
    gc.collect()
    gc.collect()
    # Each counted once (measured twice, each would count two); an automatic collection may
    # slip in between on a busy worker, never two of ours.
    assert before + 2 <= _count("2") < before + 4
    assert _sample("silod_gc_pause_seconds_sum", "2") > 0


def test_tune_freezes_what_start_up_made_and_raises_the_thresholds(gc_state: None) -> None:
    kept = [[i] for i in range(1000)]  # start-up state: tracked containers
    gc_pauses.tune(12_345)
    assert gc.get_threshold() == (12_345, gc_pauses.OLDER_THRESHOLD, gc_pauses.OLDER_THRESHOLD)
    assert gc.get_freeze_count() >= len(kept)
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert not any(id(item) in oldest for item in kept)  # frozen: out of every later collection


def test_the_setting_defaults_on_and_refuses_a_negative_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(ServiceSettings).gc_young_threshold == 50_000
    assert load_settings(ServiceSettings, gc_young_threshold=0).gc_young_threshold == 0  # CPython's own
    monkeypatch.setenv("SILOD_GC_YOUNG_THRESHOLD", "-1")
    with pytest.raises(ConfigError, match="gc_young_threshold"):
        load_settings(ServiceSettings)
