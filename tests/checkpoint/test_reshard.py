"""An ACCO checkpoint resumed on another world size (docs/CHECKPOINTS.md "Changing the
world size"), ranks started as the deepspeed launcher starts them, on CPU (the runs: tests/ranks/ckpt_runs.py).

Pairs 2 -> 1, 2 -> 3, 3 -> 2, 1 -> 2 in sync, dpu and acco (fp32), plus acco in bf16, saves inside a step
(a commit or a peek in flight, micro-batches accumulated), a resume with another
gradient_accumulation_steps and one in adaptive accumulation (reload and counts only: its rounds end at
timing-dependent points, so there are no equations or step-aligned curve to compare it with). For each:

- right after the load the gathered fp32 master and both moments equal the saved ones bit for bit, and
  the step count is the saved one;
- every later step equals (max abs <= 1e-6, fp32) docs/ALGORITHM.md's equations started from that committed state
  on the new world size (``reference_run`` with ``initial_state``): a new prologue round, the LR schedule
  where the save left it;
- the eval loss of the committed model stays on the uninterrupted run's curve (the measured gap is at
  most 0.4 % of the loss; the resumed run trains on another global batch);
- every micro-batch is committed or counted as discarded exactly once (the in-flight work dropped at
  the load included).

The measured figures print with ``python -m pytest tests/checkpoint/test_reshard.py -rP``.
``engine.save_16bit_model`` inside a step holds the committed weights. In this process (one rank): the
reference's resume from a state; bad input (a missing or truncated partition of another rank, another
model) is refused with the file or parameter named before anything changes, and nothing is written.
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

EQ_TOL = 1e-6  # max abs on the fp32 master, every step after the resume
MOMENT_TOL = 1e-5  # max abs relative to the moment's largest value
LOSS_GAP = 0.01  # eval loss of the resumed run vs the uninterrupted one, relative (measured <= 0.4 %)

RESUMES = [(c, t) for c in ckpt_runs.CASES for t in c["targets"]]
FIXED = [(c, t) for c, t in RESUMES if c["accumulation"] == "fixed"]
FP32_RESUMES = [(c, t) for c, t in FIXED if c["dtype"] == "fp32"]


def rid(ct) -> str:
    c, t = ct
    return f"{c['name']}->{t}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return ckpt_runs.runs(tmp_path_factory.getbasetemp())


def records(runs, case, target):
    """(the saving run's rank-0 record, the resumed run's records per rank)."""
    return runs["jobs"][case["name"]][0], runs["jobs"][f"{case['name']}@{target}"]


@pytest.mark.parametrize("ct", RESUMES, ids=rid)
def test_reload_equals_the_saved_state(runs, ct):
    case, target = ct
    saved, resumed = records(runs, case, target)
    want, got = saved["at_save"], resumed[0]["reload"]
    diffs = {key: (got[key] - want[key]).abs().max().item() for key in ("master", "exp_avg", "exp_avg_sq")}
    print(f"{rid(ct)}: after the load, max |diff| to the saved state {diffs}, step {got['step']}")
    for key in diffs:
        assert torch.equal(got[key], want[key]), f"{key}: max |diff| {diffs[key]:.3e} after re-sharding"
    assert got["step"] == want["step"] > 0
    assert resumed[0]["global_steps"] == case["save_micro"] // ckpt_runs.GAS
    if case["accumulation"] == "fixed":
        assert got["step"] == ckpt_runs.SAVE
    assert "universal_checkpoint_info" not in resumed[0]["client_keys"]


def reference_after_resume(case, target, saved, resumed):
    got = resumed[0]
    done = got["global_steps"]
    gas = case["resume_gas"]
    start = got["reload"]
    return reference_run(
        case["mode"],
        [start["master"]],
        toy.make_grad_fn(torch.float32),
        world_size=target,
        micro_batches_per_round=gas // 2 if case["mode"] == "acco" else gas,
        steps=ckpt_runs.STEPS - done,
        hypers=lambda t: [RefHyper(saved["lrs"][done + t], (0.9, 0.999), 1e-8, 0.1)],
        clip=0.5,
        initial_state=RefState([start["exp_avg"]], [start["exp_avg_sq"]], start["step"]),
        first_micro_batch=case["save_micro"],
    )


@pytest.mark.parametrize("ct", FP32_RESUMES, ids=rid)
def test_next_steps_follow_the_resume_equations(runs, ct):
    """From the committed state the run goes on as docs/ALGORITHM.md's equations started there (new prologue) on the
    new world size, at the LR the uninterrupted run had: parameters and both moments after every step."""
    case, target = ct
    saved, resumed = records(runs, case, target)
    got = resumed[0]
    done = got["global_steps"]
    assert got["lrs"] == saved["lrs"][done : ckpt_runs.STEPS], "the LR schedule did not resume where it was"
    ref = reference_after_resume(case, target, saved, resumed)
    assert len(got["traj"]) == len(ref.params) == ckpt_runs.STEPS - done
    diffs = [(params - want).abs().max().item() for params, (want,) in zip(got["traj"], ref.params)]
    print(
        f"{rid(ct)}: steps {done + 1}-{ckpt_runs.STEPS} vs the equations from the loaded state: max |diff| {max(diffs):.2e}"
    )
    for t, diff in enumerate(diffs):
        assert diff <= EQ_TOL, f"step {done + t + 1}: max |diff| {diff:.3e} > {EQ_TOL}"
    for key in ("exp_avg", "exp_avg_sq"):
        for t, (m, (want,)) in enumerate(zip(got[key], getattr(ref, key))):
            rel = (m - want).abs().max().item() / want.abs().max().item()
            assert rel <= MOMENT_TOL, f"{key} step {done + t + 1}: rel diff {rel:.3e}"
    assert (got["traj"][-1] - got["reload"]["master"]).abs().max().item() > 1e-3  # it trained


@pytest.mark.parametrize("ct", FIXED, ids=rid)
def test_loss_stays_on_the_uninterrupted_curve(runs, ct):
    case, target = ct
    saved, resumed = records(runs, case, target)
    got = resumed[0]
    done = got["global_steps"]
    want = saved["evals"][done:]
    assert len(got["evals"]) == len(want) > 0
    gap = max(abs(a - b) / b for a, b in zip(got["evals"], want))
    print(f"{rid(ct)}: eval loss after the resume {got['evals']} vs uninterrupted {want}: max gap {gap:.2%}")
    assert gap <= LOSS_GAP, f"eval loss {got['evals']} vs uninterrupted {want}: gap {gap:.2%}"


def expected_discard(case, saved_world) -> int:
    """Micro-batches of the save's in-flight work that no commit will use (docs/CHECKPOINTS.md)."""
    extra = case["save_micro"] % ckpt_runs.GAS
    if extra == 0:
        return 0  # at a boundary: a commit in flight (in the master), nothing accumulated
    pending = saved_world * (extra if case["mode"] != "acco" else extra % (ckpt_runs.GAS // 2))
    kept_g_tilde = (
        saved_world * ckpt_runs.GAS // 2 if case["mode"] == "acco" and extra > ckpt_runs.GAS // 2 else 0
    )
    return pending + kept_g_tilde


@pytest.mark.parametrize("ct", RESUMES, ids=rid)
def test_counts_are_conserved(runs, ct):
    """Every micro-batch computed before or after the resume is committed or discarded exactly once."""
    case, target = ct
    saved, resumed = records(runs, case, target)
    at_load = resumed[0]["stats_at_load"]
    assert at_load["applied_steps"] == saved["at_save"]["step"]
    if case["accumulation"] == "fixed":
        assert at_load["micro_batches_discarded"] == expected_discard(case, case["source"])
        assert at_load["committed_steps"] == ckpt_runs.SAVE
    stats = resumed[0]["stats"]
    computed = sum(r["stats"]["micro_batches_local"] for r in resumed)
    assert (
        computed
        == case["save_micro"] * case["source"]
        + (ckpt_runs.STEPS - ckpt_runs.SAVE) * case["resume_gas"] * target
    )
    assert stats["micro_batches_committed"] + stats["micro_batches_discarded"] == computed
    if case["accumulation"] == "fixed":
        assert stats["committed_steps"] == ckpt_runs.STEPS
    else:  # adaptive commits follow the communication, not the engine's steps
        assert stats["committed_steps"] > at_load["committed_steps"]


@pytest.mark.parametrize("name", [c["name"] for c in ckpt_runs.CASES if c["save_micro"] % ckpt_runs.GAS])
def test_16bit_export_inside_a_step_is_committed(runs, name):
    """engine.save_16bit_model inside a step (a job in flight) writes the committed weights theta."""
    rec = runs["jobs"][name][0]
    assert torch.equal(rec["export"], rec["at_save"]["master"])
    if name != "acco_midpeek_w2":  # a peek in flight leaves the model at theta
        assert (rec["model_at_export"] - rec["at_save"]["master"]).abs().max().item() > 1e-3


def test_reference_resume_from_a_state_continues_sync_exactly():
    """reference_run's initial_state: sync resumed after 2 steps from the recorded state ends bit for bit
    where the uninterrupted reference does (sync keeps nothing in flight)."""
    theta0 = toy.flat(toy.trainable(toy.build()))
    kw = dict(
        world_size=2, micro_batches_per_round=2, hypers=lambda t: [RefHyper(0.01, (0.9, 0.999), 1e-8, 0.1)]
    )
    grad_fn = toy.make_grad_fn(torch.float32)
    full = reference_run("sync", [theta0], grad_fn, steps=4, **kw)
    state = RefState(full.exp_avg[1], full.exp_avg_sq[1], 2)
    resumed = reference_run(
        "sync", full.params[1], grad_fn, steps=2, initial_state=state, first_micro_batch=4, **kw
    )
    for a, b in zip(resumed.params, full.params[2:]):
        assert torch.equal(a[0], b[0])
    fresh = reference_run("sync", full.params[1], grad_fn, steps=2, first_micro_batch=4, **kw)
    assert (fresh.params[-1][0] - full.params[-1][0]).abs().max() > 1e-4  # the state matters


# -- bad input, one rank in this process: refused before anything changes, nothing on disk written -----
class Renamed(toy.Toy):
    """The toy with its first layer under another name (same shapes)."""

    def __init__(self):
        super().__init__()
        self.lin1 = self.fc1
        del self.fc1

    def forward(self, x, y):
        h = self.emb(x)
        h = h + self.fc2(torch.nn.functional.gelu(self.lin1(h) + self.frozen))
        return torch.nn.functional.cross_entropy(self.out(h).reshape(-1, toy.VOCAB), y.reshape(-1))


class Wider(toy.Toy):
    """The toy with a wider embedding (other shapes)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(toy.VOCAB, toy.DIM + 1)


def _engine(model):
    ensure_single_rank_group()
    return acco_engine(model)


def _refused(engine, folder, match: str) -> None:
    before, was = digest(folder), full_state(engine)
    try:
        with pytest.raises(ACCOCheckpointError, match=match):
            engine.load_checkpoint(folder, tag="mid")
        for a, b in zip(was, full_state(engine)):
            assert torch.equal(a, b), "the refused load changed the run"
        assert digest(folder) == before, "a load wrote into the checkpoint folder"
    finally:
        engine.optimizer.pipeline.close()


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_damaged_partition_is_refused_before_any_change(runs, tmp_path, damage):
    """A 2-rank checkpoint loaded on 1 rank needs rank 1's partition too: a missing or truncated one is
    named before the module weights (or anything else) are loaded."""
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["out"] / "ckpt" / "acco_w2", folder)
    victim = folder / "mid" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    _refused(_engine(toy.build(3)), folder, rf"{victim} is {damage}")


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (
            Wider,
            r"(?s)holds another model.*size mismatch for emb\.weight: checkpoint \[13, 6\], this model \[13, 7\]",
        ),
        (Renamed, r"(?s)holds another model.*lin1\.weight"),
    ],
    ids=["shapes", "names"],
)
def test_other_model_is_refused_before_any_change(runs, model, match):
    torch.manual_seed(0)
    _refused(_engine(model()), runs["out"] / "ckpt" / "acco_w2", match)
