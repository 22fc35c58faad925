"""Adaptive accumulation (docs/ALGORITHM.md, property 5): with one rank made much slower, the ranks
accumulate different numbers of micro-batches, and every micro-batch gradient enters exactly the
peeks and commits the equations give it: none lost, none counted twice, each weighted by the
global count.

The oracle is parameter-level: the worker's model has a linear loss, so each micro-batch's
gradient is known whatever the parameters; from the recorded membership of every round,
``reference_rounds`` rebuilds the equations of docs/ALGORITHM.md, and after EVERY commit the run's fp32 master
and both Adam moments (every rank's shard) must equal it, and every micro-batch must have been
computed at the parameters the equations say (theta^t or the peek's estimate). Clipping off and
acting."""

from __future__ import annotations

import pytest
import torch

from acco_ds.core.reference import RefHyper, reference_rounds
from tests.ranks.adaptive_worker import DIM, LR, WD, vector
from tests.ranks.launch import REPO, run_local

pytestmark = pytest.mark.launcher  # starts ranks through a launcher (left out by make test-fast)

STEPS = 6
CLIPS = (0.0, 0.02)  # the fast rank adds thousands of micro-batches: averaged norms reach ~0.08
PARAM_TOL, MOMENT_TOL, NORM_TOL = 1e-6, 1e-5, 1e-5
CAP = 3  # the last run: the fast rank blocks at 3 micro-batches per round
RUNS = [f"clip{c}" for c in CLIPS] + [f"cap{CAP}"]


@pytest.fixture(scope="module", params=["acco", "dpu"])
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"adaptive_{request.param}")
    run_local(
        REPO / "tests" / "ranks" / "adaptive_worker.py",
        2,
        [
            "--out",
            out,
            "--mode",
            request.param,
            "--steps",
            STEPS,
            "--slow-ms",
            40,
            "--clips",
            ",".join(map(str, CLIPS)),
            "--cap",
            CAP,
        ],
    )
    results = torch.load(out / "adaptive.pt", weights_only=False)
    assert [r["clip"] for r in results] == [*CLIPS, 0.0] and results[-1]["cap"] == CAP
    return request.param, results


def rounds_of(result) -> dict:
    """round index -> list of micro-batch gradient vectors that entered it (all ranks)."""
    rounds: dict = {}
    for r in result["ranks"]:
        for rank, index, rnd, _ in r["micro"]:
            rounds.setdefault(rnd, []).append(vector(rank, index))
    return rounds


def oracle(mode: str, result):
    rounds = rounds_of(result)
    n_rounds = max(rounds) + 1
    return reference_rounds(
        mode,
        [torch.zeros(DIM)],
        [[[g] for g in rounds.get(r, [])] for r in range(n_rounds)],
        hyper=[RefHyper(LR, (0.9, 0.999), 1e-8, WD)],
        clip=result["clip"],
    )


def gathered_state(result, t: int) -> dict:
    """The fp32 master and moments after commit t, rebuilt from every rank's shard."""
    out = {k: torch.full((DIM,), float("nan")) for k in ("master", "exp_avg", "exp_avg_sq")}
    for r in result["ranks"]:
        (st,) = [s for s in r["states"] if s["commit"] == t]
        for k, full in out.items():
            full[st["start"] : st["start"] + st[k].numel()] = st[k]
    return out


def commits_of(result) -> list:
    return [j for j in result["jobs"] if j[0] == "commit"]


def test_fast_rank_accumulates_more(run):
    _, results = run
    for result in results[: len(CLIPS)]:
        local = [r["stats"]["micro_batches_local"] for r in result["ranks"]]
        assert local[0] > 1.5 * local[1], local


def test_cap_bounds_the_fast_rank(run):
    _, results = run
    capped = results[-1]
    counts = {}
    for rank, r in enumerate(capped["ranks"]):
        for _, _, rnd, _ in r["micro"]:
            counts[(rank, rnd)] = counts.get((rank, rnd), 0) + 1
    assert max(counts.values()) <= CAP
    assert max(c for (rank, _), c in counts.items() if rank == 0) == CAP  # the fast rank reached it


def test_clipping_acts_in_the_clipped_run(run):
    mode, results = run
    norms = oracle(mode, results[1]).commits.norms
    assert min(norms) > results[1]["clip"], norms


@pytest.mark.parametrize("which", range(len(RUNS)), ids=RUNS)
def test_state_after_every_commit_equals_the_oracle(run, which):
    mode, results = run
    result = results[which]
    ref = oracle(mode, result)
    commits = commits_of(result)
    assert len(commits) >= STEPS
    for _, t, _, norm in commits:
        got = gathered_state(result, t)
        want = {
            "master": ref.commits.params[t][0],
            "exp_avg": ref.commits.exp_avg[t][0],
            "exp_avg_sq": ref.commits.exp_avg_sq[t][0],
        }
        d = (got["master"] - want["master"]).abs().max().item()
        assert d <= PARAM_TOL, f"{mode} clip {result['clip']} commit {t}: master max |diff| {d:.3e}"
        for k in ("exp_avg", "exp_avg_sq"):
            rel = (got[k] - want[k]).abs().max().item() / want[k].abs().max().item()
            assert rel <= MOMENT_TOL, f"{mode} clip {result['clip']} commit {t}: {k} max rel diff {rel:.3e}"
        assert norm == pytest.approx(ref.commits.norms[t], rel=NORM_TOL), f"commit {t} norm"


@pytest.mark.parametrize("which", range(len(RUNS)), ids=RUNS)
def test_every_micro_batch_computed_at_the_right_parameters(run, which):
    """theta^t or (acco) the peek's estimate theta~^{t+1}: checks every peek's output too."""
    mode, results = run
    result = results[which]
    ref = oracle(mode, result)
    last = max(t for _, t, _, _ in commits_of(result))
    checked = 0
    for r in result["ranks"]:
        for rank, index, rnd, w in r["micro"]:
            if rnd > 2 * last + 2:  # rounds after the last commit (dropped at finish) are not rebuilt
                continue
            d = (w - ref.at[rnd][0]).abs().max().item()
            assert d <= PARAM_TOL, (
                f"{mode}: rank {rank} micro-batch {index} (round {rnd}) at max |diff| {d:.3e}"
            )
            checked += 1
    assert checked >= 2 * STEPS


def test_every_micro_batch_enters_its_step(run):
    mode, results = run
    for result in results:
        rounds = rounds_of(result)
        per_round = 2 if mode == "acco" else 1
        commits = commits_of(result)
        peeks = [j for j in result["jobs"] if j[0] == "peek"]
        # finish() applies a commit still in flight (dpu) and drops a peek in flight (acco)
        assert [c[1] for c in commits] == list(range(len(commits))) and len(commits) in (STEPS, STEPS + 1)
        for _, t, count, norm in commits:
            members = [v for r in range(per_round * t, per_round * t + per_round) for v in rounds[r]]
            assert count == len(members), f"commit {t}: count {count} != {len(members)} micro-batches"
            expected = torch.stack(members).double().sum(0) / len(members)
            assert norm == pytest.approx(expected.norm().item(), rel=1e-5), f"commit {t}"
        for _, t, count, norm in peeks:
            members = rounds[2 * t]
            assert count == len(members)
            expected = torch.stack(members).double().sum(0) / len(members)
            assert norm == pytest.approx(expected.norm().item(), rel=1e-5), f"peek {t}"


def test_counts_are_conserved(run):
    _, results = run
    for result in results:
        computed = sum(r["stats"]["micro_batches_local"] for r in result["ranks"])
        stats = result["ranks"][0]["stats"]
        assert stats["micro_batches_committed"] + stats["micro_batches_discarded"] == computed
        assert stats["skipped_steps"] == 0
        for r in result["ranks"]:  # the global figures agree on every rank
            assert r["stats"]["micro_batches_committed"] == stats["micro_batches_committed"]
