"""A save killed half-way, and checkpoints that cannot be loaded (docs/RELIABILITY.md, "Interrupted
save").

Multi-rank part (2 ranks, started as the ``deepspeed`` launcher starts them): a job saves ``step2``, trains on and dies while
rank 1 writes its optimizer file of ``step4`` (half the bytes written, SIGKILL; rank 0 went on with
its own save meanwhile). Through acco_ds's save, ``latest`` still names ``step2``, the partial save
is a ``step4.acco-partial`` folder, and a new job resumes from ``step2`` with exactly the parameters
saved. The same fault under DeepSpeed's own save (kept by register.py) shows the hazard acco_ds
removes: ``latest`` names the partial ``step4``; loading it fails with a message naming the
truncated file instead of a torch unpickling error.

One-rank part (in this process): truncated or empty files, another model, another world size (loads), an
unknown tag, an empty ``latest``, re-saving a tag in place.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from deepspeed.utils import safe_get_full_fp32_param
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

import acco_ds  # noqa: F401
from acco_ds.deepspeed.checkpoint import ACCOCheckpointError
from acco_ds.deepspeed.checkpoint.guard import STAGING_SUFFIX
from tests.checkpoint.common import acco_engine
from tests.ranks import toy
from tests.ranks.inproc import ensure_single_rank_group
from tests.ranks.launch import REPO, run_local

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

WORKER = REPO / "tests" / "ranks" / "ckpt_kill_worker.py"


def _launch(args: list, expect_ok: bool) -> subprocess.CompletedProcess:
    proc = run_local(WORKER, 2, args, timeout=300, check=False)
    assert (proc.returncode == 0) == expect_ok, f"rc={proc.returncode}\n{proc.stdout[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    base = tmp_path_factory.mktemp("killed_save")
    dirs = {v: base / v for v in ("acco", "deepspeed")}
    for variant, folder in dirs.items():
        folder.mkdir()
        proc = _launch(["--phase", "save", "--dir", folder, "--variant", variant], expect_ok=False)
        assert "ACCO_HALF_WRITTEN rank 1" in proc.stdout + proc.stderr, "the fault was not injected"
        assert "ACCO_SAVE_RETURNED" not in proc.stdout + proc.stderr
    _launch(
        ["--phase", "resume", "--dir", *dirs.values(), "--try_tags", "step4", "step4" + STAGING_SUFFIX],
        expect_ok=True,
    )
    return {v: json.loads((d / "resume.json").read_text()) for v, d in dirs.items()}, dirs


def test_latest_stays_on_the_complete_checkpoint(killed):
    res, dirs = killed
    folder = dirs["acco"]
    assert (folder / "latest").read_text() == "step2"
    assert not (folder / "step4").exists()
    partial = folder / ("step4" + STAGING_SUFFIX)
    sizes = {p.name: p.stat().st_size for p in partial.iterdir()}
    full = {p.name: p.stat().st_size for p in (folder / "step2").iterdir()}
    assert (
        sizes["zero_pp_rank_1_mp_rank_00_optim_states.pt"] < full["zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    )
    r = res["acco"]
    assert r["latest_error"] is None and r["loaded"] == "step2/mp_rank_00_model_states.pt"
    assert r["max_diff_to_step2"] == 0.0 and r["trained_on"]
    assert r["errors"]["step4"]["type"] == "ACCOCheckpointError"
    assert "'step4' not found" in r["errors"]["step4"]["message"]
    assert "step2" in r["errors"]["step4"]["message"]  # names the tags that exist
    partial_err = r["errors"]["step4" + STAGING_SUFFIX]
    assert partial_err["type"] == "ACCOCheckpointError"
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated" in partial_err["message"]


def test_deepspeed_own_save_leaves_latest_on_a_partial_checkpoint(killed):
    """The hazard: without acco_ds's save, rank 0 writes ``latest`` before rank 1 has finished."""
    res, dirs = killed
    assert (dirs["deepspeed"] / "latest").read_text() == "step4"
    r = res["deepspeed"]
    assert r["latest_error"]["type"] == "ACCOCheckpointError"
    assert "step4/zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated" in r["latest_error"]["message"]
    assert r["loaded"] == "step2/mp_rank_00_model_states.pt" and r["max_diff_to_step2"] == 0.0


# -- one rank, in this process -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank():
    ensure_single_rank_group()


def _engine(model=None):
    return acco_engine(model if model is not None else toy.build())


def _train(engine, steps: int, start: int = 0):
    for s in range(steps):
        for j in range(2):
            loss = engine(*toy.micro_batch(0, (start + s) * 2 + j))
            engine.backward(loss)
            engine.step()


def _params(engine):
    return toy.flat(safe_get_full_fp32_param(p) for p in toy.trainable(engine.module))


@pytest.fixture
def saved(one_rank, tmp_path):
    engine = _engine()
    _train(engine, 3)
    engine.save_checkpoint(tmp_path, tag="a")
    yield engine, tmp_path
    engine.optimizer.pipeline.close()


def _truncate(path, keep: float):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    "name,keep",
    [
        ("mp_rank_00_model_states.pt", 0.5),
        ("zero_pp_rank_0_mp_rank_00_optim_states.pt", 0.9),
        ("mp_rank_00_model_states.pt", 0.0),
    ],
    ids=["model_half", "optim_90pct", "model_empty"],
)
def test_truncated_file_is_named(saved, name, keep):
    engine, folder = saved
    _truncate(folder / "a" / name, keep)
    with pytest.raises(ACCOCheckpointError, match=rf"{name} is truncated \(\d+ bytes"):
        engine.load_checkpoint(folder)


def test_other_model_is_refused(saved):
    _, folder = saved

    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(toy.VOCAB, 7)
            self.fc = torch.nn.Linear(7, toy.VOCAB)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(
                self.fc(self.emb(x)).reshape(-1, toy.VOCAB), y.reshape(-1)
            )

    other = _engine(Other())
    try:
        with pytest.raises(
            ACCOCheckpointError, match=r"(?s)holds another model.*size mismatch for emb\.weight"
        ):
            other.load_checkpoint(folder)
        # the refused load left the engine usable
        _train(other, 1)
    finally:
        other.optimizer.pipeline.close()


def test_other_world_size_loads(one_rank, killed):
    """The step2 checkpoint of the 2-rank job, loaded on one rank, holds the fp32 weights zero_to_fp32
    rebuilds from it (re-sharded: tests/checkpoint/test_reshard.py); the weights alone load too."""
    _, dirs = killed
    engine = _engine()
    try:
        path, _ = engine.load_checkpoint(dirs["acco"], tag="step2")
        assert path is not None
        fp32 = get_fp32_state_dict_from_zero_checkpoint(str(dirs["acco"]), tag="step2")
        names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
        assert torch.equal(_params(engine), toy.flat(fp32[n] for n in names))
        path, _ = engine.load_checkpoint(dirs["acco"], tag="step2", load_optimizer_states=False)
        assert path is not None
    finally:
        engine.optimizer.pipeline.close()


def test_empty_latest_is_refused(saved):
    engine, folder = saved
    (folder / "latest").write_text("")
    with pytest.raises(ACCOCheckpointError, match=r"latest is empty.*tag="):
        engine.load_checkpoint(folder)


def test_resave_in_place_and_leftover_partial(saved):
    """Saving a tag again replaces it atomically, and a staging folder left by a killed save neither
    breaks the next save nor is ever named by ``latest``."""
    engine, folder = saved
    leftover = folder / ("a" + STAGING_SUFFIX)
    shutil.copytree(folder / "a", leftover)
    _truncate(leftover / "mp_rank_00_model_states.pt", 0.3)
    _train(engine, 2, start=10)
    want = _params(engine)
    engine.save_checkpoint(folder, tag="a")
    assert (folder / "latest").read_text() == "a"
    assert not leftover.exists() and not any(p.name.endswith(".acco-replaced") for p in folder.iterdir())
    fresh = _engine()
    try:
        path, _ = fresh.load_checkpoint(folder)
        assert path is not None and os.path.basename(os.path.dirname(path)) == "a"
        assert torch.equal(_params(fresh), want)
    finally:
        fresh.optimizer.pipeline.close()
