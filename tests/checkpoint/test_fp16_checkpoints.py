"""fp16 checkpoints (docs/ALGORITHM.md, "fp16: loss scaling", Checkpoints), ranks started as the deepspeed launcher
starts them (tests/ranks/fp16_ckpt_worker.py; the loss scaler moves: planted overflows, a window of 2):

- a save and a resume in new processes end bit for bit where the uninterrupted run ends, in sync, dpu and acco, at a
  boundary and inside an acco step (its peek in flight): parameters after every step, the loss scale after every
  step, the skipped steps;
- a DeepSpeed ZeRO-1 fp16 AdamW checkpoint loads into ACCO with its loss scaler (scale, hysteresis, iteration
  counters), on the same world size and on another; ACCO's checkpoint loads into ZeRO-1 fp16 with ACCO's scaler."""

from __future__ import annotations

import pytest
import torch

from tests.ranks.ckpt_runs import to_universal
from tests.ranks.fp16_ckpt_worker import SAVES
from tests.ranks.launch import REPO, rank_env, run_local

pytestmark = pytest.mark.launcher

WORKER = REPO / "tests" / "ranks" / "fp16_ckpt_worker.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt, out = tmp_path_factory.mktemp("fp16_ckpt"), tmp_path_factory.mktemp("fp16_out")
    got = {}
    for phase, world in (("first", 2), ("resume", 2), ("back", 2), ("other_world", 1)):
        if phase == "back":
            to_universal(ckpt, "z1", inject=True)
            to_universal(ckpt, "acco_to_z1", inject=False)
        run_local(WORKER, world, ["--phase", phase, "--ckpt", ckpt, "--out", out], env=rank_env())
        got.update(torch.load(out / f"{phase}.pt", weights_only=False))
    return got


@pytest.mark.parametrize("name", SAVES)
def test_resume_is_bit_exact(results, name):
    a, b, c = results[f"{name}/A"], results[f"{name}/B"], results[f"{name}/C"]
    assert b["scales"] == a["scales"] and b["skipped"] == a["skipped"], "the save changed the run"
    assert torch.equal(b["final"], a["final"]), "the save changed the run"
    done = len(a["traj"]) - len(c["traj"])
    for t, (got, want) in enumerate(zip(c["traj"], a["traj"][done:])):
        assert torch.equal(got, want), f"{name}: step {done + t + 1} after the resume differs"
    assert c["scales"] == a["scales"][done:], f"{name}: loss scales {c['scales']} vs {a['scales'][done:]}"
    assert c["skipped"] == a["skipped"][done:], (
        f"{name}: skipped steps {c['skipped']} vs {a['skipped'][done:]}"
    )
    assert torch.equal(c["final"], a["final"]) and c["final_scale"] == a["final_scale"]
    assert len(set(a["scales"])) >= 2 and a["skipped"][-1] >= 2, (
        "the scaler never moved: the test proves nothing"
    )


def test_zero1_fp16_checkpoint_loads_into_acco_and_back(results):
    """The loss scaler crosses between DeepSpeed's ZeRO-1 fp16 and ACCO: ZeRO-1's files into ACCO (same world size,
    another, and as a universal checkpoint), ACCO's into ZeRO-1 (as a universal checkpoint: DeepSpeed's own legacy
    load needs its own partition padding), and each run trains on."""
    z1 = results["z1"]["scaler"]
    assert z1["cur_iter"] > 0 and z1["last_overflow_iter"] >= 0, z1
    assert results["sync_from_z1"]["loaded"] == z1
    assert results["acco_w1_from_z1"]["loaded"] == z1, "another world size"
    assert results["acco_from_z1_universal"]["loaded"] == z1, "a universal checkpoint"
    assert results["sync_from_z1"]["at_save"] != z1, "ACCO's scaler did not move after the load"
    assert results["z1_from_acco"]["loaded"] == results["sync_from_z1"]["at_save"]
    for name in ("sync_from_z1", "acco_w1_from_z1", "acco_from_z1_universal"):
        traj = results[name]["traj"]
        assert (traj[-1] - traj[0]).abs().max() > 0, f"{name} did not train on"
