"""Cache tiers: a directory of object files with a capacity and a journal (memory tier on tmpfs,
disk tier on local disk; the same code serves both, so both hand out plain file paths).

Layout of a tier directory::

    .lock                 flock held by the serving process (two servers cannot share a tier)
    journal.jsonl         one JSON line per change: {"op": "put", ...} / {"op": "del", "f": NAME}
    objects/ab/abcdef...  object files, named by sha256(dataset NUL key NUL etag)[:40]
    tmp/                  files being written (removed at start)

Writes are atomic: data goes to ``tmp/``, is fsynced and renamed into ``objects/``; the
journal line follows the rename. A crash leaves at worst an object file without a journal
line (an orphan, deleted at the next start) or a journal line whose file is gone (dropped).

Verification: the journal keeps each object's size, sha256 (of the bytes fetched and checked
against the manifest's version tag) and the file's mtime. At start the tier is re-indexed:
entries whose file is missing or has another size or mtime are dropped, the rest are marked
unverified; an unverified entry's sha256 is checked before it is first served (and by a
background scrub), and a mismatch drops it (the object is fetched again). While serving, a
file whose size or mtime changed (someone wrote to it) is dropped at its next lease.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

_READ_CHUNK = 1 << 20
JOURNAL_FLUSH_S = 0.5


@dataclass(eq=False)
class Entry:
    """One cached object version in one tier."""

    dataset: str
    key: str
    etag: str
    size: int
    tier: Tier
    name: str
    sha256: str
    mtime_ns: int
    verified: bool = True
    pins: int = 0  # leases and reads using the file now; a pinned entry is never deleted
    doomed: bool = False  # evicted while pinned: delete when the last pin goes
    deleted: bool = False  # file removed and tier space given back
    partition: Any = None
    # policy bookkeeping (lrfu-cost)
    crf: float = 0.0
    last_access: float = 0.0
    cost_s: float = 0.0
    heap_key: float = 0.0
    path: str = field(default="")

    def __post_init__(self) -> None:
        if not self.path:
            self.path = self.tier.path_of(self.name)


class TierLocked(RuntimeError):
    """Another process serves this tier directory."""


def entry_name(dataset: str, key: str, etag: str) -> str:
    return hashlib.sha256(f"{dataset}\0{key}\0{etag}".encode("utf-8", "surrogatepass")).hexdigest()[:40]


class Tier:
    """A directory holding up to ``capacity`` bytes of objects. Not thread-safe for bookkeeping
    (``used``, journal): the cache core calls those from its event loop; the blocking file work
    (:meth:`write`, :meth:`verify`, :meth:`load`) runs in worker threads."""

    def __init__(self, name: str, root: str, capacity: int, *, fsync: bool = True) -> None:
        self.name = name
        self.root = os.path.abspath(root)
        self.capacity = int(capacity)
        self.fsync = fsync
        self.used = 0  # bytes of entries plus reservations of writes in flight
        self.writing = 0  # of which: writes in flight (not yet readable)
        self.hits = 0
        self.misses = 0
        self.full_until = 0.0  # after ENOSPC: no writes until this monotonic time
        self._objects = os.path.join(self.root, "objects")
        self._tmp = os.path.join(self.root, "tmp")
        self._journal_path = os.path.join(self.root, "journal.jsonl")
        self._journal: Any = None
        self._journal_lines = 0
        self._flushed_at = 0.0
        self._lock_fd: int | None = None

    # -- lifecycle (blocking) ----------------------------------------------------------------

    def open(self) -> list[Entry]:
        """Lock the directory, clean it and re-index what a predecessor left; returns the entries.

        Readers on this host open leased objects by path, and may run as other users (contained
        ranks): the directories let them through (0711) without letting them list what is cached,
        and the journal, which names every object, is the server's alone (0600)."""
        os.makedirs(self._objects, exist_ok=True)
        for directory in (self.root, self._objects):
            os.chmod(directory, 0o711)
        self._lock_fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise TierLocked(f"{self.root} is in use by another cache server") from None
        shutil.rmtree(self._tmp, ignore_errors=True)
        os.makedirs(self._tmp, mode=0o700, exist_ok=True)
        entries = self._reindex()
        self._rewrite_journal(entries)
        self._journal = _append_private(self._journal_path)
        self.used = sum(e.size for e in entries)
        return entries

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _reindex(self) -> list[Entry]:
        live: dict[str, dict[str, Any]] = {}
        try:
            with open(self._journal_path, encoding="utf-8") as journal:
                for line in journal:
                    try:
                        record = json.loads(line)
                        if record["op"] == "put":
                            live[record["f"]] = record
                        elif record["op"] == "del":
                            live.pop(record["f"], None)
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line after a crash
        except FileNotFoundError:
            pass
        entries: list[Entry] = []
        seen: set[str] = set()
        for name, rec in live.items():
            path = self.path_of(name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if st.st_size != rec["s"] or st.st_mtime_ns != rec["m"]:
                _unlink(path)
                continue
            seen.add(name)
            entries.append(
                Entry(rec["d"], rec["k"], rec["e"], rec["s"], self, name, rec["h"], rec["m"], verified=False)
            )
        # Orphans: files without a journal line (crash between rename and journal write).
        for sub in os.listdir(self._objects):
            subdir = os.path.join(self._objects, sub)
            if not os.path.isdir(subdir):
                _unlink(subdir)
                continue
            os.chmod(subdir, 0o711)
            for name in os.listdir(subdir):
                if name not in seen:
                    _unlink(os.path.join(subdir, name))
        return entries

    def _rewrite_journal(self, entries: list[Entry]) -> None:
        tmp = self._journal_path + ".tmp"
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as out:
            for entry in entries:
                out.write(_put_line(entry))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self._journal_path)
        self._journal_lines = len(entries)

    # -- files (blocking; worker threads) -------------------------------------------------------

    def path_of(self, name: str) -> str:
        return os.path.join(self._objects, name[:2], name)

    def write(self, name: str, data: bytes) -> tuple[str, int]:
        """Write ``data`` atomically as object ``name``; returns (sha256, mtime_ns). Raises OSError."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.path_of(name)
        tmp = os.path.join(self._tmp, f"{name}.{os.getpid()}.{id(data):x}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        try:
            try:
                os.replace(tmp, path)
            except FileNotFoundError:  # the first object of its subdirectory (cheaper than makedirs each time)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.chmod(os.path.dirname(path), 0o711)  # passable, not listable (see open)
                os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        return digest, os.stat(path).st_mtime_ns

    def verify(self, entry: Entry) -> bool:
        """True if the file still has the size and sha256 recorded when it was cached."""
        try:
            st = os.stat(entry.path)
            if st.st_size != entry.size:
                return False
            digest = hashlib.sha256()
            with open(entry.path, "rb") as f:
                while chunk := f.read(_READ_CHUNK):
                    digest.update(chunk)
        except OSError:
            return False
        if digest.hexdigest() != entry.sha256:
            return False
        entry.mtime_ns = st.st_mtime_ns
        return True

    def unlink(self, entry: Entry) -> None:
        _unlink(entry.path)

    # -- journal (event loop) --------------------------------------------------------------------

    def journal_put(self, entry: Entry) -> None:
        self._append(_put_line(entry))

    def journal_del(self, entry: Entry) -> None:
        self._append(json.dumps({"op": "del", "f": entry.name}) + "\n")

    def _append(self, line: str) -> None:
        if self._journal is None:
            return
        try:
            self._journal.write(line)
            self._journal_lines += 1
            # Flushed at most every JOURNAL_FLUSH_S (and by flush_journal, which the cache core
            # calls every second): a flush per admission cost more than the admission. A line
            # lost in a crash is what the layout above already tolerates (an orphan file is
            # deleted at start, a line whose file is gone is dropped).
            now = time.monotonic()
            if now - self._flushed_at >= JOURNAL_FLUSH_S:
                self._journal.flush()
                self._flushed_at = now
        except OSError:
            pass  # a full disk: the next start re-indexes from the files that survive

    def flush_journal(self) -> None:
        if self._journal is None:
            return
        try:
            self._journal.flush()
        except OSError:
            pass
        self._flushed_at = time.monotonic()

    def journal_needs_compaction(self, live_entries: int) -> bool:
        return self._journal_lines > 100_000 and self._journal_lines > 4 * live_entries

    def compact(self, entries: list[Entry]) -> None:
        """Rewrite the journal from ``entries`` (blocking; call with the loop's snapshot)."""
        if self._journal is not None:
            self._journal.close()
        self._rewrite_journal(entries)
        self._journal = _append_private(self._journal_path)

    # -- capacity ----------------------------------------------------------------------------------

    def free(self) -> int:
        return self.capacity - self.used


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _put_line(entry: Entry) -> str:
    return (
        json.dumps(
            {
                "op": "put",
                "f": entry.name,
                "d": entry.dataset,
                "k": entry.key,
                "e": entry.etag,
                "s": entry.size,
                "h": entry.sha256,
                "m": entry.mtime_ns,
            }
        )
        + "\n"
    )


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _append_private(path: str) -> Any:
    """``path`` opened for appending, readable by this process's user only."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)  # a journal a predecessor left readable
    return os.fdopen(fd, "a", encoding="utf-8")
