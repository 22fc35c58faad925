"""benchmarks.e2e: the throttled-link benchmark keeps working (its --quick run), refuses to
run without a real throttle instead of faking one, exits non-zero naming any contender that could
not run, its compute-only bound sums the ranks' own rates, the same seed gives every contender the
same data order, and its loss verdicts are paired by seed and made against the seeds' spread, under
both framings (same steps, same token budget)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from acco_ds.cli.launch import LaunchError
from acco_ds.cli.metrics import merge_ranks, summarize
from acco_ds.data import load_corpus, stream
from benchmarks.e2e import cli
from benchmarks.harness import analysis, link, runs, seeds

ROOT = Path(__file__).resolve().parents[2]


def test_rates_are_checked_and_wrapped():
    assert link.rate_mbit("2gbit") == 2000 and link.rate_mbit("800kbit") == 0.8
    with pytest.raises(ValueError, match="not 'none' or a tc rate"):
        link.check_rate("fast")
    argv = link.wrap("400mbit")("echo hi")
    assert argv[:3] == ["unshare", "-n", "sh"] and "tbf rate 400mbit burst 256kb latency 200ms" in argv[-1]
    assert "tc " not in link.wrap("none")("echo hi")[-1]


def test_refuses_without_a_throttle(monkeypatch, capsys):
    monkeypatch.setattr(link, "throttle_unavailable", lambda: "throttling needs root (running as uid 1000)")
    assert cli.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "cannot throttle" in err and "uid 1000" in err and "does not fake" in err


def _log(ms_per_mb: float, steps: int = 8, gas: int = 4) -> list:
    """One rank's cumulative step records at a constant pace."""
    return [
        {"step": k, "t": k * gas * ms_per_mb / 1000, "mb": k * gas, "loss_sum": 3.0 * k * gas}
        for k in range(1, steps + 1)
    ]


def test_bound_sums_the_ranks_own_rates():
    """Ranks at 80 and 100 ms per micro-batch of 8: 100 + 80 samples/s. Not W x the slowest rank
    (160), which an adaptive contender whose fast rank computes more would beat."""
    b = runs.bound_figures([_log(80.0), _log(100.0)], warmup=2, micro_batch=8)
    assert b["rank_samples_per_s"] == pytest.approx([100.0, 80.0])
    assert b["samples_per_s"] == pytest.approx(180.0)
    assert b["t_mb"] == pytest.approx([0.080, 0.100])
    # the window is where both run: from the slower rank's end of warm-up to the faster one's end
    assert b["window_s"] == pytest.approx([0.8, 2.56])
    drained = _log(80.0) + [{"step": 9, "t": 9.0, "mb": 32, "loss_sum": 96.0}]  # end-of-run drain
    assert runs.bound_figures([drained, _log(80.0)], 2, 8)["samples_per_s"] == pytest.approx(200.0)
    with pytest.raises(ValueError, match="fewer than warm-up"):
        runs.bound_figures([_log(80.0, steps=4), _log(80.0)], warmup=2, micro_batch=8)


def _run_summary(
    label: str, rate: str, ms_per_mb: float, val: float = 2.9, steps: int = 8, gas: int = 4
) -> dict:
    """What ``benchmarks.harness.runs`` returns for a finished run, from synthetic rank records."""
    logs = [_log(ms_per_mb, steps, gas), _log(ms_per_mb, steps, gas)]
    train_s = steps * gas * ms_per_mb / 1000
    ranks = [
        {
            "train_s": train_s,
            "val_loss": val,
            "peak_mem_mib": 500.0,
            "micro_batches_local": steps * gas,
            "stats": {},
        }
        for _ in logs
    ]
    records = merge_ranks(logs, 8)
    s = summarize(records, ranks, warmup=2, micro_batch=8)
    s.update(
        label=label, rate=rate, load_before=0.1, load_after=0.1, slow_extra_s=[0.0, 0.0], records=records
    )
    return s


# synthetic val loss of a (contender, seed): acco's paired gaps to ZeRO-1 are +0.5%, +1.0%, +1.5%
VAL = {"zero1": [2.80, 2.90, 2.85], "acco": [2.814, 2.929, 2.89275], "acco-adaptive": [2.79, 2.88, 2.80]}


@pytest.fixture
def fake_runs(monkeypatch):
    """The e2e benchmark with its launches replaced by synthetic results; ``launched`` lists the contender
    launches (label, tag, at the budget) and ``failing`` the labels whose launches raise
    LaunchError. Adaptive ACCO computes twice the micro-batches per step of the others."""
    launched, failing = [], set()

    def contender(setup, label, rate, slow=None, tag="", seed=None, schedule=None):
        launched.append((label, tag, schedule is not None))
        if label in failing:
            raise LaunchError("the ranks exited with status 1 (log: x):\nunknown option")
        val = VAL.get(label, [2.9] * 3)[seed % 3]
        adaptive = label == "acco-adaptive"
        steps = schedule["steps"] if schedule else setup.steps
        return _run_summary(label, rate, 90.0 if label == "zero1" else 60.0, val, steps, 8 if adaptive else 4)

    def compute(setup, tag):
        s = runs.bound_figures([_log(80.0), _log(80.0)], setup.warmup, setup.micro_batch)
        return dict(s, load_before=0.1, load_after=0.1)

    monkeypatch.setattr(link, "throttle_unavailable", lambda: None)
    monkeypatch.setattr(runs, "run_contender", contender)
    monkeypatch.setattr(runs, "run_compute_only", compute)
    monkeypatch.setattr(
        runs, "run_comm_probe", lambda setup, rate, reps: {"t_comm_s": 0.1, "t_reduce_s": 0.05}
    )
    return launched, failing


def test_a_contender_that_cannot_run_fails_the_benchmark(fake_runs, tmp_path, capsys):
    """acco-adaptive's launches fail: the benchmark still writes ZeRO-1's results, names
    acco-adaptive in the table and on stderr, and exits 1."""
    launched, failing = fake_runs
    failing.add("acco-adaptive")
    out = tmp_path / "results"
    rc = cli.main(["--quick", "--steps", "8", "--out", str(out), "--work", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "acco-adaptive" in err and "could not run" in err and "unknown option" in err
    assert launched.count(("acco-adaptive", "/s0", False)) == 2  # retried once, then recorded
    raw = json.loads((out / "e2e_quick.json").read_text())
    assert "zero1" in raw["results"]["rates"]["200mbit"]["runs"]
    assert {f["label"] for f in raw["results"]["failed"]} == {"acco-adaptive"}
    assert [f["where"] for f in raw["results"]["failed"]] == ["200mbit seed 0", "200mbit-hetero seed 0"]
    md = (out / "e2e_quick.md").read_text()
    assert "## Runs that could not run" in md and "| acco-adaptive | 200mbit seed 0 |" in md
    line = "| every contender and reference run ran | 2 could not: acco-adaptive | MISSED | 2 could not: acco-adaptive | MISSED |"
    assert line in md


def test_unregistered_acco_fails_the_benchmark(fake_runs, monkeypatch, tmp_path, capsys):
    """Without an acco_ds that registers ACCO the baselines still run, and the exit status says
    which contenders did not."""
    launched, _ = fake_runs
    monkeypatch.setattr(cli, "acco_registered", lambda: (False, "import acco_ds failed: boom"))
    rc = cli.main(["--quick", "--steps", "8", "--out", str(tmp_path / "r"), "--work", str(tmp_path / "w")])
    assert rc == 1 and {label for label, *_ in launched} == {"zero1"}
    err = capsys.readouterr().err
    assert "acco-adaptive (all rates): not run: import acco_ds failed: boom" in err
    assert "acco-adaptive (heterogeneous)" in err


def test_seeds_are_paired_and_verdicts_made_against_their_spread(fake_runs, tmp_path):
    """Three seeds, every contender once per seed, interleaved; loss figures paired by seed; the
    acco gap (+0.5/+1.0/+1.5%) is met at 2% and 'not shown' at 1.2%; framing (b) runs adaptive ACCO
    at the token budget with its LR schedule compressed to the steps that budget buys."""
    launched, _ = fake_runs
    out = tmp_path / "results"
    argv = ["--rates", "200mbit", "--contenders", "zero1,acco,acco-adaptive", "--seeds", "0,1,2"]
    argv += [
        "--steps",
        "8",
        "--warmup",
        "2",
        "--hetero-rate",
        "off",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "w"),
    ]
    assert cli.main(argv) == 0
    fixed = [(label, tag) for label, tag, budget in launched if not budget]
    assert fixed == [(c, f"/s{s}") for s in range(3) for c in ("zero1", "acco", "acco-adaptive")]
    raw = json.loads((out / "e2e.json").read_text())
    block = raw["results"]["rates"]["200mbit"]
    assert [r["seed"] for r in block["seeds"]["acco"]] == [0, 1, 2]
    assert len(block["runs"]["acco"]["repeats"]) == 3  # the seeds double as the throughput repeats
    row = raw["analysis"]["tables"]["200mbit"]["acco"]
    gap = row["paired"]["val_gap"]
    assert gap["values"] == pytest.approx([0.005, 0.010, 0.015])  # paired by seed, not by sorted value
    assert seeds.verdict_within(gap, -0.02, 0.02) == "met"
    assert seeds.verdict_within(gap, -0.012, 0.012).startswith("not shown")
    assert seeds.verdict_within(gap, -0.004, 0.004) == "MISSED"
    # framing (b): the budget is the fixed contenders' samples; adaptive makes twice the samples per
    # step, so it runs half the steps (4) at the budget, with warm-up round(10 x 4 / 8) capped below 4
    budget = [(label, tag) for label, tag, b in launched if b]
    assert budget == [("acco-adaptive", f"/s{s}") for s in range(3)]
    brow = raw["analysis"]["budget"]["200mbit"]
    assert brow["samples"] == 8 * 4 * 8 * 2
    ad = brow["rows"]["acco-adaptive"]
    assert ad["steps"]["values"] == [4, 4, 4] and ad["samples"]["values"] == [512] * 3
    assert ad["schedule"][0] == {
        "budget_samples": 512,
        "samples_per_step": 128.0,
        "steps": 4,
        "warmup_lr_steps": 3,
    }
    assert brow["rows"]["zero1"]["steps"]["values"] == [8, 8, 8]
    md = (out / "e2e.md").read_text()
    assert "## Framing (a)" in md and "## Framing (b)" in md and "(3 seeds)" in md
    assert "| acco fixed val loss within 2% of ZeRO-1 (same samples) |" in md
    goals = {g["goal"]: g for g in raw["analysis"]["goals"]}
    assert goals["acco fixed val loss within 2% of ZeRO-1 (same samples)"]["a"][1] == "met"
    assert (
        "+1.00% [+0.50%, +1.50%] (3 seeds)"
        in goals["acco fixed val loss within 2% of ZeRO-1 (same samples)"]["a"][0]
    )
    # a planted unpaired analysis (seeds shuffled) would change the gaps: the pairing is by seed key
    shuffled = dict(block, seeds=dict(block["seeds"], acco=block["seeds"]["acco"][::-1]))
    comp = analysis.compute_only(raw["results"])
    again = analysis.analyse_rate(shuffled, comp, 4, 2)["acco"]["paired"]["val_gap"]
    assert again["values"] == pytest.approx([0.005, 0.010, 0.015])


def test_budget_schedule_ends_inside_the_budget():
    setup = runs.Setup(
        work=Path("w"), model={}, n_params=1, steps=40, warmup=5, micro_batch=8, grad_accum=4, world=2,
        threads=1, seed=0, bf16=False,
    )  # fmt: skip
    assert setup.budget_samples == 2560
    # 50 Mbit in the committed sweep: adaptive made 15616 samples in 40 steps
    sch = runs.budget_schedule(setup, 15616 / 40)
    assert sch["steps"] == 7 and sch["warmup_lr_steps"] == 2
    knobs = setup.knobs("adaptive", sch["steps"], sch["warmup_lr_steps"])
    assert (knobs.total_steps, knobs.warmup_steps) == (7, 2)
    assert runs.budget_schedule(setup, 2560 / 40)["steps"] == 40  # the fixed contenders' own pace
    assert runs.budget_schedule(setup, 10**6)["steps"] == 3  # never fewer than 3 steps


def test_the_same_seed_gives_every_contender_the_same_data_order(tmp_path):
    """The specs the e2e benchmark launches carry the seed they are given, for every contender, the
    heterogeneous and the budget runs alike, and the data loader the worker reads them with
    (``acco_ds.data.stream(train, context, micro_batch, spec.seed, rank + spec.data_offset)``) then
    gives every contender the same micro-batches in the same order; another seed another order."""
    corpus = load_corpus()
    setup = runs.Setup(
        work=tmp_path, model={"context": 32}, n_params=1000, steps=8, warmup=2, micro_batch=4, grad_accum=2,
        world=2, threads=1, seed=0, bf16=False,
    )  # fmt: skip
    sch = runs.budget_schedule(setup, 40.0)
    orders = {}
    for seed in (0, 1, 2):
        specs = [runs.contender_spec(setup, c, "200mbit", None, f"/s{seed}", seed) for c in runs.CONTENDERS]
        specs.append(runs.contender_spec(setup, "acco-adaptive", "200mbit", None, f"/s{seed}", seed, sch))
        specs.append(
            runs.contender_spec(setup, "zero1", "200mbit", {"rank": 1, "extra_s": 0.1}, "-hetero", seed)
        )
        assert {(s.seed, s.data_offset, s.tp, s.micro_batch) for s in specs} == {(seed, 0, 1, 4)}
        for rank in range(setup.world):
            per = []
            for spec in specs:
                it = stream(corpus.train, 32, spec.micro_batch, spec.seed, rank // spec.tp + spec.data_offset)
                per.append(torch.stack([next(it)[0] for _ in range(12)]))
            assert all(torch.equal(per[0], x) for x in per[1:])
            orders[seed, rank] = per[0]
    assert not torch.equal(orders[0, 0], orders[1, 0]) and not torch.equal(orders[1, 0], orders[2, 0])
    assert not torch.equal(orders[0, 0], orders[0, 1])  # the ranks read different data


def test_seed_statistics():
    s = seeds.spread([1.0, 2.0, 3.0])
    assert (s["n"], s["mean"], s["min"], s["max"]) == (3, 2.0, 1.0, 3.0) and s["sd"] == pytest.approx(1.0)
    assert seeds.fmt(s, ".1f") == "2.0 [1.0, 3.0] (3 seeds)"
    assert seeds.verdict_at_most(s, 3.0) == "met" and seeds.verdict_at_most(s, 1.5) == "MISSED"
    assert seeds.verdict_at_most(s, 2.5).startswith("not shown")
    never = seeds.spread([0.7, float("inf"), 0.6])  # a seed that never reached the target
    assert never["n_inf"] == 1 and seeds.verdict_at_most(never, 0.75) == "MISSED"
    assert "not reached" in seeds.fmt(never, ".2f")
    one = seeds.spread([0.01])
    assert seeds.verdict_within(one, -0.02, 0.02).startswith("indicative: met (1 seed")
    assert seeds.paired({0: 1.0, 1: 2.0}, {1: 4.0, 2: 8.0}, lambda a, b: a / b) == {1: 0.5}


@pytest.mark.launcher
def test_quick_benchmark_runs(tmp_path):
    """One rate, few steps: the compute-only bound, comm-only, ZeRO-1 vs ACCO adaptive, and the
    heterogeneous case (about 2-4 minutes on 2 CPU cores). Every contender must run: a failing
    ACCO contender fails this test."""
    why = link.throttle_unavailable()
    if why:
        pytest.skip(f"cannot throttle a link here: {why}")
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.e2e",
        "--quick",
        "--slow-factor",  # 3x (not 2x): a margin against other jobs slowing the fast rank on shared machines
        "3",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "w"),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    md = (out / "e2e_quick.md").read_text()
    raw = json.loads((out / "e2e_quick.json").read_text())
    for name in ("throughput", "loss", "hetero"):
        assert (out / f"e2e_quick_{name}.png").stat().st_size > 1000
    assert "AMD" in md or "Intel" in md or "machine:" in md
    assert "| 200mbit |" in md and "| zero1 |" in md and "| acco-adaptive |" in md and "## Goals" in md
    assert raw["results"]["failed"] == [] and "could not run" not in md
    bound = raw["results"]["compute"][0]
    assert len(bound["rank_samples_per_s"]) == 2 and min(bound["rank_samples_per_s"]) > 0
    assert bound["samples_per_s"] == pytest.approx(sum(bound["rank_samples_per_s"]))
    rate = raw["results"]["rates"]["200mbit"]
    assert rate["comm"]["t_comm_s"] > 0
    runs = rate["runs"]
    assert set(runs) == {"zero1", "acco-adaptive"}
    assert runs["zero1"]["steps"] == 6 and runs["zero1"]["samples_per_s"] > 0
    assert runs["acco-adaptive"]["steps"] == 6 and runs["acco-adaptive"]["samples_per_s"] > 0
    assert raw["results"]["seeds"] == [0] and len(rate["seeds"]["zero1"]) == 1
    goals = {g["goal"]: g for g in raw["analysis"]["goals"]}
    assert "acco adaptive samples/s >= 90% of compute-only at every rate" in goals
    # framing (b): adaptive at the budget of 6 x 4 x 8 x 2 samples, in the steps that budget buys
    ad = raw["analysis"]["budget"]["200mbit"]["rows"]["acco-adaptive"]
    assert raw["analysis"]["budget"]["200mbit"]["samples"] == 384
    (run,) = rate["budget"]["runs"]
    if run["how"] == "budget run":  # adaptive computed more than 5% over the budget in its 6 steps
        # the steps the budget buys at the full run's samples per step (how many micro-batches adaptive
        # fits per step varies with the machine's load, so the budget run's own sample count may too)
        per_step = runs["acco-adaptive"]["samples"] / 6
        assert run["schedule"]["samples_per_step"] == pytest.approx(per_step)
        assert run["steps"] == run["schedule"]["steps"] == max(3, round(384 / per_step)) <= 6
    assert ad["val"]["n"] == 1 and "## Framing (b)" in md
    het = raw["analysis"]["hetero"]["rows"]
    assert set(het) == {"zero1", "acco-adaptive"}
    assert het["zero1"]["slow_extra_s"][1] > 0 and het["zero1"]["slow_extra_s"][0] == 0
    # adaptive mode: the slowed rank computes fewer micro-batches than the fast one (ZeRO-1: the same)
    assert het["acco-adaptive"]["slow_extra_s"][1] > 0
    mb = het["acco-adaptive"]["rank_micro_batches"]
    assert het["zero1"]["rank_micro_batches"][0] == het["zero1"]["rank_micro_batches"][1]
    assert mb[0] > mb[1], (
        f"adaptive micro-batches per rank {mb}; samples/s per rank {het['acco-adaptive']['rank_samples_per_s']}"
    )


def test_ds_settings_of_every_deepspeed_contender():
    """The DeepSpeed settings printed for each DeepSpeed contender run, ZeRO-1 with bf16 communication (a
    contender whose label is not a mode) included; acco_ds contenders have none."""
    setup = runs.Setup(
        work=Path("w"), model={}, n_params=1000, steps=4, warmup=1, micro_batch=8, grad_accum=4, world=2,
        threads=1, seed=0, bf16=False,
    )  # fmt: skip
    got = cli.ds_settings(cli.COMPRESSION_CONTENDERS.split(","), setup.knobs("fixed"))
    assert set(got) == {"zero1", "zero1-bf16comm"}
    assert got["zero1"]["stage"] == got["zero1-bf16comm"]["stage"] == 1


def test_every_acco_contender_config_is_accepted():
    """Each acco_ds contender's optimizer params pass the optimizer's own validation with the mode and the
    compression the label names (dpu-int8: no peek, int8 commits; the peek sweep's precisions)."""
    from acco_ds.config import ACCOConfig

    setup = runs.Setup(
        work=Path("w"), model={}, n_params=1000, steps=4, warmup=1, micro_batch=8, grad_accum=4, world=2,
        threads=1, seed=0, bf16=False,
    )  # fmt: skip
    peeks = {}
    for label, (mode, accumulation) in runs.CONTENDERS.items():
        if mode not in ("sync", "dpu", "acco"):
            continue
        cfg = ACCOConfig.from_params(
            runs.contender_config(label, setup.knobs(accumulation))["optimizer"]["params"]
        )
        assert (cfg.mode, cfg.accumulation) == (mode, accumulation), label
        peeks[label] = cfg.compression.peek if cfg.compression.enabled else None
    assert peeks["dpu-int8"] == "none" and runs.CONTENDERS["dpu-int8"][0] == "dpu"
    assert [peeks[c] for c in ("acco-int8-exact-peek", "acco-int8", "acco-int8-peek-int4")] == [
        "none",
        "int8",
        "int4",
    ]
