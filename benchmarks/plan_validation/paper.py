"""The paper's reported ratios (arXiv 2406.02613) against acco-plan's predictions from stated,
assumed inputs (hardware not measured here): ``validate_paper()`` returns one row per case with the
predicted ratio, the comm/compute ratio, the best ratio the model allows, and the bandwidth at which
the model gives the reported ratio (None when none does)."""

from __future__ import annotations

from acco_ds.plan.model import PlanInputs, predict

# The paper's reported figures (ACCO's time / the baseline's), with the inputs assumed
# for hardware not measured here. ``framing``: what the time ratio compares.
PAPER = [
    {
        "case": "125M on 1 x 8 H100",
        "reported": "-6% time",
        "ratio": 0.94,
        "mode": "acco",
        "framing": "a full run on the same data; the paper reports no batch change, so read at the same batch: "
        "the step-time ratio",
        "inputs": dict(
            params=125e6,
            nodes=1,
            gpus_per_node=8,
            intra_bw=400e9,
            tflops=300,
            seq=1024,
            micro_batch=16,
            gas=2,
        ),  # fmt: skip
        "assumed": "NVLink 4 busbw 400 GB/s; 300 TFLOP/s achieved (30% of bf16 dense peak); sequences of "
        "1024 tokens, micro-batch 16, GAS 2",
        "vary": "intra_bw",
    },
    {
        "case": "125M on 4 x 8 A100",
        "reported": "-25% time",
        "ratio": 0.75,
        "mode": "acco",
        "framing": "a full run on the same data; the paper reports no batch change, so read at the same batch: "
        "the step-time ratio",
        "inputs": dict(
            params=125e6,
            nodes=4,
            gpus_per_node=8,
            intra_bw=230e9,
            inter_bw=25e9,
            tflops=120,
            seq=1024,
            micro_batch=16,
            gas=2,
        ),  # fmt: skip
        "assumed": "NVLink 3 busbw 230 GB/s; 200 Gbit/s per node between nodes; 120 TFLOP/s achieved "
        "(38% of bf16 dense peak); sequences of 1024 tokens, micro-batch 16, GAS 2",
        "vary": "inter_bw",
    },
    {
        "case": "2.7B on 1 x 8",
        "reported": "43 -> 25 min",
        "ratio": 25 / 43,
        "mode": "acco",
        "framing": "a full fine-tuning run on the same data, read at the same batch: the step-time ratio",
        "inputs": dict(
            params=2.7e9, nodes=1, gpus_per_node=8, intra_bw=230e9, tflops=120, seq=512, micro_batch=8, gas=2
        ),  # fmt: skip
        "assumed": "GPU type not in the quote: A100 80GB, NVLink 3 busbw 230 GB/s, 120 TFLOP/s achieved; "
        "sequences of 512 tokens, micro-batch 8, GAS 2",
        "vary": "intra_bw",
    },
    {
        "case": "2.7B on 2 x 4",
        "reported": "3h46 -> 29 min",
        "ratio": 29 / 226,
        "mode": "acco-adaptive",
        "framing": "same token budget with much larger effective batches (the paper's setting): adaptive ACCO's time "
        "is the budget over the compute-only rate, ZeRO-1's the budget over its samples/s",
        "inputs": dict(
            params=2.7e9,
            nodes=2,
            gpus_per_node=4,
            intra_bw=230e9,
            inter_bw=25e9,
            tflops=120,
            seq=512,
            micro_batch=8,
            gas=2,
        ),  # fmt: skip
        "assumed": "A100 80GB, NVLink 3 busbw 230 GB/s, 200 Gbit/s per node between nodes, 120 TFLOP/s "
        "achieved; sequences of 512 tokens, micro-batch 8, GAS 2",
        "vary": "inter_bw",
    },
]


def _paper_plan(inp: dict, **over):
    x = {**inp, **over}
    t_mb = 6 * x["params"] * x["micro_batch"] * x["seq"] / (x["tflops"] * 1e12)
    i = PlanInputs(
        params=x["params"], t_micro_batch=t_mb, micro_batch=x["micro_batch"], gas=x["gas"], nodes=x["nodes"],
        gpus_per_node=x["gpus_per_node"], intra_bw=x["intra_bw"], inter_bw=x.get("inter_bw", 0.0),
        hbm_bw=2e12, reduce_bucket=5e8,
    )  # fmt: skip
    return predict(i)


def _time_ratio(plan, mode: str) -> float:
    """ACCO's time over ZeRO-1's for the same data: the inverse samples/s ratio."""
    return plan.row("zero1").samples_per_s / plan.row(mode).samples_per_s


def validate_paper() -> list:
    out = []
    for case in PAPER:
        plan = _paper_plan(case["inputs"])
        pred = _time_ratio(plan, case["mode"])
        # the bandwidth (the one the case varies) at which the model gives the reported ratio, on the
        # side where more bandwidth means a ratio closer to 1
        grid = [10 ** (6 + k / 40) for k in range(0, 7 * 40 + 1)]
        curve = [
            (bw, _time_ratio(_paper_plan(case["inputs"], **{case["vary"]: bw}), case["mode"])) for bw in grid
        ]
        best = min(r for _, r in curve)
        implied = None
        for (b0, r0), (b1, r1) in zip(curve, curve[1:]):
            if r0 <= case["ratio"] <= r1 and r1 > r0:
                implied = b0 * (b1 / b0) ** ((case["ratio"] - r0) / (r1 - r0))  # log-linear
        out.append(
            {
                **{k: case[k] for k in ("case", "reported", "ratio", "mode", "framing", "assumed", "vary")},
                "predicted_ratio": pred,
                "comm_compute_ratio": plan.derived["comm_compute_ratio"],
                "best_ratio": best,
                "implied_bw": implied,
            }
        )
    return out
