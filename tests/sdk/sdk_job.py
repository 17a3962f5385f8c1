"""A training job's data loop, run as its own process by the tests (as a real job would be):

    python -m tests.sdk.sdk_job --dataset NAME [--cache ADDR] --metadata ADDR [--job ID]
        [--epochs N] [--batch B] [--workers W] [--pause-after K --pause-file F --resume-file R]

Reads every epoch through SilodDataset + EpochShuffleSampler + a torch DataLoader (forked
workers) and prints one JSON line: the sorted sha256 digests of the samples of each epoch and
the loader's counters. With --pause-after it writes F after K batches of the first epoch and
waits for R (the test kills the cache server in between). Logs go to stderr.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import logging
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--cache", default="")
    parser.add_argument("--metadata", required=True)
    parser.add_argument("--job", default="job")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pause-after", type=int, default=-1)
    parser.add_argument("--pause-file", default="")
    parser.add_argument("--resume-file", default="")
    args = parser.parse_args()
    # Never hang a test run; show where it is stuck. (Only here: calling it again in a forked
    # worker deadlocks on the watchdog lock the fork copied.)
    faulthandler.dump_traceback_later(55, exit=True)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")

    print("job: starting", file=sys.stderr, flush=True)
    import torch.utils.data

    from silod.data import EpochShuffleSampler, SilodDataset

    dataset = SilodDataset(args.dataset, cache_addr=args.cache, metadata_addr=args.metadata, job_id=args.job,
                           retry_cache_after_s=3600)
    print(f"job: manifest of {len(dataset)} objects loaded", file=sys.stderr, flush=True)
    sampler = EpochShuffleSampler(dataset, seed=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                                         collate_fn=list, multiprocessing_context="fork" if args.workers else None,
                                         timeout=60 if args.workers else 0)
    epochs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        digests = []
        for i, batch in enumerate(loader):
            digests.extend(hashlib.sha256(sample).hexdigest() for sample in batch)
            print(f"job: epoch {epoch} batch {i}", file=sys.stderr, flush=True)
            if epoch == 0 and i == args.pause_after:
                with open(args.pause_file, "w") as f:
                    f.write("paused")
                while not os.path.exists(args.resume_file):
                    time.sleep(0.02)
        epochs.append(sorted(digests))
    print(json.dumps({"epochs": epochs, "main_counters": dict(dataset.counters)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
