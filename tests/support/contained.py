"""What contained ranks may read in the suite's clusters.

As root (the suite's user) an agent contains its ranks by default: a rank sees the system
directories, the interpreter and silod, and what ``--contained-read-paths`` names. The suite's
default (tests/conftest.py, SILOD_CONTAINED_READ_PATHS) is the repository's examples, tests and
benchmarks; a test whose ranks read data or code of its own (a ``file://`` store in its temporary
directory, a script it wrote) names it with :func:`readable`.
"""

from __future__ import annotations

import os
from pathlib import Path


def readable(*paths: Path | str) -> list[str]:
    """Agent flags letting contained ranks read ``paths`` besides the suite's default."""
    default = [p for p in os.environ.get("SILOD_CONTAINED_READ_PATHS", "").split(",") if p]
    return ["--contained-read-paths", ",".join([*default, *(str(p) for p in paths)])]
