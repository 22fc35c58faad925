"""The launches shared by tests/checkpoint/test_reshard.py and tests/checkpoint/test_universal.py (run once
per test session, see :func:`runs`): five ``deepspeed`` launches of ``ckpt_reshard_worker.py`` on 1, 3,
2, 1 and 3 ranks, and two ``ds_to_universal.py`` conversions between them.

Re-sharding (``CASES``): each case saves an ACCO checkpoint on its ``source`` world size after
``save_micro`` micro-batches and is resumed on each of its ``targets`` (job ``<case>@<target>``).

DeepSpeed's ZeRO-1 AdamW checkpoint ``z1`` (1 rank) is also loaded directly, without conversion
(``acco_from_z1_files``, ACCO dpu on 3 ranks). Universal checkpoints, both ways between DeepSpeed's
ZeRO-1 AdamW and ACCO:
``z1`` (ZeRO-1 AdamW, 1 rank) saves -> ``ds_to_universal.py --inject_missing_state`` ->
``acco_from_z1`` (ACCO acco mode, 3 ranks, ``load_universal``) trains on and saves -> ``ds_to_universal.py``
(no flag: ACCO's checkpoints carry ``universal_checkpoint_info``) -> ``z1_from_acco`` (ZeRO-1 AdamW,
2 ranks) and ``acco_from_acco`` (ACCO sync, 2 ranks) load it and train on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from filelock import FileLock

from tests.ranks.launch import REPO, rank_env, run_local

GAS, STEPS, SAVE = 4, 5, 2
PAIRS = ((2, 1), (2, 3), (3, 2), (1, 2))
MODES = ("sync", "dpu", "acco")
WORLD_OF_LAUNCH = (1, 3, 2, 1, 3)
SAVE_LAUNCH = {1: 0, 3: 1, 2: 2}
RESUME_LAUNCH = {2: 2, 1: 3, 3: 4}
WORKER = REPO / "tests" / "ranks" / "ckpt_reshard_worker.py"


def _case(
    name, mode, source, targets, dtype="fp32", save_micro=SAVE * GAS, resume_gas=GAS, accumulation="fixed"
):
    return {
        "name": name,
        "mode": mode,
        "accumulation": accumulation,
        "dtype": dtype,
        "source": source,
        "targets": list(targets),
        "save_micro": save_micro,
        "resume_gas": resume_gas,
    }


def cases() -> list:
    out = []
    for source in (1, 2, 3):
        targets = [t for s, t in PAIRS if s == source]
        out += [_case(f"{mode}_w{source}", mode, source, targets) for mode in MODES]
    mid = SAVE * GAS
    out += [
        _case("acco_bf16_w2", "acco", 2, [1], dtype="bf16"),
        # inside a step: a commit in flight, the model at the estimate, 1 micro-batch of g~ accumulated
        _case("acco_midcommit_w2", "acco", 2, [1, 3], save_micro=mid + 1),
        # inside a step: a peek in flight (its g~ kept for the commit), 1 micro-batch of g accumulated
        _case("acco_midpeek_w2", "acco", 2, [1, 3], save_micro=mid + GAS // 2 + 1),
        # inside a step: a commit in flight, the model at the previous commit, 1 micro-batch accumulated
        _case("dpu_mid_w2", "dpu", 2, [3], save_micro=mid + 1),
        # the resumed run keeps the global batch: 2 ranks x GAS 4 -> 1 rank x GAS 8
        _case("acco_gas8_w2", "acco", 2, [1], resume_gas=2 * GAS),
        # adaptive accumulation (rounds end where the communication is done: no equations to compare with)
        _case("acco_adaptive_w2", "acco", 2, [1], accumulation="adaptive"),
    ]
    return out


CASES = cases()


def jobs(out: Path) -> list:
    result = []
    for c in CASES:
        ckpt = str(out / "ckpt" / c["name"])
        common = {
            "optimizer": "ACCO",
            "mode": c["mode"],
            "accumulation": c["accumulation"],
            "dtype": c["dtype"],
            "steps": STEPS,
            "ckpt": ckpt,
            "tag": "mid",
        }
        result.append(
            {**common, "kind": "save", "name": c["name"], "launch": SAVE_LAUNCH[c["source"]], "gas": GAS,
             "save_micro": c["save_micro"]}
        )  # fmt: skip
        for t in c["targets"]:
            result.append(
                {**common, "kind": "resume", "name": f"{c['name']}@{t}", "launch": RESUME_LAUNCH[t],
                 "gas": c["resume_gas"], "start_micro": c["save_micro"]}
            )  # fmt: skip
    z1, a3 = str(out / "uni_z1"), str(out / "uni_a3")
    result += [
        {"kind": "save", "name": "z1", "launch": 0, "optimizer": "AdamW", "gas": GAS, "steps": STEPS,
         "save_micro": SAVE * GAS, "ckpt": z1, "tag": "z1"},
        # no conversion: ACCO reads DeepSpeed's ZeRO-1 files directly, on another world size
        {"kind": "resume", "name": "acco_from_z1_files", "launch": 1, "optimizer": "ACCO", "mode": "dpu",
         "gas": GAS, "steps": STEPS, "start_micro": SAVE * GAS, "ckpt": z1, "tag": "z1"},
        {"kind": "resume", "name": "acco_from_z1", "launch": 1, "optimizer": "ACCO", "mode": "acco", "universal": True,
         "gas": GAS, "steps": STEPS, "start_micro": SAVE * GAS, "ckpt": z1, "save_to": [a3, "a3"]},
        # DeepSpeed's own universal load leaves frozen parameters as the model was built (seed 0 here, as a
        # user's model brings them); ACCO restores them from the universal checkpoint
        {"kind": "resume", "name": "z1_from_acco", "launch": 2, "optimizer": "AdamW", "universal": True,
         "gas": GAS, "steps": STEPS + 1, "start_micro": STEPS * GAS, "ckpt": a3, "seed": 0},
        {"kind": "resume", "name": "acco_from_acco", "launch": 2, "optimizer": "ACCO", "mode": "sync",
         "universal": True, "gas": GAS, "steps": STEPS + 1, "start_micro": STEPS * GAS, "ckpt": a3},
    ]  # fmt: skip
    return result


def to_universal(folder: Path, tag: str, inject: bool) -> subprocess.CompletedProcess:
    """``python -m deepspeed.checkpoint.ds_to_universal`` as a user types it; writes ``latest_universal``."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(folder / tag),
           "--output_folder", str(folder / f"{tag}_universal")] + (["--inject_missing_state"] if inject else [])  # fmt: skip
    proc = subprocess.run(cmd, env=rank_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc


_RUNS: dict = {}


def shared_base(base: Path) -> Path:
    """The folder the runs go in: ``base`` (pytest's temporary folder of this process), or, under pytest-xdist
    workers (``PYTEST_XDIST_WORKER`` set; ``base`` is then ``<session root>/popen-gw<N>``), the session root
    every worker shares, so the two test files that read the runs launch them once between them."""
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def runs(base: Path) -> dict:
    """Run everything once per test session (under ``shared_base(base)``; a file lock makes the other workers
    wait for the first and then read its records); returns {"out": folder, "jobs": {name: [record per rank]},
    "cases": CASES, "world": {name: world size}}."""
    if _RUNS:
        return _RUNS
    out = shared_base(base) / "ckpt_runs"
    out.mkdir(parents=True, exist_ok=True)
    all_jobs = jobs(out)
    done = out / "records.pt"
    with FileLock(str(out / ".lock")):
        if done.exists():
            records = torch.load(done, weights_only=False)
        else:
            records = _launch_all(out, all_jobs)
            torch.save(records, out / "records.pt.tmp")
            (out / "records.pt.tmp").replace(done)
    world = {j["name"]: WORLD_OF_LAUNCH[j["launch"]] for j in all_jobs}
    _RUNS.update(out=out, jobs=records, cases=CASES, world=world, spec={j["name"]: j for j in all_jobs})
    return _RUNS


def _launch_all(out: Path, all_jobs: list) -> dict:
    """The five launches and the two conversions; {job name: [record per rank]}."""
    spec = out / "jobs.json"
    spec.write_text(json.dumps(all_jobs))
    records: dict = {}
    for launch, world in enumerate(WORLD_OF_LAUNCH):
        run_local(WORKER, world, ["--jobs", spec, "--out", out, "--launch_index", launch])
        per_rank = torch.load(out / f"launch{launch}.pt", weights_only=False)
        for name in per_rank[0]:
            records[name] = [r[name] for r in per_rank]
        if launch == 0:
            to_universal(out / "uni_z1", "z1", inject=True)
        if launch == 1:
            to_universal(out / "uni_a3", "a3", inject=False)
    return records
