"""A pytest plugin for scripts/gpu/checks.sh: writes the node ids pytest collected, one a line, to the file named
by $ACCO_GPU_COLLECTED, as soon as the collection ends (before any test runs), so that a step stopped at its limit
still says what it should have run; scripts/gpu/goals.py counts a collected test without a result as not run.

    PYTHONPATH=scripts/gpu ACCO_GPU_COLLECTED=FILE python -m pytest -p collected ...
"""

from __future__ import annotations

import os


def pytest_collection_finish(session) -> None:
    path = os.environ.get("ACCO_GPU_COLLECTED")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(item.nodeid + "\n" for item in session.items)
