"""The allocation server's Prometheus figures (docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PLAN_VERSION = Gauge("silod_allocation_plan_version", "Version of the plan in force this allocation server serves")
LEADER_EPOCH = Gauge("silod_allocation_leader_epoch", "Newest leadership epoch a scheduler's feed declared")
PLANS_TAKEN = Counter(
    "silod_allocation_plans_taken_total",
    "Plans taken in, by source: feed (the leading scheduler's PlanFeedService) or store (read at start)", ["source"])
PLANS_REFUSED = Counter(
    "silod_allocation_plans_refused_total",
    "Plans refused, by reason: epoch (a deposed leader's feed, or a plan older than the newest epoch) or "
    "out_of_step (changes based on another plan; the feed is opened again)", ["reason"])
RELAYED = Counter(
    "silod_allocation_relayed_total", "Acks and task reports passed to the leading scheduler, by kind: ack or report",
    ["kind"])
RELAY_FAILURES = Counter(
    "silod_allocation_relay_failures_total", "Relay calls to the leading scheduler that failed (their acks and "
    "reports answered UNAVAILABLE; the nodes send them again)")
RELAY_BATCH = Histogram(
    "silod_allocation_relay_batch_size", "Acks and reports per Relay call",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
