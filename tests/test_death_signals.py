"""Processes that ask to die with their parent (PR_SET_PDEATHSIG): one whose parent ended before
it asked must not go on, since no signal will come (a contained rank's init so left ran its rank
on with no agent: a leak seen in CI). The contained runtime's sandbox and the demo's children."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable

import pytest

from silod import demo
from worker_agent.runtimes import sandbox


def _grandchild_says(guard: Callable[[int, int], None], *, parent_ends_first: bool) -> bytes:
    """What a grandchild writes around ``guard(parent_pid, launcher_alive)``: b"ready;", then
    b"went on" if the call returned (or what it raised). ``launcher_alive`` is the read end of a
    pipe whose write end only the parent holds, as the sandbox's launcher does. With
    ``parent_ends_first`` the parent has exited before the call; otherwise it lives a while after,
    and the grandchild waits for its death signal, writing b"outlived" if it does not come."""
    said_r, said_w = os.pipe()
    child = os.fork()
    if child == 0:  # the parent-to-be
        try:
            os.close(said_r)
            parent = os.getpid()
            alive_r, alive_w = os.pipe()
            if os.fork() == 0:  # the grandchild
                try:
                    os.close(alive_w)
                    deadline = time.monotonic() + 10
                    while parent_ends_first and os.getppid() == parent and time.monotonic() < deadline:
                        time.sleep(0.005)
                    os.write(said_w, b"ready;")
                    guard(parent, alive_r)
                    os.write(said_w, b"went on;")
                    time.sleep(10)  # the death signal ends it here when the parent ends
                    os.write(said_w, b"outlived")
                except BaseException as exc:  # noqa: BLE001  # said, not lost in the fork
                    os.write(said_w, f"raised {exc!r}".encode())
                finally:
                    os._exit(0)
            os.close(alive_r)
            if not parent_ends_first:
                time.sleep(1)  # the grandchild has called the guard by now
        finally:
            os._exit(0)
    os.close(said_w)
    os.waitpid(child, 0)
    said = b""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([said_r], [], [], 0.5)
        if ready:
            chunk = os.read(said_r, 128)
            if not chunk:  # every writer gone: the grandchild has ended
                break
            said += chunk
    os.close(said_r)
    return said


def _die_with(parent: int, launcher_alive: int) -> None:
    sandbox._die_with(parent)


def _die_with_launcher(parent: int, launcher_alive: int) -> None:
    sandbox._die_with_launcher(launcher_alive)


def _demo_child(parent: int, launcher_alive: int) -> None:
    demo._stop_with_parent(parent)


GUARDS = pytest.mark.parametrize("guard", [_die_with, _die_with_launcher, _demo_child],
                                 ids=["sandbox-by-parent-pid", "sandbox-by-launcher-pipe", "demo-child"])


@GUARDS
def test_a_process_whose_parent_ended_before_it_set_its_death_signal_exits_at_once(guard) -> None:  # type: ignore[no-untyped-def]
    assert _grandchild_says(guard, parent_ends_first=True) == b"ready;"


@GUARDS
def test_a_process_whose_parent_lives_goes_on_and_is_killed_as_the_parent_ends(guard) -> None:  # type: ignore[no-untyped-def]
    assert _grandchild_says(guard, parent_ends_first=False) == b"ready;went on;"
