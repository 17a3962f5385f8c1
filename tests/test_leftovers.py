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
