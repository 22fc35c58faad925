"""Single-process reference of ACCO.md's equations: the test oracle (fixed accumulation).

It executes the rounds of ``sync``, ``dpu`` or ``acco`` one after another with W simulated
workers, each consuming its own micro-batches in order, and returns the committed parameters
after every optimizer step. AdamW is ``torch.optim.AdamW`` on fp32 master weights (no sharding:
sharding does not change the element-wise math); the peek is computed the way the ACCO authors'
code does it: clone the state, step, read the parameters, restore.

Contract of ``grad_fn(params, rank, micro_batch_index)``: ``params`` is a list (one per group)
of flat tensors in the compute dtype (the master weights cast, as the model sees them); it
returns the flat fp32 gradients of the MEAN loss of that micro-batch, one per group.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, List, Sequence

import torch

GradFn = Callable[[List[torch.Tensor], int, int], List[torch.Tensor]]


@dataclass(frozen=True)
class RefHyper:
    lr: float
    betas: tuple
    eps: float
    weight_decay: float


class _Adam:
    """AdamW over flat fp32 master vectors, one torch param group per ACCO group."""

    def __init__(self, theta0: Sequence[torch.Tensor], clip: float):
        self.params = [torch.nn.Parameter(t.detach().float().clone()) for t in theta0]
        self.opt = torch.optim.AdamW([{"params": [p]} for p in self.params], foreach=False)
        self.clip = clip

    def _apply(self, avg: List[torch.Tensor], hyper: Sequence[RefHyper]) -> bool:
        norm = torch.sqrt(sum(g.double().square().sum() for g in avg)).float()
        if not torch.isfinite(norm):
            return False
        coef = 1.0
        if self.clip > 0:
            ratio = float((norm + 1e-6) / self.clip)
            if ratio > 1.0:
                coef = 1.0 / ratio
        for p, g, pg, h in zip(self.params, avg, self.opt.param_groups, hyper):
            p.grad = (g * coef).to(torch.float32)
            pg.update(lr=h.lr, betas=tuple(h.betas), eps=h.eps, weight_decay=h.weight_decay)
        self.opt.step()
        return True

    def commit(self, avg, hyper) -> None:
        self._apply(avg, hyper)

    def peek(self, avg, hyper) -> List[torch.Tensor]:
        saved_params = [p.detach().clone() for p in self.params]
        saved_state = copy.deepcopy(self.opt.state_dict())
        self._apply(avg, hyper)
        out = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, saved_params):
                p.copy_(s)
        self.opt.load_state_dict(saved_state)
        return out

    def theta(self) -> List[torch.Tensor]:
        return [p.detach().clone() for p in self.params]


def reference_trajectory(
    mode: str,
    theta0: Sequence[torch.Tensor],
    grad_fn: GradFn,
    *,
    world_size: int,
    micro_batches_per_round: int,
    steps: int,
    hypers: Callable[[int], Sequence[RefHyper]],
    clip: float = 0.0,
    compute_dtype: torch.dtype = torch.float32,
) -> List[List[torch.Tensor]]:
    """The committed parameters (fp32, one flat tensor per group) after each of ``steps`` steps.

    ``hypers(t)`` gives the per-group AdamW settings of commit t (and of the peek predicting it).
    ``micro_batches_per_round`` is k: in acco one optimizer step takes 2k micro-batches per worker.
    """
    if mode not in ("acco", "dpu", "sync"):
        raise ValueError(f"mode must be acco, dpu or sync; got {mode!r}")
    adam = _Adam(theta0, clip)
    k, W = micro_batches_per_round, world_size
    next_mb = [0] * W

    def accumulate(at: List[torch.Tensor]):
        """One round: every worker sums k micro-batch gradients at ``at``; returns (sums, count)."""
        view = [t.to(compute_dtype) for t in at]
        sums = [torch.zeros_like(t, dtype=torch.float64) for t in at]
        for rank in range(W):
            for _ in range(k):
                for s, g in zip(sums, grad_fn(view, rank, next_mb[rank])):
                    s += g.double()
                next_mb[rank] += 1
        return sums, k * W

    def avg(sums, count):
        return [(s / count).float() for s in sums]

    out: List[List[torch.Tensor]] = []
    if mode == "sync":
        for t in range(steps):
            g, n = accumulate(adam.theta())
            adam.commit(avg(g, n), hypers(t))
            out.append(adam.theta())
    elif mode == "dpu":
        history = [adam.theta()]  # history[r] = theta^r
        for r in range(steps):
            g, n = accumulate(history[max(r - 1, 0)])
            adam.commit(avg(g, n), hypers(r))
            history.append(adam.theta())
            out.append(history[-1])
    else:
        g_tilde, n_tilde = accumulate(adam.theta())  # prologue: g~^0 at theta^0
        for t in range(steps):
            g, n = accumulate(adam.theta())  # stage 1 compute: g^t at theta^t
            estimate = adam.peek(avg(g_tilde, n_tilde), hypers(t))  # stage 1 comm: theta~^{t+1}
            total = [a + b for a, b in zip(g, g_tilde)]
            adam.commit(avg(total, n + n_tilde), hypers(t))  # stage 2 comm: theta^{t+1}
            out.append(adam.theta())
            if t + 1 < steps:  # stage 2 compute: g~^{t+1} at theta~^{t+1} (the last one is unused)
                g_tilde, n_tilde = accumulate(estimate)
    return out
