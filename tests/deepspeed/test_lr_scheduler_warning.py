"""An ACCO run with an LR scheduler raises no "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
warning, and its commits use the schedule's values in order, the first one included.

torch's LRScheduler wraps the step() of the optimizer it drives (the engine's ``basic_optimizer``, ACCO's inner
AdamW, which ACCO never steps) and warns at its first step() when that wrapper was not called; ACCO's step marks
it as the wrapper does. That warning claims the schedule's first value is skipped, which is false for ACCO: commit
t takes the settings after t scheduler steps. Checked here on one gloo rank in this process, in sync and acco, with
DeepSpeed's WarmupLR (config ``scheduler`` section) and a torch LambdaLR (``deepspeed.initialize(lr_scheduler=)``,
as HF Trainer passes its schedule): no such warning, and the committed weights equal the single-process
reference run with the schedule's values, and differ from it with the first value skipped."""

from __future__ import annotations

import warnings

import deepspeed
import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupLR
from deepspeed.utils import safe_get_full_fp32_param

import acco_ds  # noqa: F401  (registers "ACCO")
from acco_ds.core.reference import RefHyper, reference_run
from tests.ranks import toy
from tests.ranks.inproc import ensure_single_rank_group

STEPS, GAS, LR, WD, CLIP = 6, 2, 2e-2, 0.1, 0.5
TOL = 2e-6  # fp32 weights, max abs: summation order only
WARMUP = {"warmup_min_lr": LR / 4, "warmup_max_lr": LR, "warmup_num_steps": 4}
WARNING = "before `optimizer.step()`"


def decay(t: int) -> float:
    return 1.0 / (1.0 + t)


def torch_schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, decay)


def warmup_schedule(optimizer):
    return WarmupLR(optimizer, **WARMUP)


SCHEDULES = {"warmup": warmup_schedule, "torch": torch_schedule}


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    ensure_single_rank_group()


def schedule_values(name: str) -> list:
    """The schedule's values, stepped on its own over a plain torch optimizer: value t is the lr after t steps."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = SCHEDULES[name](opt)
    values = []
    for _ in range(STEPS):
        values.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return values


def train(mode: str, schedule: str):
    """(the committed fp32 weights after each step, the warnings raised while building and training)."""
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "ACCO", "params": {"lr": LR, "weight_decay": WD, "mode": mode}},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
    }
    kwargs = {}
    if schedule == "warmup":
        cfg["scheduler"] = {"type": "WarmupLR", "params": WARMUP}
    else:
        kwargs["lr_scheduler"] = torch_schedule
    model = toy.build()
    traj = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = deepspeed.initialize(
            model=model, config=cfg, model_parameters=model.parameters(), **kwargs
        )
        params = toy.trainable(engine.module)
        try:
            for step in range(STEPS):
                for j in range(GAS):
                    engine.backward(engine(*toy.micro_batch(0, step * GAS + j)))
                    engine.step()
                traj.append(toy.flat(safe_get_full_fp32_param(p) for p in params))
        finally:
            engine.optimizer.finish()
            engine.optimizer.pipeline.close()
    return traj, [str(w.message) for w in caught]


def reference(mode: str, lrs: list) -> list:
    theta0 = toy.flat(toy.trainable(toy.build()))
    run = reference_run(
        mode,
        [theta0],
        toy.make_grad_fn(torch.float32),
        world_size=1,
        micro_batches_per_round=GAS // 2 if mode == "acco" else GAS,
        steps=STEPS,
        hypers=lambda t: [RefHyper(lrs[t], (0.9, 0.999), 1e-8, WD)],
        clip=CLIP,
    )
    return [p[0] for p in run.params]


def test_the_check_sees_the_warning():
    """Control: the recording catches torch's warning when a schedule steps before its optimizer."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = torch_schedule(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()
    assert any(WARNING in str(w.message) for w in caught)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", ["sync", "acco"])
def test_no_warning_and_the_commits_follow_the_schedule(mode, schedule):
    traj, caught = train(mode, schedule)
    assert not [m for m in caught if WARNING in m], caught
    lrs = schedule_values(schedule)
    assert len(set(lrs)) >= STEPS - 2, lrs  # WarmupLR gives its min twice, then rises to its max
    for t, (got, want) in enumerate(zip(traj, reference(mode, lrs))):
        diff = (got - want).abs().max().item()
        assert diff <= TOL, f"{mode}/{schedule} step {t + 1}: max |diff| {diff:.3e} to the reference"
    # the first value skipped (what the warning claims) would be seen
    skipped = reference(mode, lrs[1:] + lrs[-1:])
    assert (traj[-1] - skipped[-1]).abs().max().item() > 10 * TOL
