"""DeepSpeed universal checkpoints both ways between DeepSpeed's ZeRO-1 AdamW and ACCO,
ranks started as the deepspeed launcher starts them, on CPU (the runs: tests/ranks/ckpt_runs.py):

ZeRO-1 AdamW (1 rank) saves -> ``ds_to_universal.py --inject_missing_state`` -> ACCO (3 ranks,
``"checkpoint": {"load_universal": true}``) continues and saves -> ``ds_to_universal.py`` (no flag needed) ->
ZeRO-1 AdamW (2 ranks) and ACCO (2 ranks) continue. The weights and both moments are unchanged by every
conversion (bit for bit), the step count is kept, and the steps after each load follow the equations from
the loaded state (ACCO also restores the frozen parameters a universal checkpoint holds: the resumed
model is built from another seed). DeepSpeed's ZeRO-1 files also load into ACCO without conversion.
Bad input (one rank, in this process): a universal checkpoint without Adam moments.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import acco_ds  # noqa: F401
from acco_ds.core.reference import RefHyper, RefState, reference_run
from acco_ds.deepspeed.checkpoint import ACCOCheckpointError
from tests.checkpoint.common import acco_engine, digest, full_state
from tests.ranks import ckpt_runs, toy
from tests.ranks.inproc import ensure_single_rank_group

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

EQ_TOL = 2e-6  # ZeRO-1's FusedAdam and ACCO's kernel vs torch's AdamW, fp32 (tests/core/test_trajectories.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return ckpt_runs.runs(tmp_path_factory.getbasetemp())


def assert_same_state(got: dict, want: dict, what: str) -> None:
    for key in ("master", "exp_avg", "exp_avg_sq"):
        diff = (got[key] - want[key]).abs().max().item()
        assert torch.equal(got[key], want[key]), f"{what}: {key} max |diff| {diff:.3e}"
    assert got["step"] == want["step"], f"{what}: step {got['step']} vs {want['step']}"


def test_zero1_to_acco_keeps_weights_moments_and_step(runs):
    z1, acco = runs["jobs"]["z1"][0], runs["jobs"]["acco_from_z1"][0]
    assert_same_state(acco["reload"], z1["at_save"], "ZeRO-1 -> universal -> ACCO")
    assert acco["reload"]["step"] == ckpt_runs.SAVE
    assert (acco["reload"]["exp_avg_sq"] > 0).any()  # real moments, not a fresh optimizer


def test_zero1_checkpoint_loads_into_acco_without_conversion(runs):
    """engine.load_checkpoint of DeepSpeed's own ZeRO-1 AdamW files (1 rank) into ACCO (3 ranks): the same
    state as through the universal route, and training follows the equations from it."""
    z1, acco = runs["jobs"]["z1"][0], runs["jobs"]["acco_from_z1_files"][0]
    assert_same_state(acco["reload"], z1["at_save"], "ZeRO-1 files -> ACCO")
    assert acco["lrs"] == z1["lrs"][ckpt_runs.SAVE :]
    follow("dpu", acco, runs["world"]["acco_from_z1_files"], acco["lrs"], ckpt_runs.SAVE * ckpt_runs.GAS)


def test_acco_to_zero1_keeps_weights_moments_and_step(runs):
    acco, z1 = runs["jobs"]["acco_from_z1"][0], runs["jobs"]["z1_from_acco"][0]
    assert_same_state(z1["reload"], acco["at_save"], "ACCO -> universal -> ZeRO-1")
    assert z1["reload"]["step"] == ckpt_runs.STEPS


def test_acco_universal_to_acco_on_another_world_size(runs):
    acco, again = runs["jobs"]["acco_from_z1"][0], runs["jobs"]["acco_from_acco"][0]
    assert_same_state(again["reload"], acco["at_save"], "ACCO (3 ranks) -> universal -> ACCO (2 ranks)")


def follow(mode, rec, world, lrs, start_micro):
    start = rec["reload"]
    ref = reference_run(
        mode,
        [start["master"]],
        toy.make_grad_fn(torch.float32),
        world_size=world,
        micro_batches_per_round=ckpt_runs.GAS // 2 if mode == "acco" else ckpt_runs.GAS,
        steps=len(rec["traj"]),
        hypers=lambda t: [RefHyper(lrs[t], (0.9, 0.999), 1e-8, 0.1)],
        clip=0.5,
        initial_state=RefState([start["exp_avg"]], [start["exp_avg_sq"]], start["step"]),
        first_micro_batch=start_micro,
    )
    assert len(rec["traj"]) == len(ref.params) > 0
    diffs = [(got - want).abs().max().item() for got, (want,) in zip(rec["traj"], ref.params)]
    print(
        f"{mode} on {world} ranks: {len(diffs)} steps after the load vs the equations: max |diff| {max(diffs):.2e}"
    )
    for t, diff in enumerate(diffs):
        assert diff <= EQ_TOL, f"step {t + 1} after the load: max |diff| {diff:.3e}"


def test_continued_training_follows_the_equations(runs):
    """Both optimizers go on from the converted state as AdamW (ZeRO-1 = sync) and ACCO's equations from
    it say, at the LR the uninterrupted ZeRO-1 run had: the moments and the step count are used, not only
    carried."""
    jobs, world = runs["jobs"], runs["world"]
    z1 = jobs["z1"][0]
    acco = jobs["acco_from_z1"][0]
    assert acco["lrs"] == z1["lrs"][ckpt_runs.SAVE :]
    follow("acco", acco, world["acco_from_z1"], acco["lrs"], ckpt_runs.SAVE * ckpt_runs.GAS)
    for name, mode in (("z1_from_acco", "sync"), ("acco_from_acco", "sync")):
        rec = jobs[name][0]
        follow(mode, rec, world[name], rec["lrs"], ckpt_runs.STEPS * ckpt_runs.GAS)
    assert jobs["z1_from_acco"][0]["lrs"] == jobs["acco_from_acco"][0]["lrs"]


def test_conversion_of_acco_needs_no_inject_flag(runs):
    """ACCO's checkpoints carry universal_checkpoint_info (ds_to_universal.py requires it), so the
    conversion ran without --inject_missing_state (tests/ranks/ckpt_runs.py); a resume does not see it in
    its client state."""
    out = runs["out"]
    model = torch.load(out / "uni_a3" / "a3" / "mp_rank_00_model_states.pt", weights_only=False)
    assert model["universal_checkpoint_info"]["universal_checkpoint_version"] > 0
    assert "universal_checkpoint_info" not in runs["jobs"]["acco_from_acco"][0]["client_keys"]


# -- bad input, one rank in this process ---------------------------------------------------------------
def _engine(universal: bool):
    ensure_single_rank_group()
    return acco_engine(toy.build(5), **({"checkpoint": {"load_universal": True}} if universal else {}))


@pytest.mark.parametrize("missing", ["exp_avg.pt", "step.pt"])
def test_universal_without_moments_is_refused_before_any_change(runs, tmp_path, missing):
    folder = tmp_path / "uni"
    shutil.copytree(runs["out"] / "uni_z1", folder)
    for f in (folder / "z1_universal" / "zero").glob(f"*/{missing}"):
        f.unlink()
    before = digest(folder)
    engine = _engine(universal=True)
    try:
        was = full_state(engine)
        with pytest.raises(
            ACCOCheckpointError, match=rf"no Adam state '{missing[:-3]}' for parameter .*{missing}"
        ):
            engine.load_checkpoint(folder)
        for a, b in zip(was, full_state(engine)):
            assert torch.equal(a, b), "the refused load changed the run"
        # the weights alone load (new moments)
        path, _ = engine.load_checkpoint(folder, load_optimizer_states=False)
        assert path is not None
        assert torch.equal(full_state(engine)[0], runs["jobs"]["z1"][0]["at_save"]["master"])
    finally:
        engine.optimizer.pipeline.close()
    assert digest(folder) == before, "a load wrote into the checkpoint folder"
