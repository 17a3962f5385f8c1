"""Validation of metric samples, metric queries and job model parameters."""

from __future__ import annotations

import math
from collections.abc import Sequence

from silod.v1 import common_pb2

from services.metadata.validation.common import check_int, check_string_map, check_text, check_timestamp
from services.metadata.validation.jobs import check_job_id
from services.runtime.errors import InvalidArgument, Problems

MAX_SAMPLES_PER_APPEND = 10_000


def check_metric_name(name: str, field: str) -> None:
    check_text(name, field, max_chars=64, required=True)


def check_samples(samples: Sequence[common_pb2.MetricSample]) -> None:
    """Refused with every problem of every sample at once."""
    if not 1 <= len(samples) <= MAX_SAMPLES_PER_APPEND:
        raise InvalidArgument(f"must hold 1..{MAX_SAMPLES_PER_APPEND} samples, got {len(samples)}", field="samples")
    problems = Problems()
    check = problems.check
    for index, sample in enumerate(samples):
        field = f"samples[{index}]"
        check(check_job_id, sample.job_id, f"{field}.job_id")
        check(check_metric_name, sample.name, f"{field}.name")
        if not math.isfinite(sample.value):
            problems.add(f"{field}.value", f"must be a finite number, got {sample.value}")
        if sample.HasField("time"):
            check(check_timestamp, sample.time, f"{field}.time")
        check(check_string_map, sample.labels, f"{field}.labels", max_entries=32)
    problems.raise_if_any()


def check_metrics_query(job_id: str, name: str) -> None:
    check_job_id(job_id)
    if name:
        check_metric_name(name, "name")


def check_job_model(model: common_pb2.JobModelParams, field: str = "model") -> None:
    check_job_id(model.job_id, f"{field}.job_id")
    check_text(model.application, f"{field}.application", max_chars=128)
    if len(model.params) > 256:
        raise InvalidArgument(f"at most 256 parameters, got {len(model.params)}", field=f"{field}.params")
    for key, value in model.params.items():
        if not key or len(key) > 128:
            raise InvalidArgument(f"names must be 1..128 characters, got {key[:40]!r}", field=f"{field}.params")
        if not math.isfinite(value):
            raise InvalidArgument(f"must be a finite number, got {value}", field=f"{field}.params[{key!r}]")
    check_int(model.observations, f"{field}.observations", minimum=0, maximum=2**62)
