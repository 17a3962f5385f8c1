"""Job SDK: what a training script uses to cooperate with silod.

    import silod.job
    ctx = silod.job.init()
    state = ctx.load_checkpoint() or {"step": 0}
    while not done:
        ...train one step...
        ctx.report(samples=n, steps=1, step_time_s=dt)      # increments, batched to the agent
        if ctx.should_checkpoint():
            ctx.save_checkpoint(state); ctx.done(); sys.exit(0)
    ctx.done()

On the cluster (``SILOD_JOB_ID`` set by the worker agent) progress goes to the node's agent
(``SILOD_AGENT_ADDR``) at most once a second, ``should_checkpoint()`` polls the agent's
directive at most once a second and is also true once SIGTERM was received, and checkpoints
live in ``SILOD_CHECKPOINT_DIR``. Once the interpreter exits, SIGTERM is ignored: a stop that
lands as the rank exits (it saw the directive first) cannot turn its exit 0 into 143. If the agent dies (its node counts as lost and the job is
requeued), ``should_checkpoint()`` turns true and ``save_checkpoint()`` stops writing, so a
rank that outlived its agent exits without overwriting its successor's checkpoints. Off the cluster, :func:`init` returns a twin with the same
API: rank 0 of 1, checkpoints in ``./checkpoints``, progress logged to stderr.

Fast resize (AFE): when the scheduler grows or shrinks the job around running ranks, the
survivors are not restarted. ``should_checkpoint()`` (or ``world_changed()``) picks up the new
world on its next poll: ``ctx.rank``, ``ctx.world_size``, ``ctx.generation`` and
``ctx.batch_size`` change, callbacks given to ``ctx.on_resize(cb)`` run with a :class:`World`
(re-form the process group there), and ``world_changed()`` returns it once. A rank the resize
removes sees ``should_checkpoint()`` true with ``ctx.leaving`` set; its ``save_checkpoint()``
writes nothing (the survivors hold the state), so it just exits 0.

Checkpoints are written atomically (temp file + rename) with ``torch.save`` when the job has
imported torch, else pickle; only rank 0 writes (the checkpoint is the job's, shared by ranks),
every rank can load. Each save also appends a line to ``checkpoints.jsonl`` next to the
checkpoint (time, generation, rank, pid and the progress counters at the save), so which
generation wrote the checkpoint in place, and what a resume starts from, can be checked later.
"""

from __future__ import annotations

from silod.job.context import ClusterContext, JobContext, LocalContext, World, init

__all__ = ["ClusterContext", "JobContext", "LocalContext", "World", "init"]
