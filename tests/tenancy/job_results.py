"""What tests/tenancy/job_with_a_token.py printed in its log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MARK = "silod-test-result: "


def result_of(log_path: Path) -> dict[str, Any]:
    """The job's outcomes: the line of its rank log after :data:`MARK`."""
    log = log_path.read_text()
    line = next((line for line in log.splitlines() if line.startswith(MARK)), None)
    assert line is not None, f"the job printed no result:\n{log[-3000:]}"
    return json.loads(line[len(MARK):])
