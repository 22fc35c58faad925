"""Reading DeepSpeed checkpoint files for ACCO without changing anything: presence, completeness and
lazy loading, with errors that name the file and what is wrong.

Files are loaded with ``torch.load(mmap=True)``: the tensors stay on disk until a slice of them is
read, so a rank can open every partition of a checkpoint and read only the ranges it needs.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import torch


class ACCOCheckpointError(ValueError):
    """A checkpoint ACCO cannot load here; the message says why and what to do."""


def is_complete(path: str) -> bool:
    """True when ``path`` is a non-empty file and, if it is a zip (torch's format), every member's
    bytes are inside the file (a truncated write loses the central directory or the tail)."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return False
        with open(path, "rb") as f:
            head = f.read(2)
        if head != b"PK":
            return True
        with zipfile.ZipFile(path) as z:
            end = max((i.header_offset + i.compress_size for i in z.infolist()), default=0)
        return end <= size
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def require_file(path: str, what: str, advice: str = "") -> None:
    """Raise ACCOCheckpointError naming ``path`` when it is missing or truncated."""
    if not os.path.isfile(path):
        raise ACCOCheckpointError(f"checkpoint file {path} is missing ({what}). {advice}".strip())
    if not is_complete(path):
        raise ACCOCheckpointError(
            f"checkpoint file {path} is truncated ({os.path.getsize(path)} bytes, no complete torch archive; "
            f"{what}): the save that wrote it was interrupted or the copy is incomplete. {advice}".strip()
        )


def load_lazy(path: str, what: str) -> Any:
    """``torch.load`` of a complete file with its tensors memory-mapped (read when sliced)."""
    require_file(path, what)
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, OSError, ValueError, EOFError) as err:
        raise ACCOCheckpointError(f"checkpoint file {path} cannot be read ({what}): {err}") from err
