"""acco's equations with one thing changed at a time: the study's probes of the gap's cause and its candidate remedies.

``variant_run(problem, variant, eval_every)`` runs docs/ALGORITHM.md's acco with fixed accumulation on a
``study.Problem`` (the same model, data, AdamW settings, clipping and LR schedule as ``study.run``), and records what
``study.run`` records, plus, every ``variant.probe_every`` steps, the gradient mismatch (below). With
``Variant()`` (every knob at its default) the trajectory is ``reference_run("acco", ...)``'s, bit for bit
(``tests/benchmarks/test_quality_variants.py``). The knobs:

- ``est_scale`` c (a probe, not a remedy: it needs theta^{t+1} before the round that computes at the estimate has
  started, which the overlap forbids): the g~^{t+1} round computes at theta^{t+1} + c (theta~^{t+1} - theta^{t+1})
  instead of at theta~^{t+1}. c = 1 is acco, c = 0 computes every gradient at the committed parameters (sync's
  gradients, acco's split of the data): the dose-response of the gap to the estimate's error.
- ``peek_momentum`` lambda: the peek steps with (1 - lambda) avg(g~^t) + lambda m^t / (1 - beta1^t) (the committed
  first moment, bias-corrected; the half-batch g~ alone at step 0) instead of avg(g~^t): a less noisy estimate.
- ``peek_lr_scale`` s: the peek steps with s x the commit's LR (a shorter or longer estimate step; realisable,
  unlike ``est_scale``: s > 1 looks further ahead along the half-batch step).
- ``commit_weight`` alpha: the commit averages g^t + alpha g~^t over n^t + alpha n~^t: the half computed at the
  estimate weighs alpha (1: acco; 0: only the exact half is committed, from half the data).
- ``estimate_micro_batches`` k~: the g~ round takes k~ of the GAS micro-batches, the g round GAS - k~ (acco:
  GAS/2): a different split of the accumulation between the two rounds.
- ``rank_extra`` (e_0, ..., e_{W-1}): rank i takes e_i more micro-batches in every round than fixed accumulation's
  (both rounds of a step; the prologue too), and every average divides by the total count: adaptive accumulation
  emulated with a fixed timing (a rank that is e_i micro-batches faster than its round's communication keeps
  computing), deterministic where the job's adaptive mode depends on the machine's timing.
- ``curvature_lambda`` lambda: the commit's g~ half is corrected to first order toward theta^t,
  g~ + lambda v^t / (1 - beta2^t) (.) (theta^t - theta~^t) n~ (per summed micro-batch), with Adam's bias-corrected
  second moment as the diagonal curvature (a Gauss-Newton / Fisher proxy; DC-ASGD's correction with v for g (.) g).

Every run records, beside ``study.run``'s estimate distances, ``along[t]``: how far along the committed step
theta^t - theta^{t-1} the estimate theta~^t lies (``_along``: 1 on the committed parameters, < 1 behind them).

The mismatch probe (``probe_every`` > 0): at every probed step t >= 1, the g~^t micro-batches are also evaluated at
theta^t (the parameters they estimate), without changing the run, and the record's ``probe`` lists, per probed step,
``mismatch`` = ||g(theta~) - g(theta)|| / ||g(theta)|| (the error of the g~ half, summed over its micro-batches and
ranks), ``half_noise`` = ||g~(theta) - g(theta^t)|| / ||g(theta^t)|| between the two halves' data at the same
parameters (the batch noise acco's estimate error is to be compared with) and ``cos`` = the cosine of g(theta~) -
g(theta) with the full committed gradient.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import List

import torch

from acco_ds.core import reference
from benchmarks.quality.study import Problem, _norm


@dataclass(frozen=True)
class Variant:
    """One variant of acco (module docstring); ``name`` labels it in the results."""

    name: str = "acco"
    est_scale: float = 1.0
    peek_momentum: float = 0.0
    peek_lr_scale: float = 1.0
    commit_weight: float = 1.0
    estimate_micro_batches: int | None = None
    curvature_lambda: float = 0.0
    rank_extra: tuple = ()
    probe_every: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self, grad_accum: int) -> None:
        k = self.estimate_micro_batches
        if k is not None and not 1 <= k < grad_accum:
            raise ValueError(
                f"estimate_micro_batches must be in [1, GAS - 1] = [1, {grad_accum - 1}], got {k}"
            )
        if not 0.0 <= self.peek_momentum <= 1.0:
            raise ValueError(f"peek_momentum must be in [0, 1], got {self.peek_momentum}")
        if any(e < 0 for e in self.rank_extra):
            raise ValueError(f"rank_extra must hold counts >= 0, got {self.rank_extra}")
        if self.commit_weight < 0 or self.curvature_lambda < 0 or self.probe_every < 0:
            raise ValueError("commit_weight, curvature_lambda and probe_every must be >= 0")


def _moment(adam, key: str, step_key: str = "step"):
    p = adam.params[0]
    st = adam.opt.state.get(p)
    if not st:
        return None, 0
    return st[key].detach().clone().reshape(-1), int(float(st[step_key]))


def _along(estimate, prev, theta) -> float:
    """How far along the committed step the estimate is: <estimate - theta^t, theta^{t+1} - theta^t> /
    ||theta^{t+1} - theta^t||^2 (1: on the committed parameters' projection; < 1: behind them; 0 where no step)."""
    step = (theta - prev).double()
    sq = float(torch.dot(step, step))
    return float(torch.dot((estimate - prev).double(), step)) / sq if sq else 0.0


def variant_run(problem: Problem, variant: Variant, eval_every: int) -> dict:
    """One acco run of ``variant`` on ``problem``: ``study.run``'s record (module docstring) plus ``probe``."""
    setting, setup = problem.setting, problem.setup
    variant.check(setting.grad_accum)
    steps, W = setting.steps, setup.world_size
    if variant.rank_extra and len(variant.rank_extra) != W:
        raise ValueError(f"rank_extra needs one count per rank ({W}), got {variant.rank_extra}")
    extra = list(variant.rank_extra) or [0] * W
    k_est = variant.estimate_micro_batches or setting.grad_accum // 2
    k_exact = setting.grad_accum - k_est
    hypers = problem.hypers()
    beta1, beta2 = setup.betas
    adam = reference._Adam([problem.theta0], setup.grad_clip)
    next_mb = [0] * W
    rec = {"val_step": [0], "val_loss": [problem.val_loss(problem.theta0)], "train_loss": [], "norm": []}
    est = {"step": [], "est_dist": [], "step_dist": [], "along": []}
    probe = {"step": [], "mismatch": [], "half_noise": [], "cos": []}
    losses = {"sum": 0.0, "n": 0}

    def on_grad(flat, rank, index, loss):
        losses["sum"] += loss
        losses["n"] += 1

    def accumulate(at, count, start=None):
        """Every rank sums ``count`` micro-batch gradients at ``at`` from its next ones (or from ``start``)."""
        cursor = list(next_mb) if start is None else list(start)
        total = torch.zeros_like(at, dtype=torch.float64)
        n = 0
        for rank in range(W):
            for _ in range(count + extra[rank]):
                total += problem.grad_fn([at], rank, cursor[rank])[0].double()
                cursor[rank] += 1
                n += 1
        if start is None:
            next_mb[:] = cursor
        return total, n

    def commit_record(t: int, prev_theta):
        theta = adam.params[0].detach()
        rec["norm"].append(adam.last_norm)
        rec["train_loss"].append(losses["sum"] / max(1, losses["n"]))
        losses["sum"], losses["n"] = 0.0, 0
        if (t + 1) % eval_every == 0 or t + 1 == steps:
            rec["val_step"].append(t + 1)
            rec["val_loss"].append(problem.val_loss(theta))
        return theta.clone()

    def peek_grad(g_tilde_avg):
        if variant.peek_momentum == 0.0:
            return g_tilde_avg
        m, step = _moment(adam, "exp_avg")
        if m is None:
            return g_tilde_avg
        lam = variant.peek_momentum
        return (1.0 - lam) * g_tilde_avg + lam * m / (1.0 - beta1**step)

    problem.on_grad = on_grad
    try:
        theta = adam.theta()[0]
        g_tilde_start = list(next_mb)
        g_tilde, n_tilde = accumulate(theta, k_est)  # prologue: g~^0 at theta^0
        at_tilde = theta
        for t in range(steps):
            g, n = accumulate(theta, k_exact)  # stage 1 compute: g^t at theta^t
            if t >= 1 and variant.probe_every and t % variant.probe_every == 0:
                on, problem.on_grad = problem.on_grad, None
                g_exact, _ = accumulate(theta, k_est, start=g_tilde_start)
                problem.on_grad = on
                ref = _norm(g_exact)
                diff = g_tilde - g_exact
                full = g + g_tilde
                probe["step"].append(t)
                probe["mismatch"].append(_norm(diff) / ref)
                probe["half_noise"].append(_norm(g_exact / n_tilde - g / n) / _norm(g / n))
                dn = _norm(diff)
                probe["cos"].append(
                    float(torch.dot(diff.double(), full.double())) / (dn * _norm(full)) if dn else 0.0
                )
            hyper = hypers(t)
            peek_hyper = hyper
            if variant.peek_lr_scale != 1.0:
                peek_hyper = [replace(h, lr=h.lr * variant.peek_lr_scale) for h in hyper]
            estimate = adam.peek([peek_grad(reference._avg([g_tilde], n_tilde)[0])], peek_hyper)[0]
            g_tilde_c = g_tilde
            if variant.curvature_lambda:
                v, step = _moment(adam, "exp_avg_sq")
                if v is not None:
                    curv = variant.curvature_lambda * v / (1.0 - beta2**step)
                    g_tilde_c = g_tilde + (curv * (theta - at_tilde)).double() * n_tilde
            total = g + variant.commit_weight * g_tilde_c
            count = n + variant.commit_weight * n_tilde
            adam.commit([(total / count).float()], hyper)
            prev = theta
            theta = commit_record(t, prev)
            if t + 1 < steps:  # stage 2 compute: g~^{t+1} at the estimate (the last one is unused)
                at_tilde = (
                    theta + variant.est_scale * (estimate - theta) if variant.est_scale != 1.0 else estimate
                )
                est["step"].append(t + 1)
                est["est_dist"].append(_norm(at_tilde - theta) / _norm(theta))
                est["step_dist"].append(_norm(theta - prev) / _norm(theta))
                est["along"].append(_along(at_tilde, prev, theta))
                g_tilde_start = list(next_mb)
                g_tilde, n_tilde = accumulate(at_tilde, k_est)
    finally:
        problem.on_grad = None
    if not all(math.isfinite(v) for v in rec["val_loss"]):
        rec["nonfinite"] = True
    rec["estimate"] = est
    if probe["step"]:
        rec["probe"] = probe
    rec["variant"] = variant.to_dict()
    return rec


def probe_summary(probe: dict, steps: int) -> List[dict]:
    """The probe's mismatch, half-batch noise and cosine averaged over each third of the run."""
    out = []
    for lo, hi in ((1, steps / 3), (steps / 3, 2 * steps / 3), (2 * steps / 3, steps)):
        idx = [i for i, s in enumerate(probe["step"]) if lo <= s <= hi]
        out.append(
            {
                key: (sum(probe[key][i] for i in idx) / len(idx)) if idx else None
                for key in probe
                if key != "step"
            }
        )
    return out
