"""The fused round end (acco_ds.core.fused_round_end): a compressed round quantized in its last backward's gradient
hooks gives the bits of the round quantized by its job (``compression.fuse_round_end=false``).

One rank (the multi-rank twins are in tests/core/test_trajectories.py), real DeepSpeed engines on a model with
odd sizes, tied weights, a frozen parameter, a parameter larger than many blocks and one that gets no gradient in
some micro-batches (its blocks are then quantized by the round end's leftover pass). Compared bit for bit after
every step: the committed fp32 parameters, both moments, the reported norm and the error-feedback residual; and
at the end the model's parameters. Modes acco, dpu and sync; fp32, bf16 and bf16 parameters with fp32
communication (the fold hooks' layout); int8 and int4; with and without error feedback; compressed peeks with an
exact commit; rounds of one and of two micro-batches. Adaptive rounds are never fused. The errors: a round end
other than the one declared before the backward, and a second gradient in a fused micro-batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

deepspeed = pytest.importorskip("deepspeed")

import acco_ds  # noqa: E402,F401
from acco_ds.core import snapshot  # noqa: E402
from tests.ranks.inproc import ensure_single_rank_group  # noqa: E402

VOCAB, DIM, WIDE = 13, 6, 41


class Model(torch.nn.Module):
    """Tied embedding / output, a frozen parameter, a wide layer (many whole blocks), and ``rare``, used only by
    micro-batches whose first token is even (no gradient in the others)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.wide = torch.nn.Linear(DIM, WIDE)
        self.frozen = torch.nn.Parameter(torch.randn(WIDE) * 0.1, requires_grad=False)
        self.back = torch.nn.Linear(WIDE, DIM)
        self.rare = torch.nn.Linear(DIM, DIM, bias=False)
        self.out = torch.nn.Linear(DIM, VOCAB)
        self.out.weight = self.emb.weight

    def forward(self, x, y):
        h = self.emb(x)
        h = h + self.back(F.gelu(self.wide(h) + self.frozen))
        if int(x[0, 0]) % 2 == 0:
            h = h + self.rare(h)
        logits = self.out(h).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def batch(index: int):
    g = torch.Generator().manual_seed(1009 + index)
    x = torch.randint(0, VOCAB, (3, 5), generator=g)
    return x, torch.randint(0, VOCAB, (3, 5), generator=g)


def config(mode, precision, compression, gas, fuse, accumulation="fixed") -> dict:
    comm = "fp32" if precision == "mixed" else "auto"
    comp = dict(compression, fuse_round_end=fuse)
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "ACCO",
            "params": {
                "lr": 3e-2,
                "weight_decay": 0.01,
                "mode": mode,
                "comm_dtype": comm,
                "accumulation": accumulation,
                "compression": comp,
            },
        },
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 0.5,
        "bf16": {"enabled": precision != "fp32"},
        "steps_per_print": 10**9,
    }


def train(cfg: dict, steps: int) -> dict:
    ensure_single_rank_group()
    torch.manual_seed(0)
    model = Model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    params = [p for p in engine.module.parameters() if p.requires_grad]
    pipe = engine.optimizer.pipeline
    out = {"master": [], "exp_avg": [], "exp_avg_sq": [], "norm": [], "residual": []}
    gas = cfg["gradient_accumulation_steps"]
    for step in range(steps):
        for j in range(gas):
            loss = engine(*batch(step * gas + j))
            engine.backward(loss)
            engine.step()
        snapshot.drain(pipe)
        b = pipe.groups[0]
        out["master"].append(b.master.clone())
        out["exp_avg"].append(b.exp_avg.clone())
        out["exp_avg_sq"].append(b.exp_avg_sq.clone())
        norm = engine.get_global_grad_norm()
        out["norm"].append(None if norm is None else float(norm))
        residual = pipe.residuals[0]
        out["residual"].append(None if residual is None else residual.clone())
    engine.optimizer.finish()
    out["model"] = torch.cat([p.detach().reshape(-1).float() for p in params])
    out["stats"] = engine.optimizer.stats()
    pipe.close()
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


CASES = {
    "acco_bf16_int8": ("acco", "bf16", {"commit": "int8", "peek": "int8", "block_size": 16}, 4),
    "acco_bf16_int8_rounds_of_one": ("acco", "bf16", {"commit": "int8", "peek": "int8", "block_size": 16}, 2),
    "acco_fp32_int4_peek_all_gather": (
        "acco",
        "fp32",
        {"commit": "int8", "peek": "int4", "all_gather": "int8", "block_size": 7},
        4,
    ),
    "acco_mixed_int8": ("acco", "mixed", {"commit": "int8", "peek": "int8", "block_size": 16}, 4),
    "acco_fp32_peek_only": ("acco", "fp32", {"commit": "none", "peek": "int8", "block_size": 16}, 2),
    "dpu_fp32_int8_no_error_feedback": (
        "dpu",
        "fp32",
        {"commit": "int8", "block_size": 16, "error_feedback": False},
        2,
    ),
    "sync_bf16_int4": ("sync", "bf16", {"commit": "int4", "block_size": 16}, 3),
}
STEPS = 5


@pytest.mark.parametrize("name", CASES)
def test_fused_round_end_gives_the_unfused_bits(name):
    mode, precision, comp, gas = CASES[name]
    fused = train(config(mode, precision, comp, gas, True), STEPS)
    plain = train(config(mode, precision, comp, gas, False), STEPS)
    rounds = fused["stats"]["rounds"]
    compressed_rounds = rounds if comp["commit"] != "none" else rounds - STEPS  # the exact commits are not
    assert fused["stats"]["fused_round_ends"] == compressed_rounds > 0, fused["stats"]
    assert plain["stats"]["fused_round_ends"] == 0
    for key in ("master", "exp_avg", "exp_avg_sq", "norm", "residual", "model"):
        assert same(fused[key], plain[key]), (
            f"{name}: {key} differs between the fused and the unfused round ends"
        )
    assert not torch.equal(fused["master"][0], fused["master"][-1])  # it trained


def test_adaptive_rounds_are_not_fused():
    comp = {"commit": "int8", "peek": "int8", "block_size": 16}
    got = train(config("acco", "fp32", comp, 2, True, accumulation="adaptive"), 3)
    assert got["stats"]["fused_round_ends"] == 0 and got["stats"]["rounds"] > 0


def _engine(cfg):
    ensure_single_rank_group()
    torch.manual_seed(0)
    model = Model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def test_a_round_end_other_than_the_declared_one_is_refused():
    """The pipeline was told the micro-batch ends the step (so its round), then told it does not: the round's
    gradients were quantized for a round end that does not come, and it says so."""
    engine = _engine(config("dpu", "fp32", {"commit": "int8", "block_size": 16}, 2, True))
    pipe = engine.optimizer.pipeline
    try:
        pipe.on_backward_start(boundary=True)
        engine.module(*batch(0)).backward()
        with pytest.raises(RuntimeError, match="did not end the round that on_backward_start declared"):
            pipe.on_micro_batch_end(boundary=False)
        # the hooks are gone: the next micro-batch accumulates as usual
        pipe.on_backward_start()
        engine.module(*batch(1)).backward()
        pipe.on_micro_batch_end(boundary=False)
    finally:
        pipe.close()


def test_a_second_gradient_in_a_fused_micro_batch_is_refused():
    engine = _engine(config("sync", "fp32", {"commit": "int8", "block_size": 16}, 1, True))
    pipe = engine.optimizer.pipeline
    try:
        pipe.on_backward_start(boundary=True)
        engine.module(*batch(0)).backward()
        with pytest.raises(
            RuntimeError, match="second gradient in the micro-batch that ends a compressed round"
        ):
            engine.module(*batch(0)).backward()
    finally:
        pipe._fused.abandon()
        pipe.close()


def test_the_first_fold_waits_for_the_job_that_holds_the_residual():
    """The job in flight writes the residual (its own quantization) and releases it 0.3 s later, on another
    thread: the fold reads the residual the job left, not the one before it."""
    import threading
    import time

    from acco_ds.core.buffers import GroupBuffers, GroupLayout
    from acco_ds.core.compressed_comm import Compression
    from acco_ds.core.fused_round_end import BlockOwners, FusedRoundEnd, ResidualRelease
    from acco_ds.core.schedule import plan
    from acco_ds.ops.quantize import quantize_with_residual_ref

    params = [torch.nn.Parameter(torch.randn(64))]
    b = GroupBuffers(
        params, GroupLayout.build(params, 1), 0, torch.float32, keep_tilde=False, overlapped=True
    )
    residual = torch.zeros(b.layout.padded_numel)
    release = ResidualRelease(torch.device("cpu"))
    left_by_job = torch.randn(b.layout.padded_numel)

    def job():
        time.sleep(0.3)
        residual.copy_(left_by_job)
        release.release()

    fused = FusedRoundEnd(
        plan("dpu", 1),
        [b],
        [BlockOwners(b, 16)],
        Compression(16, True),
        [residual],
        [release],
        lambda: False,
        30.0,
    )
    grad = torch.randn(64)
    thread = threading.Thread(target=job)
    thread.start()
    fused.fold(0, 0, grad)
    thread.join()
    q, scales = fused.finish()[0]
    want_residual = left_by_job.clone()
    want_q, want_scales = quantize_with_residual_ref(grad, want_residual[:64], 16)
    assert torch.equal(q[:64], want_q) and torch.equal(scales[:4], want_scales)
    assert torch.equal(residual[:64], want_residual[:64])


def _one_group_fused_round_end(release, job_finished, timeout_s):
    from acco_ds.core.buffers import GroupBuffers, GroupLayout
    from acco_ds.core.compressed_comm import Compression
    from acco_ds.core.fused_round_end import BlockOwners, FusedRoundEnd
    from acco_ds.core.schedule import plan

    params = [torch.nn.Parameter(torch.randn(64))]
    b = GroupBuffers(
        params, GroupLayout.build(params, 1), 0, torch.float32, keep_tilde=False, overlapped=True
    )
    residual = torch.zeros(b.layout.padded_numel)
    fused = FusedRoundEnd(
        plan("dpu", 1), [b], [BlockOwners(b, 16)], Compression(16, True), [residual], [release], job_finished,
        timeout_s,
    )  # fmt: skip
    return fused, residual


def test_a_job_that_never_releases_the_residual_is_an_error_not_a_race():
    """The job in flight neither releases the residual nor finishes within comm_timeout_s: the first fold raises,
    naming the rank, the group and the phase, and leaves the residual (which the job may still write) alone."""
    import time

    from acco_ds.core.fused_round_end import ResidualRelease

    fused, residual = _one_group_fused_round_end(ResidualRelease(torch.device("cpu")), lambda: False, 0.2)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        fused.fold(0, 0, torch.randn(64))
    assert time.monotonic() - start >= 0.2
    text = str(err.value)
    for part in ("rank 0", "parameter group 0", "first gradient fold", "commit", "comm_timeout_s=0.2"):
        assert part in text, (part, text)
    assert torch.count_nonzero(residual) == 0, "the fold wrote the residual the job still holds"
    assert fused.targets == [None], "the fold went on after the deadline"


def test_a_job_that_failed_before_releasing_lets_the_fold_go_on():
    """A job that finished without releasing (it raised; its error surfaces at the round end's wait) no longer
    holds the residual: the fold goes on at once."""
    import time

    from acco_ds.core.fused_round_end import ResidualRelease

    fused, residual = _one_group_fused_round_end(ResidualRelease(torch.device("cpu")), lambda: True, 30.0)
    start = time.monotonic()
    fused.fold(0, 0, torch.randn(64))
    assert time.monotonic() - start < 5.0
    assert fused.targets[0] is not None
    fused.abandon()
