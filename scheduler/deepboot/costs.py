"""What a placement change costs a training job, and the restart penalty built on it.

Public constants of the DeepBoot artifact's simulator (``applications.py``: ``APPLICATIONS_DELAY``
and ``NEXT_DELAY``), seconds per application:

- a full (re)start — container creation, loading, warm-up: 18 s (deepspeech2) to 103 s (bert);
- an AFE resize — survivors stay alive and only re-form the group: 1 s to 5 s;
- an inference replica's cold start: 4 s to 8 s.

AFE speeds up *resizes* only: a job that holds no GPUs (first start, or restart after a
preemption) pays the full start either way, as in the artifact (its ``FIRST_DELAY``).
Applications the tables do not know fall back to the snapshot's ``restart_cost_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.policy import JobInfo

FULL_RESTART_S: Mapping[str, float] = {
    "bert": 103.0, "cifar10": 24.0, "ncf": 25.0, "deepspeech2": 18.0, "yolov3": 26.0, "imagenet": 35.0,
}
AFE_RESIZE_S: Mapping[str, float] = {
    "bert": 5.0, "cifar10": 3.0, "ncf": 2.0, "deepspeech2": 1.0, "yolov3": 3.0, "imagenet": 3.0,
}
INFERENCE_COLD_START_S: Mapping[str, float] = {
    "bert": 8.0, "cifar10": 6.0, "ncf": 4.0, "deepspeech2": 4.0, "yolov3": 6.0, "imagenet": 6.0,
}

# A starting job keeps at least this share of its speedup, however long its start: with a
# sum-of-speedups objective a share of 0 would leave GPUs idle rather than start the job.
MIN_KEPT_SHARE = 1e-3


@dataclass(frozen=True)
class ResizeCosts:
    """Seconds a job loses when its placement changes; overrides are keyed by job id, then application."""

    afe: bool = True                                      # resizes use the AFE fast path
    full_s: Mapping[str, float] = field(default_factory=dict)   # overrides of FULL_RESTART_S
    afe_s: Mapping[str, float] = field(default_factory=dict)    # overrides of AFE_RESIZE_S

    def __post_init__(self):
        for name, table in (("full_s", self.full_s), ("afe_s", self.afe_s)):
            for key, value in dict(table).items():
                if not value >= 0:
                    raise ValueError(f"{name}[{key!r}] must be seconds >= 0, got {value!r}")

    def cost_s(self, job: JobInfo, *, starting: bool, default_s: float) -> float:
        """Seconds lost by ``job``: a full start when ``starting`` (it holds nothing) or without AFE, else an AFE resize."""
        application = job.model.application
        if starting or not self.afe:
            table, defaults = self.full_s, FULL_RESTART_S
        else:
            table, defaults = self.afe_s, AFE_RESIZE_S
        for source in (table, defaults):
            for key in (job.job_id, application):
                if key in source:
                    return float(source[key])
        return float(default_s)


def kept_share(cost_s: float, horizon_s: float, *, starting: bool) -> float:
    """Share of its speedup a job keeps over the next ``horizon_s`` seconds after losing ``cost_s``.

    ``(horizon - cost) / horizon``, floored at 0 — or at :data:`MIN_KEPT_SHARE` for a starting
    job; 1 when there is no horizon (``interval_s`` 0: nothing to lose).
    """
    if horizon_s <= 0:
        return 1.0
    share = max(0.0, (horizon_s - cost_s) / horizon_s)
    return max(share, MIN_KEPT_SHARE) if starting else share
