"""A Unix user (and group of the same number) per job on this node, from a range the operator
configures (``job_uids``), never the agent's own.

A job keeps its number while it has ranks here. Its first choice is derived from its id, so a
job that comes back (or moves to another node with the same range) usually gets the same number
and still owns the files it left; another job holding that number here sends it to the next
free one. Numbers are only reused once no rank of their job is left on the node, and every
process of a contained rank dies with its PID namespace: a reused number finds no process
running under it.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path


class UidRangeError(ValueError):
    pass


def parse_range(text: str) -> tuple[int, int]:
    """``"START-END"`` (inclusive) -> (start, end); refused when it holds the agent's own uid,
    root's, or is not a range of positive numbers."""
    start_text, sep, end_text = text.partition("-")
    if not sep or not start_text.strip().isdigit() or not end_text.strip().isdigit():
        raise UidRangeError(f"must be START-END, e.g. 1000000-1065535; got {text!r}")
    start, end = int(start_text), int(end_text)
    if not 0 < start <= end <= 2**32 - 2:
        raise UidRangeError(f"must be 1 <= START <= END <= {2**32 - 2}; got {text!r}")
    if start <= os.geteuid() <= end:
        raise UidRangeError(f"{text!r} holds the agent's own uid {os.geteuid()}")
    import pwd

    account = next((p for p in pwd.getpwall() if start <= p.pw_uid <= end), None)
    if account is not None:  # a job would act as that account on files it owns
        raise UidRangeError(f"{text!r} holds uid {account.pw_uid} of the account {account.pw_name!r}")
    return start, end


class JobUsers:
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self._held: dict[str, int] = {}  # job id -> its uid
        self._ranks: dict[str, int] = {}  # job id -> ranks holding it

    def take(self, job_id: str) -> int:
        """The job's uid here (its ranks all share it)."""
        if job_id in self._held:
            self._ranks[job_id] += 1
            return self._held[job_id]
        size = self.end - self.start + 1
        taken = set(self._held.values())
        first = zlib.crc32(job_id.encode()) % size
        for step in range(size):
            uid = self.start + (first + step) % size
            if uid not in taken:
                self._held[job_id], self._ranks[job_id] = uid, 1
                return uid
        raise UidRangeError(f"all {size} job uids of {self.start}-{self.end} are in use on this node")

    def give_back(self, job_id: str) -> None:
        """One rank of the job has ended."""
        if job_id not in self._ranks:
            return
        self._ranks[job_id] -= 1
        if self._ranks[job_id] <= 0:
            del self._ranks[job_id], self._held[job_id]


def own_tree(path: Path, uid: int, gid: int) -> None:
    """``path`` and everything under it owned by uid:gid, the directory 0700: the job's own."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, gid)
    os.chmod(path, 0o700)
    for directory, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            os.lchown(os.path.join(directory, name), uid, gid)
