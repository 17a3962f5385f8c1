"""An unmodified torchrun-style script (init_process_group("env://"), one gloo all_reduce) runs
as a 4-rank job on a 2-node x 2-GPU cluster: every rank gets torchrun's variables and rank 0's
node is the rendezvous (tests/scheduler_live/test_master_ports.py: ports never collide)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from silod.v1 import common_pb2, scheduler_pb2

SCRIPT = r'''
import json, os
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
print("torchrun-env " + json.dumps({**{k: os.environ[k] for k in keys}, "sum": value.item(),
                                    "world": dist.get_world_size(), "omp": os.environ.get("OMP_NUM_THREADS"),
                                    "threads": torch.get_num_threads()}), flush=True)
dist.barrier()
dist.destroy_process_group()
'''


def _runs(cluster, job_id: str) -> list[dict]:  # type: ignore[no-untyped-def]
    found = []
    for agent in cluster.agents.values():
        for log in sorted((agent.work_dir / "jobs" / job_id).glob("rank-*.log")):
            for line in log.read_text().splitlines():
                if line.startswith("torchrun-env "):
                    found.append({**json.loads(line.split(" ", 1)[1]), "node": agent.name})
    return found


def test_an_unmodified_env_rendezvous_script_runs_as_a_four_rank_job(make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    scripts = tmp_path / "scripts"
    scripts.mkdir(mode=0o755)  # job code contained ranks may read (tmp_path itself is the test's, 0700)
    script = scripts / "allreduce.py"
    script.write_text(SCRIPT)
    cluster = make_cluster("sqlite", nodes=2, gpus_per_node=2, read_paths=(scripts,))
    ids = []
    for name, gpus in (("four", 4), ("two-a", 1), ("two-b", 1)):
        spec = common_pb2.JobSpec(name=name, min_gpus=gpus, max_gpus=gpus, batch_size=8, sample_budget=8,
                                  command=[sys.executable, str(script)])
        ids.append(cluster.jobs.SubmitJob(scheduler_pb2.SubmitJobRequest(spec=spec), timeout=30).id)
    done = cluster.wait_terminal(ids, timeout=180)
    for job_id in ids:
        assert done[job_id].state == common_pb2.JOB_STATE_SUCCEEDED, done[job_id].message

    four = sorted(_runs(cluster, ids[0]), key=lambda r: int(r["RANK"]))
    assert [int(r["RANK"]) for r in four] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["WORLD_SIZE"] == "4" and r["sum"] == 10.0 for r in four)
    assert {r["MASTER_ADDR"] for r in four} == {"127.0.0.1"} and len({r["MASTER_PORT"] for r in four}) == 1
    # Ranks fill a node, then the next: local ranks and node (group) ranks as torchrun numbers them.
    assert [(r["node"], r["GROUP_RANK"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) for r in four] == [
        (four[0]["node"], "0", "0", "2"), (four[0]["node"], "0", "1", "2"),
        (four[2]["node"], "1", "0", "2"), (four[2]["node"], "1", "1", "2")]
    assert four[0]["node"] != four[2]["node"]
    # As torchrun: ranks that share a node get one intra-op thread each unless the job says otherwise.
    assert all(r["omp"] == "1" and r["threads"] == 1 for r in four)
