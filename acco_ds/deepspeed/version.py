"""The DeepSpeed versions acco_ds is tested with: it patches DeepSpeed internals (register.py) and reads
private engine attributes, which move between releases."""

from __future__ import annotations

import os

from acco_ds.config import ACCOConfigError

TESTED_DEEPSPEED = ((0, 19, 8), (0, 20, 0))  # [low, high)
ALLOW_UNTESTED_ENV = "ACCO_DS_ALLOW_UNTESTED_DEEPSPEED"


def _version_tuple(text: str) -> tuple:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def check_deepspeed_version(version: str) -> None:
    """Raise unless ``version`` is in the tested range (or the override variable is set)."""
    low, high = TESTED_DEEPSPEED
    if low <= _version_tuple(version) < high or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    fmt = ".".join
    lo, hi = fmt(map(str, low)), fmt(map(str, high))
    raise ACCOConfigError(
        f"deepspeed=={version}: acco_ds patches DeepSpeed internals and is tested with DeepSpeed >= {lo} and "
        f"< {hi}. Allowed: pip install 'deepspeed>={lo},<{hi}', or set {ALLOW_UNTESTED_ENV}=1 to try "
        "this version at your own risk."
    )
