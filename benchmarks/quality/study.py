"""One quality run in one process: the main job's tiny GPT and byte corpus trained by the single-process reference.

Contract:
- ``Setup`` holds what every run of a study shares (the model sizes, the world size, the AdamW settings of
  ``acco-train``: betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clipping at 1.0, one group over every parameter)
  and ``Setting`` what a run varies (optimizer steps, peak LR, GAS, micro-batch).
- ``Problem(setup, setting, seed)`` is the job's model and data for one seed: ``torch.manual_seed(seed)`` then
  ``acco_ds.models.build_model`` (the initialisation of every rank of ``acco-train --seed``), micro-batch ``i`` of
  simulated rank ``r`` = ``acco_ds.data.micro_batch(corpus.train, context, micro_batch, seed, r, i)`` (what rank r of
  ``acco-train`` reads), the validation loss over ``eval_windows`` windows of ``acco_ds.data.val_windows`` (all the
  ranks' windows together: the mean ``acco-train`` reports). ``grad_fn`` is ``reference_run``'s contract on one flat
  fp32 group holding every distinct parameter (the tied embedding once).
- ``lr_schedule(setup, setting)``: the LR of every commit: DeepSpeed's ``WarmupCosineLR`` as ``acco-train`` configures
  it (linear warm-up over ``warmup_steps``, cosine to ``min_lr_ratio`` x the peak at the last step), stepped over a
  plain torch optimizer; commit t takes the value after t scheduler steps (as the engine applies it: the first two
  commits have LR 0).
- ``run(problem, mode, eval_every)``: ``acco_ds.core.reference.reference_run`` of ``mode`` (fixed accumulation:
  k = GAS/2 micro-batches per round in acco, GAS in sync and dpu), recording after every commit, without storing the
  parameters of each step: the validation loss at step 0, every ``eval_every`` steps and at the last one (on the
  committed parameters theta^t), the mean training loss of the micro-batches each commit used, the reported norm; in
  acco, for every step t >= 1, ``est_dist[t]`` = ||theta~^t - theta^t|| / ||theta^t|| (the estimate the g~^t round
  computed at, against the committed parameters it estimates) and ``step_dist[t]`` = ||theta^t - theta^(t-1)|| /
  ||theta^t|| (the distance of the parameters one step older: what the estimate replaces). The recording swaps
  ``reference.RefRun`` for a subclass during the call (``record`` evaluates instead of storing); the trajectory is
  the reference's own (``tests/benchmarks/test_quality.py`` compares it with a plain ``reference_run``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Callable, List
from unittest import mock

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from acco_ds.core import reference
from acco_ds.core.reference import RefHyper
from acco_ds.data import load_corpus, micro_batch, val_windows
from acco_ds.models import GPTConfig, build_model

MODES = ("sync", "dpu", "acco")


@dataclass(frozen=True)
class Setup:
    """What every run of a study shares."""

    arch: str = "tiny"  # or gpt2 / llama: acco_ds.models' transformers decoders of the same sizes
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    context: int = 64
    world_size: int = 2
    warmup_steps: int = 15
    min_lr_ratio: float = 0.1  # acco-train's --min-lr 2e-4 over --lr 2e-3, kept when the peak LR is scaled
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_windows: int = 256

    def model_cfg(self) -> dict:
        sizes = dict(n_layer=self.n_layer, n_head=self.n_head, d_model=self.d_model, context=self.context)
        if self.arch == "tiny":
            return dict(arch="tiny", **GPTConfig(**sizes).to_dict())
        return dict(arch=self.arch, **sizes)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Setting:
    """What one run varies: ``group`` names the question it answers (base, lr, gas, length, ...);
    ``world_size`` and ``warmup_steps``, where set, replace the ``Setup``'s for this setting."""

    name: str
    group: str
    steps: int
    lr: float
    grad_accum: int
    micro_batch: int
    world_size: int | None = None
    warmup_steps: int | None = None

    def tokens_per_step(self, setup: Setup) -> int:
        """Tokens one optimizer step trains on: micro-batch x GAS x ranks x context."""
        world = self.world_size or setup.world_size
        return self.micro_batch * self.grad_accum * world * setup.context

    def applied_to(self, setup: Setup) -> Setup:
        """``setup`` with this setting's world size and warm-up where it sets them."""
        return replace(
            setup,
            world_size=self.world_size or setup.world_size,
            warmup_steps=setup.warmup_steps if self.warmup_steps is None else self.warmup_steps,
        )

    def to_dict(self) -> dict:
        return asdict(self)


_CORPUS = {}


def corpus():
    """The job's default corpus (the standard library sources), loaded once per process."""
    if "c" not in _CORPUS:
        _CORPUS["c"] = load_corpus()
    return _CORPUS["c"]


def lr_schedule(setup: Setup, setting: Setting) -> List[float]:
    """The LR of commits 0 .. steps-1 (see the module docstring)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # its warning on the schedule's first value
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=setting.lr)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=max(setting.steps, setup.warmup_steps + 1),
        warmup_num_steps=setup.warmup_steps,
        warmup_type="linear",
        cos_min_ratio=setup.min_lr_ratio,
    )
    values = []
    for _ in range(setting.steps):
        values.append(float(opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    return values


class Problem:
    """The model, data and validation windows of one seed (module docstring)."""

    def __init__(self, setup: Setup, setting: Setting, seed: int):
        self.setup, self.setting, self.seed = setting.applied_to(setup), setting, seed
        setup = self.setup
        self.data = corpus()
        torch.manual_seed(seed)
        self.model = build_model(setup.model_cfg())
        self.model.train()
        self.params = list(self.model.parameters())
        self.theta0 = parameters_to_vector(self.params).detach().clone()
        self.val = val_windows(self.data.val, setup.context, setup.eval_windows, 0, 1)
        self.on_grad: Callable | None = None  # called with (flat params, rank, index, loss) per micro-batch

    def _load(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(flat, self.params)

    def grad_fn(self, params: List[torch.Tensor], rank: int, index: int) -> List[torch.Tensor]:
        (flat,) = params
        self._load(flat)
        x, y = micro_batch(
            self.data.train, self.setup.context, self.setting.micro_batch, self.seed, rank, index
        )
        for p in self.params:
            p.grad = None
        loss = self.model(x, y)
        loss.backward()
        if self.on_grad is not None:
            self.on_grad(flat, rank, index, float(loss.detach()))
        return [parameters_to_vector([p.grad for p in self.params]).detach().clone()]

    def val_loss(self, flat: torch.Tensor, chunk: int = 64) -> float:
        """The mean validation loss at ``flat`` (weighted by the windows of each chunk, as the job's evaluation)."""
        self._load(flat)
        x, y = self.val
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, x.size(0), chunk):
                xb, yb = x[i : i + chunk], y[i : i + chunk]
                total += float(self.model(xb, yb)) * xb.size(0)
                count += xb.size(0)
        return total / count

    def hypers(self) -> Callable[[int], list]:
        s = self.setup
        lrs = lr_schedule(s, self.setting)
        return lambda t: [RefHyper(lrs[t], s.betas, s.eps, s.weight_decay)]

    def round_size(self, mode: str) -> int:
        gas = self.setting.grad_accum
        if mode == "acco" and gas % 2:
            raise ValueError(f"acco needs an even GAS, got {gas}")
        return gas // 2 if mode == "acco" else gas

    def reference_kwargs(self, mode: str) -> dict:
        """``reference_run``'s keyword arguments of this problem in ``mode`` (all but ``steps``)."""
        return dict(
            world_size=self.setup.world_size,
            micro_batches_per_round=self.round_size(mode),
            hypers=self.hypers(),
            clip=self.setup.grad_clip,
        )


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


def run(problem: Problem, mode: str, eval_every: int) -> dict:
    """One reference run of ``mode``: what the module docstring lists, as plain lists keyed by step."""
    steps = problem.setting.steps
    k = problem.round_size(mode)
    rec = {"val_step": [0], "val_loss": [problem.val_loss(problem.theta0)], "train_loss": [], "norm": []}
    est = {"step": [], "est_dist": [], "step_dist": []}
    state = {"theta": problem.theta0.clone(), "prev": None, "loss_sum": 0.0, "loss_n": 0}

    def on_grad(flat, rank, index, loss):
        state["loss_sum"] += loss
        state["loss_n"] += 1
        if mode != "acco" or rank != 0 or index % k:
            return
        r = index // k
        if r >= 2 and r % 2 == 0:  # round 2t computes g~^t at the estimate theta~^t; theta^t is committed
            t, theta, prev = r // 2, state["theta"], state["prev"]
            est["step"].append(t)
            est["est_dist"].append(_norm(flat - theta) / _norm(theta))
            est["step_dist"].append(_norm(theta - prev) / _norm(theta))

    def on_commit(step: int, adam) -> None:
        theta = adam.params[0].detach()
        state["prev"], state["theta"] = state["theta"], theta.clone()
        rec["norm"].append(adam.last_norm)
        rec["train_loss"].append(state["loss_sum"] / max(1, state["loss_n"]))
        state["loss_sum"], state["loss_n"] = 0.0, 0
        if step % eval_every == 0 or step == steps:
            rec["val_step"].append(step)
            rec["val_loss"].append(problem.val_loss(theta))

    class Recorder(reference.RefRun):
        def record(self, adam) -> None:
            self.norms.append(adam.last_norm)
            on_commit(len(self.norms), adam)

    problem.on_grad = on_grad
    try:
        with mock.patch.object(reference, "RefRun", Recorder):
            reference.reference_run(
                mode, [problem.theta0], problem.grad_fn, steps=steps, **problem.reference_kwargs(mode)
            )
    finally:
        problem.on_grad = None
    if not all(math.isfinite(v) for v in rec["val_loss"]):
        rec["nonfinite"] = True
    if mode == "acco":
        rec["estimate"] = est
    return rec
