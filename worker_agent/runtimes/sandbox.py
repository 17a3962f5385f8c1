"""Put the calling process's future rank in a sandbox of its own (Linux, as root).

    python -S .../worker_agent/runtimes/sandbox.py AGENT_PID CONFIG_FILE

Standard library only, and importable by path: the contained runtime starts it cold with ``-S``
(no site packages: fast), and a warm process (worker_agent.warm_process) calls :func:`contain`
with the same configuration before it becomes the rank.

:func:`contain` turns the caller into three processes:

* the **launcher** (the caller, in the host's namespaces, root): it has joined the rank's
  cgroups, waits for the init below and exits with its status; it ignores SIGTERM (its process
  group gets the agent's signals, which the rank handles) and dies with the agent
  (PR_SET_PDEATHSIG);
* an **init**, pid 1 of a new PID namespace, with a mount and an IPC namespace of its own: it
  builds the rank's root (below), forks the rank and reaps whatever is left until the rank has
  ended, then exits with the rank's status; it stays root and dies with the launcher. When it exits,
  or is killed with the launcher, the kernel kills every process of the namespace: nothing a
  rank starts outlives it;
* the **rank**: :func:`contain` returns in it, in the new root, as the job's uid and gid, with
  no capabilities and PR_SET_NO_NEW_PRIVS set.

The rank's root is a small tmpfs holding only what the configuration names: system directories
and the interpreter read-only, its own work and checkpoint directories read-write (at
``/silod/work`` and ``/silod/checkpoint``: the way to them crosses nothing of the host), a fresh
``/proc`` (its own processes only), a ``/dev`` of the harmless devices and its own GPUs, a
private ``/tmp`` and ``/dev/shm``, ``/sys`` read-only, and an ``/etc/passwd`` that names its
user. Nothing else of the host is there: not the agent's work directory, not other jobs'
directories, not credential files.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# Devices every rank may open; GPUs are added per rank.
BASE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SandboxError(f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                       ctypes.c_ulong(flags), data and data.encode()), f"mount {source or fstype} on {target}")


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def _inside(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _bind(root: str, source: str, *, at: str = "", writable: bool = False, device: bool = False) -> None:
    """``source`` under ``root`` at its own path (or ``at``): read-only unless ``writable``, never
    setuid, and device nodes usable only where ``device``."""
    if not os.path.lexists(source):
        return
    target = _inside(root, at or source)
    if os.path.islink(source):  # /bin -> usr/bin on merged-/usr systems: the same link
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            with open(target, "w"):
                pass
    _mount(source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    _mount(None, target, None, flags)


def _build_root(config: dict) -> None:
    root = config["root"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m")
    # The private /tmp first: what is bound below may lie under /tmp on the host.
    os.makedirs(_inside(root, "tmp"))
    _mount("tmpfs", _inside(root, "tmp"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    # Parents before children: a directory bound later inside an earlier one stays visible.
    for path in sorted(set(config.get("read_only", ())), key=len):
        _bind(root, path)
    for path in config.get("hide", ()):  # the agent's own directories, should a read path hold them
        inside = _inside(root, path)
        if os.path.isdir(inside):
            _mount("tmpfs", inside, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755,size=64k")
    for source, at in config.get("read_write", {}).items():  # at paths of their own: no host path to pass
        _bind(root, source, at=at, writable=True)
    dev = _inside(root, "/dev")
    os.makedirs(dev, exist_ok=True)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for device in (*BASE_DEVICES, *config.get("devices", ())):
        if os.path.exists(device) and stat.S_ISCHR(os.stat(device).st_mode):
            _bind(root, device, writable=True, device=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(dev, name))
    shm = os.path.join(dev, "shm")
    os.makedirs(shm)
    _mount("tmpfs", shm, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    os.makedirs(_inside(root, "proc"), exist_ok=True)
    _mount("proc", _inside(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name, source in config.get("files", {}).items():  # /etc/passwd naming the job's user, ...
        target = _inside(root, name)
        if os.path.exists(target):
            _mount(source, target, None, MS_BIND)
            _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _pivot(root: str) -> None:
    old = os.path.join(root, ".host")
    os.makedirs(old)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SandboxError(f"pivot_root: unknown system call number on {os.uname().machine}")
    _check(_libc.syscall(number, root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/.host", MNT_DETACH), "umount the host's root")
    os.rmdir("/.host")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _status(wait_status: int) -> int:
    """A wait status as a shell's exit status (128 + N for signal N)."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _reap_until(pid: int) -> int:
    """Wait for every child until ``pid`` has ended (an init reaps orphans); its exit status."""
    while True:
        try:
            child, wait_status = os.wait()
        except ChildProcessError:
            return 127
        if child == pid:
            return _status(wait_status)


def _ignore(*_: object) -> None:
    pass


HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _die_with(parent: int) -> None:
    """Be killed when ``parent`` ends; exit now if it already has. It may have ended between the
    fork and the prctl, before the death signal was set: the signal never comes then, and a process
    left so would go on with no agent to stop it."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(137)


def _die_with_launcher(launcher_alive: int) -> None:
    """The init's :func:`_die_with`: its parent, the launcher, is outside its PID namespace, so
    getppid() says 0 whether the launcher lives or not. ``launcher_alive`` is the read end of a
    pipe whose write end only the launcher holds: at end of file, the launcher has ended (seen: an
    init left so ran its rank on after its agent was stopped while launching it)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    readable, _, _ = select.select([launcher_alive], [], [], 0)
    if readable:  # nothing is ever written: readable means the write end is closed
        os._exit(137)
    os.close(launcher_alive)


def contain(config: dict) -> None:
    """Returns in the rank, contained (see the module's docstring); the caller and the init it
    starts never return: they exit with the rank's status."""
    _die_with(int(config["agent_pid"]))
    for cgroup in config.get("cgroups", ()):
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC), "unshare")
    for sig in HANDLED:  # a handler, not SIG_IGN: the children must not inherit an ignored signal
        signal.signal(sig, _ignore)
    launcher_alive, held_by_launcher = os.pipe()
    init = os.fork()
    if init:
        os.close(launcher_alive)
        os._exit(_reap_until(init))  # held_by_launcher stays open until this exit
    # The init: pid 1 of the new namespace.
    os.close(held_by_launcher)
    _die_with_launcher(launcher_alive)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _build_root(config)
    _pivot(config["root"])
    # The init stays root: a change of user would clear its death signal (prctl(2)), and the
    # rank's user can neither signal nor trace a process of root's.
    rank = os.fork()
    if rank:
        os._exit(_reap_until(rank))
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_DFL)
    gid, uid = int(config["gid"]), int(config["uid"])
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the change of user, which clears it
    # The change of user also made the process undumpable: its /proc files root's, unreadable to
    # itself. An exec would undo that; a warm process goes on without one.
    _prctl(PR_SET_DUMPABLE, 1)
    os.chdir(config["cwd"])


def main() -> None:
    config_path = sys.argv[2]
    with open(config_path) as f:
        config = json.load(f)
    os.unlink(config_path)  # it holds the rank's environment, its job credential included
    config["agent_pid"] = int(sys.argv[1])
    command = config["command"]
    try:
        contain(config)
    except (SandboxError, OSError) as exc:
        print(f"--- silod: cannot contain the rank: {exc}", flush=True)
        os._exit(127)
    try:
        os.execvpe(command[0], command, config["env"])
    except OSError as exc:
        print(f"--- silod: cannot launch {command!r}: {exc}", flush=True)
        os._exit(127)


if __name__ == "__main__":
    main()
