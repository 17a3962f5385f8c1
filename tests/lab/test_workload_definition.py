"""What `silod lab workload` runs and how the lab reads the compose topology: no namespaces
needed (tests/lab/test_lab.py runs them on a real lab)."""

from __future__ import annotations

from silod import demo
from silod.lab import compose
from silod.lab.workload import demo_workload, short_workload


def test_the_lab_runs_the_demos_workload_and_a_short_cut_of_it() -> None:
    full = demo_workload()
    assert (full.datasets, full.training, full.inference) == (demo.DATASETS, demo.TRAINING_JOBS, demo.INFERENCE_BURST)
    short = short_workload(0.25)
    # One training job per dataset, every one of the demo's, at a quarter of its samples.
    assert {row[1] for row in short.training} == {name for name, _, _ in demo.DATASETS}
    by_name = {row[0]: row for row in demo.TRAINING_JOBS}
    for name, dataset, lo, hi, samples, step_s in short.training:
        assert by_name[name][1:4] == (dataset, lo, hi) and by_name[name][5] == step_s
        assert samples == by_name[name][4] // 4
    assert short.inference == tuple((app, round(s / 4, 2)) for app, s in demo.INFERENCE_BURST[:3])
    assert [files for _, files, _ in short.datasets] == [files // 4 for _, files, _ in demo.DATASETS]


def test_compose_gives_the_lab_training_and_inference_worker_hosts() -> None:
    services = compose.load(nodes=2, inference_nodes=1)
    agents = {name: s for name, s in services.items() if s.command[:1] == ["worker-agent"]}
    assert sorted(agents) == ["agent-0", "agent-1", "agent-infer-0"]
    infer = agents["agent-infer-0"].command
    assert infer[infer.index("--pool") + 1] == "inference" and "--pool" not in agents["agent-0"].command
    assert services["scheduler"].environment["SILOD_POLICY"] == "deepboot"


def test_more_inference_nodes_are_copies_of_infer_0_with_their_own_names_and_volumes() -> None:
    services = compose.load(nodes=1, inference_nodes=2)
    assert sorted(n for n in services if "-" in n and n.split("-")[0] in ("agent", "cache")) == \
        ["agent-0", "agent-infer-0", "agent-infer-1", "cache-0", "cache-infer-0", "cache-infer-1"]
    second = services["agent-infer-1"]
    flags = dict(zip(second.command[1::2], second.command[2::2]))
    assert flags["--node-name"] == "infer-1" and flags["--cache-address"] == "cache-infer-1:7071"
    assert flags["--advertise-address"] == "agent-infer-1:7074"
    assert second.volumes[flags["--work-dir"]] == "agent-work-infer-1"
    assert second.volumes[flags["--checkpoint-root"]] == "checkpoints"   # shared by every agent
    assert second.depends_on["cache-infer-1"] == services["agent-infer-0"].depends_on["cache-infer-0"]  # its own cache server
    assert "agent-infer-0" not in compose.load(nodes=1, inference_nodes=0)
