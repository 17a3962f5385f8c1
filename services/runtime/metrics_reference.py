"""Render docs/metrics.md from the metric objects the processes export.

Each process declares its Prometheus metrics once, as module-level objects; this reference
lists them (name, type, labels, meaning) from those objects, so it names exactly what the code
exports. ``make metrics-docs`` rewrites the file; tests/observability fails when the committed
copy is stale, and when a Grafana panel or an alert rule queries a metric that is not here.

    python -m services.runtime.metrics_reference            # print the reference
    python -m services.runtime.metrics_reference --write    # rewrite docs/metrics.md
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"

# (process, the modules that hold its metrics), in the order of the page.
PROCESSES = (
    ("every process", ("services.runtime.metrics", "services.runtime.audit", "services.runtime.gc_pauses",
                       "services.runtime.loop_lag")),
    ("scheduler", ("scheduler.live.metrics", "scheduler.live.reports")),
    ("allocation server", ("scheduler.allocation.metrics",)),
    ("worker agent", ("worker_agent.metrics",)),
    ("cache server", ("cache_server.metrics",)),
    ("metadata service", ("services.metadata.compaction", "services.metadata.database")),
    ("dashboard", ("services.dashboard.app",)),
)

HEADER = """\
# Metrics reference

<!-- Generated from the metric objects by `make metrics-docs`
     (services/runtime/metrics_reference.py); do not edit by hand. -->

Every Prometheus metric a silod process exports on its `--metrics-port` (the dashboard: on its
own port), generated from the objects the code declares. A counter's samples are `NAME_total`,
a histogram's `NAME_bucket`, `NAME_sum` and `NAME_count`. How to scrape them, the alert rules
and the Grafana dashboard: [operators.md](operators.md) "Health, metrics and logs".

**Labels stay few.** Every label takes values from a small fixed set (a phase, a state, a
cause, a tier, a reason) or one per machine (`node`, `gpu`), so a cluster's series grow with its
nodes, not with its jobs or requests. No metric is labelled with a job: the cache server's
counters move with every object read, and a series per job would pile up over a cluster's
lifetime. Per-job figures are kept where they are asked for by job: the cache servers' `Stats`
RPC (hits, misses, remote and peer bytes, quota), the jobs' own progress reports in the
metadata store, and the dashboard that shows both.
"""

_SUFFIX = {"counter": "_total", "histogram": "", "gauge": "", "summary": "", "info": "_info", "enum": ""}


def metric_objects(module_name: str) -> list[MetricWrapperBase]:
    module = importlib.import_module(module_name)
    found = [value for value in vars(module).values() if isinstance(value, MetricWrapperBase)]
    return sorted(found, key=lambda m: m._name)


def exported_names(metric: MetricWrapperBase) -> set[str]:
    """The sample names a scrape shows for ``metric``."""
    name, kind = metric._name, metric._type
    if kind == "counter":
        return {f"{name}_total", f"{name}_created"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
    return {name}


def all_exported_names() -> set[str]:
    return {n for _, modules in PROCESSES for module in modules for m in metric_objects(module)
            for n in exported_names(m)}


def render() -> str:
    out = [HEADER]
    for process, modules in PROCESSES:
        out.append(f"\n## {process[0].upper()}{process[1:]}\n")
        out.append("| metric | type | labels | meaning |")
        out.append("|---|---|---|---|")
        for module in modules:
            for m in metric_objects(module):
                labels = ", ".join(f"`{label}`" for label in m._labelnames) or "-"
                doc = " ".join(m._documentation.split()).replace("|", "\\|")
                out.append(f"| `{m._name}{_SUFFIX.get(m._type, '')}` | {m._type} | {labels} | {doc} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--write", action="store_true", help=f"rewrite {REFERENCE_PATH} instead of printing")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        REFERENCE_PATH.write_text(text)
        print(f"wrote {REFERENCE_PATH}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
