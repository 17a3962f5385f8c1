"""How a job's placement changes reach its ranks: generations, fast (in-place) resizes, and
restarts from a checkpoint after a rank was killed.

Generations: a job's generation increments whenever its GPU set changes (including to none);
it stays when the placement is unchanged.
"""

from __future__ import annotations

from scheduler.live import convert
from scheduler.live.gpu_health import Placement
from silod.v1 import common_pb2, plan_pb2

# Exit statuses after which a job restarts from its checkpoint instead of failing.
RESTART_EXIT_CODES = {
    128 + 9: "was killed",  # SIGKILL, as the agent reports it: the OOM killer, an operator
    75: "gave up re-forming in place",  # silod.job.distributed.RESTART_EXIT_CODE (EX_TEMPFAIL)
}
MAX_CRASH_RESTARTS = 3


class CrashRestarts:
    """Jobs one of whose ranks was killed (SIGKILL: the OOM killer, an operator, a crash of the
    rank alone): restarted from their checkpoint in a new generation, a few times per job."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.waiting: set[str] = set()  # restarting: the next plan that places them starts every rank anew

    def allows(self, job_id: str, exit_code: int) -> bool:
        return exit_code in RESTART_EXIT_CODES and self.counts.get(job_id, 0) < MAX_CRASH_RESTARTS \
            and job_id not in self.waiting

    def begin(self, job_id: str) -> int:
        """Record the restart; the how-many-th it is."""
        self.counts[job_id] = self.counts.get(job_id, 0) + 1
        self.waiting.add(job_id)
        return self.counts[job_id]

    def placed(self, plan: plan_pb2.AllocationPlan) -> None:
        """A committed plan placed these jobs again: their restart is under way."""
        if self.waiting:
            self.waiting -= {entry.job_id for entry in plan.jobs if entry.job_id in self.waiting and convert.ranks_of(entry)}


def set_generation(entry: plan_pb2.JobAllocation, job: common_pb2.Job, previous: plan_pb2.JobAllocation | None,
                   *, restarting: bool, policy_afe: bool,
                   placement: Placement | None = None, previous_placement: Placement | None = None) -> None:
    """``entry.generation`` (and ``fast_resize`` where the ranks re-form in place) from the
    job's previous entry. ``placement`` and ``previous_placement``: the entries', as
    convert.placement_of would give them, where the caller has them (a round builds 5,000
    entries from placements it holds)."""
    if placement is None:
        placement = convert.placement_of(entry)
    if previous_placement is None:
        previous_placement = convert.placement_of(previous) if previous is not None else ()
    generation = previous.generation if previous is not None else 0
    if restarting and placement:
        generation += 1  # every rank again, from the checkpoint: no survivors to keep
    elif placement != previous_placement:
        generation += 1
        entry.fast_resize = fast_resize(job, previous, entry, policy_afe)
    elif job.spec.resize_in_place and previous is not None and placement \
            and entry.batch_size != previous.batch_size:
        # A retuned batch size reaches ranks that re-form in place as a resize to the same
        # GPUs: every rank switches at the same step (silod.job.distributed).
        generation += 1
        entry.fast_resize = True
    entry.generation = generation


def fast_resize(job: common_pb2.Job, previous: plan_pb2.JobAllocation | None, entry: plan_pb2.JobAllocation,
                policy_afe: bool) -> bool:
    """Survivors keep running when some ranks keep their GPUs and the ranks can re-form in
    place: jobs that say so (``resize_in_place``: silod.job's ctx.distributed() re-forms the
    process group), and the emulated job under a policy that prices resizes that way (AFE,
    DeepBoot: ``policy_afe``). Other commands get the checkpoint-and-relaunch path."""
    if previous is None:
        return False
    if not job.spec.resize_in_place and (job.spec.command or not policy_afe):
        return False
    return bool(set(convert.ranks_of(previous)) & set(convert.ranks_of(entry)))
