"""The default corpus: the Python standard library source of the running interpreter, as bytes.

Contract:
- ``load_corpus()`` reads ``Lib/*.py`` (top level of ``sysconfig.get_paths()["stdlib"]``) in sorted
  file-name order, joins the files with a NUL separator and returns a ``Corpus`` of uint8 tensors.
  Nothing is downloaded; the same interpreter gives the same bytes.
- The train/validation split is fixed and deterministic: the joined stream is cut into blocks of
  ``BLOCK`` bytes and every ``VAL_EVERY``-th block (indices VAL_EVERY-1, 2*VAL_EVERY-1, ...) goes
  to validation, the rest to training (5% validation, spread over the whole library).
- Tokens are bytes (vocabulary 256); ``tokenize``/``detokenize`` are the identity on bytes.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

BLOCK = 4096
VAL_EVERY = 20
VOCAB = 256


@dataclass(frozen=True)
class Corpus:
    """Byte tokens of the split corpus, plus where it came from."""

    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    source: str
    files: int
    sha256: str  # of the joined bytes before the split

    def describe(self) -> dict:
        return {
            "source": self.source,
            "files": self.files,
            "train_bytes": int(self.train.numel()),
            "val_bytes": int(self.val.numel()),
            "sha256": self.sha256,
        }


def stdlib_dir() -> Path:
    """Directory of the running interpreter's standard library (``Lib/``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def tokenize(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as uint8 tokens."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()


def detokenize(tokens: torch.Tensor) -> str:
    """Inverse of ``tokenize`` (invalid UTF-8 is replaced)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def split_blocks(data: torch.Tensor, block: int = BLOCK, val_every: int = VAL_EVERY):
    """Deterministic split of a 1-D tensor: every ``val_every``-th block of ``block`` items is
    validation. Returns (train, val)."""
    if block < 1 or val_every < 2:
        raise ValueError(f"block must be >= 1 and val_every >= 2, got block={block}, val_every={val_every}")
    n_blocks = (data.numel() + block - 1) // block
    is_val = torch.zeros(n_blocks, dtype=torch.bool)
    is_val[val_every - 1 :: val_every] = True
    mask = is_val.repeat_interleave(block)[: data.numel()]
    return data[~mask].contiguous(), data[mask].contiguous()


def load_corpus(root: Path | None = None) -> Corpus:
    """Read and split the standard library sources (or ``root/*.py`` when given)."""
    root = Path(root) if root is not None else stdlib_dir()
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(
            f"no *.py files under {root}: the default corpus needs the Python standard library sources "
            "(some minimal installs strip them); install the full interpreter or pass --corpus DIR."
        )
    joined = b"\0".join(f.read_bytes() for f in files)
    data = torch.frombuffer(bytearray(joined), dtype=torch.uint8).clone()
    train, val = split_blocks(data)
    return Corpus(
        train=train, val=val, source=str(root), files=len(files), sha256=hashlib.sha256(joined).hexdigest()
    )
