"""tests/support/leftovers.py: what the suite's last step counts as left running."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.support import leftovers

ROOT = Path(__file__).resolve().parents[1]


def test_a_process_naming_the_checkout_started_during_the_run_is_found_and_killed() -> None:
    naming = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(ROOT / "marker")],
                              start_new_session=True)
    other = subprocess.Popen(["sleep", "120"], start_new_session=True)  # nothing of the checkout
    try:
        found = {leftover.pid: leftover.command for leftover in leftovers.find(ROOT)}
        assert naming.pid in found and str(ROOT / "marker") in found[naming.pid]
        assert other.pid not in found
        leftovers.kill([leftovers.Leftover(naming.pid, found[naming.pid])])
        assert naming.wait(timeout=10) == -9
        assert naming.pid not in {leftover.pid for leftover in leftovers.wait_for_none(ROOT, grace_s=0)}
    finally:
        for process in (naming, other):
            process.kill()
            process.wait(timeout=10)


def test_processes_started_before_the_run_are_not_counted() -> None:
    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(ROOT / "marker")],
                               start_new_session=True)
    try:
        time.sleep(0.05)
        # As seen from a process started after it: the one that began "the run".
        later = subprocess.run([sys.executable, "-c", (
            "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
            "from tests.support import leftovers;"
            "print([l.pid for l in leftovers.find(Path(sys.argv[1]))])"), str(ROOT)],
            capture_output=True, text=True, timeout=60, check=True)
        assert str(earlier.pid) not in later.stdout
    finally:
        earlier.kill()
        earlier.wait(timeout=10)


def test_a_namespace_left_and_a_forward_policy_not_put_back_are_named() -> None:
    before = leftovers.HostNetwork(frozenset({"theirs"}), "ACCEPT")
    assert leftovers.network_changes(before, before) == []
    after = leftovers.HostNetwork(frozenset({"theirs", "lab-h1"}), "DROP")
    changes = leftovers.network_changes(before, after)
    assert changes[0] == "network namespace 'lab-h1' left behind"
    assert "FORWARD policy is DROP, was ACCEPT" in changes[1]
    # a namespace someone else removed meanwhile, or a policy that cannot be read, is no change of the run's
    assert leftovers.network_changes(before, leftovers.HostNetwork(frozenset(), None)) == []


def test_the_host_network_is_read() -> None:
    network = leftovers.host_network()
    assert isinstance(network.namespaces, frozenset)
    assert network.forward_policy in (None, "ACCEPT", "DROP")
