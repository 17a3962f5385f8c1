"""Shared helpers for the simulator tests: tiny hand-built workloads and scripted policies."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from estimator.job_model import JobModel
from estimator.predict import predict_one
from scheduler.policy import Allocation, ClusterSnapshot, Plan
from simulator import ClusterSpec, JobSpec, cluster_from_dict, target_samples


def goodput(application: str, gpus: int, nodes: int, batch_size: int) -> float:
    """The rate the engine must use: estimator.predict, IO unlimited, no cache."""
    model = JobModel.from_profile(application)
    return float(predict_one(model, gpus, nodes, 0, math.inf, batch_size).goodput_samples_per_s[0])


def job(name: str, arrival: float, application: str = "cifar10", gpus: int = 4, batch: int = 512) -> JobSpec:
    return JobSpec(name, application, float(arrival), gpus, batch)


@dataclass
class Scripted:
    """A policy whose plan is a function of the snapshot; records every snapshot it saw."""

    decide: Callable[[ClusterSnapshot], dict[str, tuple[tuple[str, tuple[int, ...]], ...]]]
    seen: list[ClusterSnapshot] = field(default_factory=list)
    name: str = "scripted"

    def schedule(self, snapshot: ClusterSnapshot) -> Plan:
        self.seen.append(snapshot)
        return Plan({job_id: Allocation(placement=p) for job_id, p in self.decide(snapshot).items() if p})


def on(node: str, *indices: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return ((node, tuple(indices)),)


@pytest.fixture
def two_nodes() -> ClusterSpec:
    return cluster_from_dict({"nodes": 2, "gpus_per_node": 4})


__all__ = ["Scripted", "goodput", "job", "on", "target_samples"]
