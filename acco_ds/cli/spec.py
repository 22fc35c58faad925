"""RunSpec: everything one launched run needs, written as JSON by the parent and read by each rank.

Contract: the parent writes ``<run_dir>/spec.json``; every rank of the run reads it, trains, and
writes ``<run_dir>/rank<r>.jsonl`` (one record per optimizer step) and ``<run_dir>/rank<r>.json``
(its summary). Nothing else passes between the parent and the ranks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RunSpec:
    """One run of one contender (see ``acco_ds.cli.dsconfig`` for the contenders)."""

    name: str  # display label, e.g. 'acco', 'acco-adaptive', 'zero1'
    mode: str  # acco | dpu | sync | zero1 | zero2 | ...
    accumulation: str  # fixed | adaptive
    run_dir: str
    model: dict  # acco_ds.models.build_model's: arch (tiny|gpt2|llama; none: tiny) + config fields
    ds_config: dict = field(default_factory=dict)
    steps: int = 200  # optimizer steps (adaptive: committed steps)
    micro_batch: int = 8
    grad_accum: int = 4
    seed: int = 0
    threads: int = 1  # torch intra-op threads per rank
    corpus: str | None = None  # directory of *.py files; None: the interpreter's stdlib
    eval_windows: int = 64  # validation windows (of context+1 bytes) over all ranks
    eval_every: int = 0  # also evaluate at the start and every this many optimizer steps (0: at the end only)
    progress: bool = True  # rank 0 shows a progress bar
    slow_rank: int = -1  # this rank gets extra compute after each micro-batch (-1: none)
    slow_factor: float = 1.0  # ... calibrated so its micro-batches take slow_factor x as long
    slow_extra_s: float | None = None  # ... or exactly this many seconds per micro-batch
    data_offset: int = 0  # data-parallel rank d reads the micro-batches of rank d + data_offset
    tp: int = 1  # tensor-parallel size: ranks r with the same r // tp form one replica (same data)
    start_gate: str | None = None  # a folder shared by runs launched together: training starts ...
    gate_count: int = 0  # ... once this many ranks (of all of them) are ready (see acco_ds.cli.worker)
    save_every: int = 0  # save a checkpoint every this many optimizer steps into checkpoint_dir (0: never)
    checkpoint_dir: str | None = None  # where the saves go; a run whose folder holds one resumes from it
    keep_checkpoints: int = 2  # the newest saves kept (older ones removed after each complete save)

    def save(self) -> Path:
        path = Path(self.run_dir) / "spec.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path: str) -> RunSpec:
        return cls(**json.loads(Path(path).read_text()))

    def rank_log(self, rank: int) -> Path:
        return Path(self.run_dir) / f"rank{rank}.jsonl"

    def rank_summary(self, rank: int) -> Path:
        return Path(self.run_dir) / f"rank{rank}.json"
