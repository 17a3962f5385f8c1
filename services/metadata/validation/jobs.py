"""Validation of job specs, progress reports and events."""

from __future__ import annotations

import re

from silod.v1 import common_pb2

from services.metadata.validation.common import (
    MAX_BYTES,
    check_enum,
    check_float,
    check_gpu_types,
    check_int,
    check_identifier,
    check_label,
    check_string_map,
    check_text,
)
from services.runtime.errors import InvalidArgument, Problems
from silod.rpc.identifiers import DATASET_NAME, JOB_ID, TENANT

MAX_GPUS = 4096
MAX_BATCH_SIZE = 2**24
MAX_EPOCHS = 1_000_000
MAX_SAMPLE_BUDGET = 2**53
MAX_INFERENCE_DURATION_S = 30 * 24 * 3600.0
MAX_EMULATED_STEP_S = 3600.0
MAX_CLIENT_REQUEST_ID_CHARS = 128
MAX_MESSAGE_CHARS = 4096
MAX_CPUS_PER_RANK = 4096.0
MAX_MEMORY_BYTES_PER_RANK = 2**50
MAX_IMAGE_CHARS = 255
# A container image reference in Docker's grammar (distribution/reference): an optional registry
# host (with a dot or a port, or "localhost") and port, path components of lower-case letters and
# digits joined by ".", "_", "__" or dashes, an optional tag, an optional sha256 digest.
_IMAGE_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_HOST_PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
# A first component is a host only with a dot or a port, or as "localhost" (else it is a path component).
_IMAGE_HOST = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})+(?::[0-9]+)?|{_HOST_PART}:[0-9]+|localhost)"
IMAGE_REFERENCE = re.compile(
    rf"(?:{_IMAGE_HOST}/)?{_IMAGE_COMPONENT}(?:/{_IMAGE_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
    r"(?:@sha256:[a-f0-9]{64})?")
DEFAULT_TENANT = "default"
RESERVED_EVENT_TYPE = "state"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")

TRAINING = common_pb2.JOB_KIND_TRAINING
INFERENCE = common_pb2.JOB_KIND_INFERENCE


def normalized_job_spec(spec: common_pb2.JobSpec, field: str = "spec") -> common_pb2.JobSpec:
    """A validated copy with the documented defaults filled in (tenant, kind), so that two
    requests meaning the same job compare equal. Refused with every problem found at once."""
    problems = Problems()
    job_spec_problems(spec, field, problems)
    problems.raise_if_any()
    normalized = common_pb2.JobSpec()
    normalized.CopyFrom(spec)
    normalized.tenant = spec.tenant or DEFAULT_TENANT
    normalized.kind = spec.kind or TRAINING
    return normalized


def job_spec_problems(spec: common_pb2.JobSpec, field: str, problems: Problems) -> None:
    """Add every problem of ``spec`` to ``problems``."""
    check = problems.check
    check(check_label, spec.name, f"{field}.name", max_chars=128, required=True)
    check(check_identifier, spec.tenant, TENANT, f"{field}.tenant", required=False)
    check(check_enum, spec.kind, common_pb2.JobKind.DESCRIPTOR, f"{field}.kind")
    check(check_label, spec.application, f"{field}.application", max_chars=128)
    check(check_identifier, spec.dataset, DATASET_NAME, f"{field}.dataset", required=False)
    check(check_int, spec.priority, f"{field}.priority", minimum=-(2**31), maximum=2**31 - 1)
    check(check_gpu_types, spec.gpu_types, f"{field}.gpu_types")
    if spec.kind == INFERENCE:
        _check_inference_shape(spec, field, problems)
    else:
        _check_training_shape(spec, field, problems)
    check(check_float, spec.emulated_step_compute_s, f"{field}.emulated_step_compute_s", minimum=0.0,
          maximum=MAX_EMULATED_STEP_S)
    check(check_float, spec.cpus_per_rank, f"{field}.cpus_per_rank", minimum=0.0, maximum=MAX_CPUS_PER_RANK)
    check(check_int, spec.memory_bytes_per_rank, f"{field}.memory_bytes_per_rank", minimum=0,
          maximum=MAX_MEMORY_BYTES_PER_RANK)
    check(check_image, spec.image, f"{field}.image")
    _check_command(spec, field, problems)


def _check_training_shape(spec: common_pb2.JobSpec, field: str, problems: Problems) -> None:
    check = problems.check
    check(check_int, spec.min_gpus, f"{field}.min_gpus", minimum=1, maximum=MAX_GPUS)
    check(check_int, spec.max_gpus, f"{field}.max_gpus", minimum=min(max(spec.min_gpus, 1), MAX_GPUS), maximum=MAX_GPUS)
    check(check_int, spec.batch_size, f"{field}.batch_size", minimum=1, maximum=MAX_BATCH_SIZE)
    if spec.max_batch_size != 0:
        check(check_int, spec.max_batch_size, f"{field}.max_batch_size",
              minimum=min(max(spec.batch_size, 1), MAX_BATCH_SIZE), maximum=MAX_BATCH_SIZE)
    budget = spec.WhichOneof("budget")
    if budget is None:
        problems.add(f"{field}.budget", "a training job needs exactly one of epochs or sample_budget")
    elif budget == "epochs":
        check(check_int, spec.epochs, f"{field}.epochs", minimum=1, maximum=MAX_EPOCHS)
    else:
        check(check_int, spec.sample_budget, f"{field}.sample_budget", minimum=1, maximum=MAX_SAMPLE_BUDGET)
    if spec.inference_duration_s != 0:
        problems.add(f"{field}.inference_duration_s", "only inference jobs have a duration")


def _check_inference_shape(spec: common_pb2.JobSpec, field: str, problems: Problems) -> None:
    # DeepBoot inference tasks hold exactly one GPU for a fixed time.
    check = problems.check
    check(check_int, spec.min_gpus, f"{field}.min_gpus", minimum=1, maximum=1)
    check(check_int, spec.max_gpus, f"{field}.max_gpus", minimum=1, maximum=1)
    duration_ok = check(check_float, spec.inference_duration_s, f"{field}.inference_duration_s", minimum=0.0,
                        maximum=MAX_INFERENCE_DURATION_S)
    if duration_ok and spec.inference_duration_s <= 0:
        problems.add(f"{field}.inference_duration_s", "an inference job needs a duration > 0")
    check(check_int, spec.batch_size, f"{field}.batch_size", minimum=0, maximum=MAX_BATCH_SIZE)
    check(check_int, spec.max_batch_size, f"{field}.max_batch_size", minimum=0, maximum=MAX_BATCH_SIZE)
    budget = spec.WhichOneof("budget")
    if budget is not None:
        problems.add(f"{field}.{budget}", "inference jobs run for inference_duration_s, not a budget")


def _check_command(spec: common_pb2.JobSpec, field: str, problems: Problems) -> None:
    if len(spec.command) > 4096:
        problems.add(f"{field}.command", f"at most 4096 arguments, got {len(spec.command)}")
    else:
        for index, argument in enumerate(spec.command):
            problems.check(check_text, argument, f"{field}.command[{index}]", max_chars=32768)
    if problems.check(check_string_map, spec.env, f"{field}.env", max_entries=256, max_key_chars=256,
                      max_value_chars=32768):
        for key in spec.env:
            if not _ENV_NAME.fullmatch(key):
                problems.add(f"{field}.env", f"not an environment variable name: {key!r}")


def check_image(value: str, field: str) -> str:
    """Empty (the node's default), or a container image reference such as
    ``registry.example:5000/team/train:1.4`` or ``ubuntu@sha256:<64 hex>``."""
    if len(value) > MAX_IMAGE_CHARS:
        raise InvalidArgument(f"must be at most {MAX_IMAGE_CHARS} characters, got {len(value)}", field=field)
    if value and not IMAGE_REFERENCE.fullmatch(value):
        raise InvalidArgument(f"must be a container image reference, [HOST[:PORT]/]NAME[:TAG][@sha256:DIGEST] with "
                              f"lower-case name components (e.g. registry.example:5000/team/train:1.4), got {value!r}",
                              field=field)
    return value


def check_client_request_id(value: str) -> None:
    check_text(value, "client_request_id", max_chars=MAX_CLIENT_REQUEST_ID_CHARS)


def check_job_id(value: str, field: str = "job_id") -> None:
    """Only the shape; whether the job exists is the store's question."""
    check_identifier(value, JOB_ID, field)


def check_progress(progress: common_pb2.JobProgress, field: str = "progress") -> None:
    check_int(progress.samples_done, f"{field}.samples_done", minimum=0, maximum=2**62)
    check_int(progress.steps_done, f"{field}.steps_done", minimum=0, maximum=2**62)
    check_int(progress.epochs_done, f"{field}.epochs_done", minimum=0, maximum=2**31 - 1)
    check_float(progress.fraction_done, f"{field}.fraction_done", minimum=0.0, maximum=1.0)
    check_float(progress.throughput_samples_per_s, f"{field}.throughput_samples_per_s", minimum=0.0, maximum=1e15)
    check_float(progress.cache_hit_ratio, f"{field}.cache_hit_ratio", minimum=0.0, maximum=1.0)


def check_resources(resources: common_pb2.ResourceVector, field: str) -> None:
    check_int(resources.gpus, f"{field}.gpus", minimum=0, maximum=MAX_GPUS)
    check_int(resources.cache_bytes, f"{field}.cache_bytes", minimum=0, maximum=MAX_BYTES)
    check_int(resources.remote_io_bytes_per_s, f"{field}.remote_io_bytes_per_s", minimum=0, maximum=MAX_BYTES)


def check_event(event_type: str, message: str) -> None:
    check_text(event_type, "type", max_chars=64, required=True)
    if event_type == RESERVED_EVENT_TYPE:
        raise InvalidArgument('"state" events are written by TransitionJob only', field="type")
    check_text(message, "message", max_chars=MAX_MESSAGE_CHARS)


def check_transition(expected_state: int, new_state: int, message: str) -> None:
    check_enum(expected_state, common_pb2.JobState.DESCRIPTOR, "expected_state", allow_unspecified=False)
    check_enum(new_state, common_pb2.JobState.DESCRIPTOR, "new_state", allow_unspecified=False)
    check_text(message, "message", max_chars=MAX_MESSAGE_CHARS)
