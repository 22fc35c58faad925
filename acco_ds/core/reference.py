"""Single-process reference of docs/ALGORITHM.md's equations: the test oracle (fixed accumulation).

It executes the rounds of ``sync``, ``dpu`` or ``acco`` one after another with W simulated
workers, each consuming its own micro-batches in order, and returns, after every optimizer step,
the committed parameters, the Adam moments and the global norm of the averaged (unclipped)
gradient that step used (``reference_run``; ``reference_trajectory`` gives the parameters only). AdamW is ``torch.optim.AdamW`` on fp32 master weights (no sharding:
sharding does not change the element-wise math); the peek is computed the way the ACCO authors'
code does it: clone the state, step, read the parameters, restore.

Contract of ``grad_fn(params, rank, micro_batch_index)``: ``params`` is a list (one per group)
of flat tensors in the compute dtype (the master weights cast, as the model sees them); it
returns the flat fp32 gradients of the MEAN loss of that micro-batch, one per group.

Compressed rounds (``reference_run(..., compression=RefCompression(...))``, docs/ALGORITHM.md "Compressed
rounds"): each simulated rank accumulates its own buffer as the pipeline does (the micro-batch gradients
divided by GAS, summed one after the other in the communication dtype), quantizes it chunk by chunk of
the padded ZeRO-1 layout with ``acco_ds.ops.quantize`` and its own error-feedback residual, and each
chunk's owner sums the dequantized chunks in fp32 (own first, then rank - 1, rank - 2, ...). With
``all_gather`` the parameters the workers compute at are replicas (``_Exchange.publish``): each round's new
parameters (cast to the compute dtype, as AdamW writes them) reach the replicas as the dequantized int8
difference to the replicas' previous values, chunk by chunk; the fp32 master weights stay exact.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Callable, List, Sequence

import torch

from acco_ds.core.buffers import padded_numel
from acco_ds.core.loss_scale import LossScaleSpec
from acco_ds.ops.adamw_settings import AdamWSettings
from acco_ds.ops.quantize import dequantize, quantize, quantize_with_residual

GradFn = Callable[[List[torch.Tensor], int, int], List[torch.Tensor]]


RefHyper = AdamWSettings.from_torch
"""``RefHyper(lr, betas, eps, weight_decay)``: the AdamW settings of one group (``AdamWSettings``, the type the
optimizer and the kernels use) from torch.optim.AdamW's argument form."""


@dataclass(frozen=True)
class RefState:
    """An AdamW state to start from (e.g. a resumed checkpoint): per group the flat fp32 ``exp_avg`` and
    ``exp_avg_sq``, and ``step``, the number of steps already applied (Adam's bias correction)."""

    exp_avg: Sequence[torch.Tensor]
    exp_avg_sq: Sequence[torch.Tensor]
    step: int


@dataclass(frozen=True)
class RefCompression:
    """The compression of the simulated rounds: ``commit`` / ``peek``: whether those rounds' gradients are
    exchanged in int8; ``block_size``; ``error_feedback``; ``comm_dtype``: the dtype of each rank's gradient
    buffer; ``gas``: the engine's gradient_accumulation_steps (the buffers hold gradients divided by it)."""

    commit: bool
    peek: bool
    block_size: int
    error_feedback: bool
    comm_dtype: torch.dtype
    gas: int
    all_gather: bool = False
    commit_bits: int = 8  # 8 or 4 (values in [-7, 7])
    peek_bits: int = 8
    all_gather_bits: int = 8


class _Exchange:
    """The gradient exchange of the simulated rounds, with one residual per rank and group (error feedback)."""

    def __init__(self, spec: RefCompression, world: int, theta0: Sequence[torch.Tensor]):
        self.spec, self.world = spec, world
        self.numels = [t.numel() for t in theta0]
        self.residuals = [
            [torch.zeros(padded_numel(n, world), dtype=spec.comm_dtype) for n in self.numels]
            for _ in range(world)
        ]
        self.replicas: List[torch.Tensor] | None = None  # what every worker computes at (all_gather)

    def publish(self, new: Sequence[torch.Tensor], compute_dtype: torch.dtype) -> List[torch.Tensor]:
        """A round's new parameters (one per group, fp32) as the workers hold them after the all-gather: the
        values cast to ``compute_dtype`` without ``all_gather``; with it, the replicas moved by the dequantized
        int8 difference of each chunk of the padded layout (what ``acco_ds.ops.adamw_difference`` and
        ``compressed_comm.exchange_quantized_difference`` do). The first call sets the replicas from ``new`` (the initial parameters, held exactly)."""
        if not self.spec.all_gather or self.replicas is None:
            out = [t.to(compute_dtype) for t in new]
            if self.spec.all_gather:
                self.replicas = [t.clone() for t in out]
            return out
        W, bs = self.world, self.spec.block_size
        for i, (rep, t) in enumerate(zip(self.replicas, new)):
            n = rep.numel()
            full, base = (torch.zeros(padded_numel(n, W), dtype=compute_dtype) for _ in range(2))
            full[:n], base[:n] = t.to(compute_dtype), rep
            for chunk, old in zip(full.view(W, -1), base.view(W, -1)):
                q, scales = quantize(chunk.float() - old.float(), bs, bits=self.spec.all_gather_bits)
                chunk.copy_(old.float() + dequantize(q, scales, bs))
            self.replicas[i] = full[:n].clone()
        return [t.clone() for t in self.replicas]

    def accumulate(self, at, count, compute_dtype, grad_fn, next_mb):
        """Every rank's buffer after ``count`` micro-batches at ``at`` (comm dtype, one per group)."""
        view = [t.to(compute_dtype) for t in at]
        per_rank = []
        for rank in range(self.world):
            bufs = [torch.zeros(n, dtype=self.spec.comm_dtype) for n in self.numels]
            for _ in range(count):
                for buf, g in zip(bufs, grad_fn(view, rank, next_mb[rank])):
                    buf += (g.float() / self.spec.gas).to(self.spec.comm_dtype)
                next_mb[rank] += 1
            per_rank.append(bufs)
        return per_rank, count * self.world

    def reduce(self, per_rank, compressed: bool, commit: bool = True, bits: int = 8) -> List[torch.Tensor]:
        """The sum over the ranks (fp64, times GAS: the sum of the micro-batch gradients), one per group. An
        uncompressed ``commit`` round first adds every rank's residual to its buffer and zeroes it (what the
        compressed peeks withheld is sent exactly with the commit)."""
        W, spec = self.world, self.spec
        out = []
        for i, n in enumerate(self.numels):
            if not compressed:
                if commit and spec.error_feedback:
                    for r, bufs in enumerate(per_rank):
                        bufs[i] += self.residuals[r][i][:n]
                        self.residuals[r][i].zero_()
                out.append(sum(bufs[i].double() for bufs in per_rank) * spec.gas)
                continue
            deq = []  # deq[r][c]: rank r's chunk c, dequantized
            for r, bufs in enumerate(per_rank):
                full = torch.zeros(padded_numel(n, W), dtype=spec.comm_dtype)
                full[:n] = bufs[i]
                chunks, rests = full.view(W, -1), self.residuals[r][i].view(W, -1)
                row = []
                for c in range(W):
                    if spec.error_feedback:
                        q, scales = quantize_with_residual(chunks[c], rests[c], spec.block_size, bits=bits)
                    else:
                        q, scales = quantize(chunks[c], spec.block_size, bits=bits)
                    row.append(dequantize(q, scales, spec.block_size))
                deq.append(row)
            owned = []
            for c in range(W):
                total = deq[c][c].clone()
                for k in range(1, W):
                    total += deq[(c - k) % W][c]
                owned.append(total.to(spec.comm_dtype))
            out.append(torch.cat(owned)[:n].double() * spec.gas)
        return out


class _Adam:
    """AdamW over flat fp32 master vectors, one torch param group per ACCO group."""

    def __init__(
        self,
        theta0: Sequence[torch.Tensor],
        clip: float,
        state: RefState | None = None,
        peek_lr_scale: float = 1.0,
    ):
        self.peek_lr_scale = float(peek_lr_scale)
        self.params = [torch.nn.Parameter(t.detach().float().clone()) for t in theta0]
        self.opt = torch.optim.AdamW([{"params": [p]} for p in self.params], foreach=False)
        self.clip = clip
        if state is not None:
            for p, m, v in zip(self.params, state.exp_avg, state.exp_avg_sq):
                self.opt.state[p] = {
                    "step": torch.tensor(float(state.step)),
                    "exp_avg": m.detach().float().clone().reshape(p.shape),
                    "exp_avg_sq": v.detach().float().clone().reshape(p.shape),
                }

    def _apply(self, avg: List[torch.Tensor], hyper: Sequence[AdamWSettings]) -> bool:
        norm = torch.sqrt(sum(g.double().square().sum() for g in avg)).float()
        self.last_norm = float(norm)
        if not torch.isfinite(norm):
            return False
        coef = 1.0
        if self.clip > 0:
            ratio = float((norm + 1e-6) / self.clip)
            if ratio > 1.0:
                coef = 1.0 / ratio
        for p, g, pg, h in zip(self.params, avg, self.opt.param_groups, hyper):
            p.grad = (g * coef).to(torch.float32)
            pg.update(**h.torch_kwargs())
        self.opt.step()
        return True

    def commit(self, avg, hyper) -> None:
        self._apply(avg, hyper)

    def peek(self, avg, hyper) -> List[torch.Tensor]:
        if self.peek_lr_scale != 1.0:
            hyper = [replace(h, lr=h.lr * self.peek_lr_scale) for h in hyper]
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

    def moment(self, key: str) -> List[torch.Tensor]:
        """``exp_avg`` or ``exp_avg_sq`` per group (zeros before the first applied step)."""
        state = self.opt.state
        return [state[p][key].detach().clone() if p in state else torch.zeros_like(p) for p in self.params]


@dataclass
class RefRun:
    """What the reference records after each committed step t (index t = step t + 1 done): one flat
    fp32 tensor per group for ``params``, ``exp_avg``, ``exp_avg_sq``; ``norms[t]`` is the global
    L2 norm of the averaged, unclipped gradient commit t used (what DeepSpeed reports)."""

    params: List[List[torch.Tensor]] = field(default_factory=list)
    exp_avg: List[List[torch.Tensor]] = field(default_factory=list)
    exp_avg_sq: List[List[torch.Tensor]] = field(default_factory=list)
    norms: List[float] = field(default_factory=list)
    # with a loss scaler: the scale after commit t's outcome, and whether commit t was skipped (non-finite)
    scales: List[float] = field(default_factory=list)
    skipped: List[bool] = field(default_factory=list)

    def record(self, adam: _Adam) -> None:
        self.params.append(adam.theta())
        self.exp_avg.append(adam.moment("exp_avg"))
        self.exp_avg_sq.append(adam.moment("exp_avg_sq"))
        self.norms.append(adam.last_norm)


def reference_trajectory(mode: str, theta0: Sequence[torch.Tensor], grad_fn: GradFn, **kwargs):
    """The committed parameters (fp32, one flat tensor per group) after each step: ``reference_run(...).params``."""
    return reference_run(mode, theta0, grad_fn, **kwargs).params


def reference_run(
    mode: str,
    theta0: Sequence[torch.Tensor],
    grad_fn: GradFn,
    *,
    world_size: int,
    micro_batches_per_round: int,
    steps: int,
    hypers: Callable[[int], Sequence[AdamWSettings]],
    clip: float = 0.0,
    compute_dtype: torch.dtype = torch.float32,
    initial_state: RefState | None = None,
    first_micro_batch: int = 0,
    step_sizes: Sequence[int] | None = None,
    compression: RefCompression | None = None,
    loss_scale: LossScaleSpec | None = None,
    peek_lr_scale: float = 1.0,
) -> RefRun:
    """The committed parameters, moments and gradient norms after each of ``steps`` steps (``RefRun``).

    ``hypers(t)`` gives the per-group AdamW settings of commit t (and of the peek predicting it).
    ``micro_batches_per_round`` is k: in acco one optimizer step takes 2k micro-batches per worker.
    ``initial_state``: start from these moments and step count at ``theta0`` (a resumed run: docs/ALGORITHM.md's start
    from a committed state; default: a fresh AdamW). ``first_micro_batch``: the index of every worker's
    first micro-batch (``grad_fn``'s third argument).

    ``step_sizes``: the micro-batches every worker takes in each optimizer step, where the engine ends
    steps of other lengths than the configured one (docs/ALGORITHM.md, "When the engine ends a step
    early"); default: every step takes the configured GAS (2k in acco, k otherwise). sync divides a step's
    sum by W * GAS whatever its length (DeepSpeed's ZeRO-1: ``engine.backward`` divided every loss by GAS);
    dpu and acco divide by the micro-batch count. acco: a step of s > k micro-batches is a stage-2 round of
    k (g~ at the estimate, or at theta after a prologue) then a stage-1 round of s - k (g at theta),
    committed together; a step of s <= k is one round whose g~ is committed alone, after which the next
    step starts with a prologue at the new theta (the start state of a resume).

    ``compression``: the rounds' gradients go through the compressed exchange (module docstring); with
    ``step_sizes`` it is not supported.

    ``loss_scale``: fp16's loss scaler (docs/ALGORITHM.md, "fp16: loss scaling"; :class:`RefLossScaler`, DeepSpeed's
    rule in plain Python), with or without ``compression``. ``grad_fn`` then returns the unscaled gradients (a non-finite one where an overflow is
    planted); ``hypers(a)`` is called with ``a``, the commits APPLIED before this one (a skipped commit does not
    advance the LR schedule); the run records the scale after every commit and which commits were skipped.

    ``peek_lr_scale``: acco's peeks step with the commit's settings but this factor on the LR
    (``ACCOConfig.peek_lr_scale``; docs/ALGORITHM.md, "The estimate's step").
    """
    if mode not in ("acco", "dpu", "sync"):
        raise ValueError(f"mode must be acco, dpu or sync; got {mode!r}")
    adam = _Adam(theta0, clip, initial_state, peek_lr_scale)
    k, W = micro_batches_per_round, world_size
    next_mb = [first_micro_batch] * W
    if loss_scale is not None and step_sizes is not None:
        raise ValueError("reference_run: loss_scale with step_sizes is not supported")
    if step_sizes is not None:
        return _reference_sized(mode, adam, k, W, list(step_sizes), hypers, compute_dtype, grad_fn, next_mb)

    if compression is not None and step_sizes is not None:
        raise ValueError("reference_run: compression with step_sizes is not supported")
    exchange = None if compression is None else _Exchange(compression, W, theta0)

    def accumulate(at: List[torch.Tensor], kind: str = "commit"):
        """One round: every worker sums k micro-batch gradients at ``at``; returns (sums, count). With
        compression the round's exchange (``kind``: "commit" or "peek") runs here, in round order."""
        if exchange is None:
            return _accumulate(at, k, W, compute_dtype, grad_fn, next_mb)
        per_rank, count = exchange.accumulate(at, k, compute_dtype, grad_fn, next_mb)
        if kind == "peek":
            return exchange.reduce(
                per_rank, compression.peek, commit=False, bits=compression.peek_bits
            ), count
        return exchange.reduce(per_rank, compression.commit, bits=compression.commit_bits), count

    def publish(new: List[torch.Tensor]) -> List[torch.Tensor]:
        """Where the workers compute after a round that sent ``new`` (the replicas; ``_Exchange.publish``)."""
        return new if exchange is None else exchange.publish(new, compute_dtype)

    if loss_scale is not None:
        return _reference_scaled(mode, adam, steps, hypers, accumulate, publish, loss_scale)
    avg = _avg
    out = RefRun()
    at_theta = publish(adam.theta())
    if mode == "sync":
        for t in range(steps):
            g, n = accumulate(at_theta)
            adam.commit(avg(g, n), hypers(t))
            at_theta = publish(adam.theta())
            out.record(adam)
    elif mode == "dpu":
        history = [at_theta]  # history[r] = theta^r, as the workers hold it
        for r in range(steps):
            g, n = accumulate(history[max(r - 1, 0)])
            adam.commit(avg(g, n), hypers(r))
            history.append(publish(adam.theta()))
            out.record(adam)
    else:
        g_tilde, n_tilde = accumulate(at_theta, "peek")  # prologue: g~^0 at theta^0
        for t in range(steps):
            g, n = accumulate(at_theta)  # stage 1 compute: g^t at theta^t
            estimate = publish(adam.peek(avg(g_tilde, n_tilde), hypers(t)))  # stage 1 comm: theta~^{t+1}
            total = [a + b for a, b in zip(g, g_tilde)]
            adam.commit(avg(total, n + n_tilde), hypers(t))  # stage 2 comm: theta^{t+1}
            at_theta = publish(adam.theta())
            out.record(adam)
            if t + 1 < steps:  # stage 2 compute: g~^{t+1} at theta~^{t+1} (the last one is unused)
                g_tilde, n_tilde = accumulate(estimate, "peek")
    return out


class RefLossScaler:
    """DeepSpeed's ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py) in plain Python, with
    the scale's ``epoch`` (how many times it changed); a static spec never changes."""

    def __init__(self, spec: LossScaleSpec):
        self.spec = spec
        self.scale, self.hysteresis = float(spec.init_scale), spec.hysteresis
        self.iteration, self.last_overflow, self.epoch = 0, -1, 0

    def copy(self) -> RefLossScaler:
        return copy.copy(self)

    def update(self, overflow: bool) -> None:
        spec, before = self.spec, self.scale
        if not spec.dynamic:
            return
        if overflow:
            if spec.hysteresis == 1 or self.hysteresis == 1:
                if self.scale == spec.min_scale and spec.raise_at_min:
                    raise RuntimeError("loss scale already at its minimum")
                self.scale = max(self.scale / 2.0, spec.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            if spec.consecutive_hysteresis:
                self.hysteresis = spec.hysteresis
            stable = self.iteration - self.last_overflow - 1
            if stable > 0 and stable % spec.window == 0:
                if not spec.consecutive_hysteresis:
                    self.hysteresis = spec.hysteresis
                self.scale *= 2.0
        self.iteration += 1
        self.epoch += self.scale != before

    def grown(self) -> float:
        """The scale after a good step's update (what ZeRO-1 unscales that step by)."""
        after = self.copy()
        after.update(False)
        return after.scale


def _reference_scaled(mode, adam, steps, hypers, accumulate, publish, spec) -> RefRun:
    """``reference_run`` with fp16's loss scaler. The scaler is updated once per commit, in commit order, by the
    commits computed under the scale in force (same epoch) when their outcome is known. Commit c's rounds ran
    under ``states[c]`` in sync (the scaler after commits < c: sync waits for each commit) and ``states[c - 1]``
    in dpu and acco (the commit before is still in flight when its rounds start; acco's two rounds of one step
    share the scale of its first). sync unscales a good step by the scale after its own update, as ZeRO-1 does:
    the step's gradient is the average times ``scale / grown`` (1/2 where the step grows the scale), its clip
    coefficient from that gradient's norm, its reported norm the average's. ``accumulate(at, kind)`` and ``publish``
    are :func:`reference_run`'s (compressed rounds included: quantization is equivariant under a power-of-two scale,
    so the scaled rounds quantize as the unscaled ones)."""
    out = RefRun()
    states = [RefLossScaler(spec)]  # states[c]: the scaler after the outcomes of commits < c
    applied = 0

    def commit(c: int, sums, count) -> None:
        nonlocal applied
        snap = states[c] if mode == "sync" else states[max(c - 1, 0)]
        avg = _avg(sums, count)
        ratio = snap.scale / snap.grown() if mode == "sync" else 1.0
        ok = adam._apply([a * ratio for a in avg], hypers(applied))
        adam.last_norm = adam.last_norm / ratio
        new = states[c].copy()
        if snap.epoch == states[c].epoch:
            new.update(not ok)
        states.append(new)
        applied += ok
        out.record(adam)
        out.scales.append(new.scale)
        out.skipped.append(not ok)

    at_theta = publish(adam.theta())
    if mode == "sync":
        for t in range(steps):
            g, n = accumulate(at_theta)
            commit(t, g, n)
            at_theta = publish(adam.theta())
    elif mode == "dpu":
        history = [at_theta]
        for r in range(steps):
            g, n = accumulate(history[max(r - 1, 0)])
            commit(r, g, n)
            history.append(publish(adam.theta()))
    else:
        g_tilde, n_tilde = accumulate(at_theta, "peek")
        for t in range(steps):
            g, n = accumulate(at_theta)
            estimate = publish(adam.peek(_avg(g_tilde, n_tilde), hypers(applied)))
            commit(t, [a + b for a, b in zip(g, g_tilde)], n + n_tilde)
            at_theta = publish(adam.theta())
            if t + 1 < steps:
                g_tilde, n_tilde = accumulate(estimate, "peek")
    return out


def _accumulate(at, count, W, compute_dtype, grad_fn, next_mb):
    """One round: every worker sums ``count`` micro-batch gradients at ``at``; returns (sums, W * count)."""
    view = [t.to(compute_dtype) for t in at]
    sums = [torch.zeros_like(t, dtype=torch.float64) for t in at]
    for rank in range(W):
        for _ in range(count):
            for s, g in zip(sums, grad_fn(view, rank, next_mb[rank])):
                s += g.double()
            next_mb[rank] += 1
    return sums, count * W


def _avg(sums, count):
    return [(s / count).float() for s in sums]


def _reference_sized(mode, adam, k, W, sizes, hypers, compute_dtype, grad_fn, next_mb) -> RefRun:
    """``reference_run`` with the engine's step lengths ``sizes`` (see its docstring)."""

    def accumulate(at, count):
        return _accumulate(at, count, W, compute_dtype, grad_fn, next_mb)

    out = RefRun()
    if mode == "sync":
        for t, s in enumerate(sizes):
            g, _ = accumulate(adam.theta(), s)
            adam.commit(_avg(g, W * k), hypers(t))
            out.record(adam)
    elif mode == "dpu":
        history = [adam.theta()]  # history[r] = theta^r
        for r, s in enumerate(sizes):
            g, n = accumulate(history[max(r - 1, 0)], s)
            adam.commit(_avg(g, n), hypers(r))
            history.append(adam.theta())
            out.record(adam)
    else:
        estimate = None  # theta~ the next stage-2 round computes at; None: a prologue at theta comes next
        for t, s in enumerate(sizes):
            at = adam.theta() if estimate is None else estimate
            if s <= k:  # one round: its g~ committed alone, then a prologue at the new theta
                g_tilde, n_tilde = accumulate(at, s)
                adam.commit(_avg(g_tilde, n_tilde), hypers(t))
                estimate = None
            else:
                g_tilde, n_tilde = accumulate(at, k)  # stage 2 of step t-1 (or the prologue): g~^t
                estimate = adam.peek(_avg(g_tilde, n_tilde), hypers(t))  # theta~^{t+1}
                g, n = accumulate(adam.theta(), s - k)  # stage 1 of step t: g^t at theta^t
                total = [a + b for a, b in zip(g, g_tilde)]
                adam.commit(_avg(total, n + n_tilde), hypers(t))
            out.record(adam)
    return out


@dataclass
class RoundsRun:
    """What :func:`reference_rounds` gives: ``at[r]``, the parameters (one flat fp32 tensor per group)
    round r computed at; ``commits[t]``, a ``RefRun``-style record after commit t (params, moments,
    norm); ``peek_norms[t]`` the norm of the g~ average peek t used (acco)."""

    at: List[List[torch.Tensor]] = field(default_factory=list)
    commits: RefRun = field(default_factory=RefRun)
    peek_norms: List[float] = field(default_factory=list)


def reference_rounds(
    mode: str,
    theta0: Sequence[torch.Tensor],
    round_grads: Sequence[Sequence[Sequence[torch.Tensor]]],
    *,
    hyper: Sequence[AdamWSettings],
    clip: float = 0.0,
    peek_lr_scale: float = 1.0,
) -> RoundsRun:
    """docs/ALGORITHM.md's equations for rounds of ANY membership (adaptive accumulation), when each
    micro-batch's gradient is known beforehand (it does not depend on the parameters, e.g. a linear
    loss): ``round_grads[r]`` lists the gradients (one flat tensor per group) of every micro-batch of
    every rank that entered round r. avg = (sum of the members) / (number of members), so a rank
    that contributed more micro-batches weighs more. Commits use ``hyper`` (a constant schedule).

    acco: round 0 is the prologue; round 2t+2 computes at theta~^{t+1} = peek(state^t, avg(round 2t)),
    round 2t+1 at theta^t, and commit t uses rounds 2t and 2t+1 together. dpu: commit r uses round r,
    which computed at theta^{r-1} (theta^0 for r = 0). A commit with no member is a no-op. ``peek_lr_scale``: as
    :func:`reference_run`'s."""
    if mode not in ("acco", "dpu"):
        raise ValueError(f"mode must be acco or dpu; got {mode!r}")
    adam = _Adam(theta0, clip, peek_lr_scale=peek_lr_scale)
    out = RoundsRun()

    def avg(members):
        total = [torch.zeros_like(t, dtype=torch.float64) for t in theta0]
        for grads in members:
            for s, g in zip(total, grads):
                s += g.double()
        return [(s / len(members)).float() for s in total]

    def commit(members):
        if members:
            adam.commit(avg(members), hyper)
        out.commits.record(adam)

    if mode == "dpu":
        theta0_ = adam.theta()
        for r, members in enumerate(round_grads):
            out.at.append(theta0_ if r < 2 else out.commits.params[r - 2])  # theta^{r-1}
            commit(members)
        return out
    estimate = adam.theta()
    for r, members in enumerate(round_grads):
        if r % 2 == 1:  # stage 1 of step t: computes at theta^t; ends with commit t (rounds r-1, r)
            out.at.append(adam.theta())
            commit(list(round_grads[r - 1]) + list(members))
        else:  # the prologue (r = 0, at theta^0) or stage 2 of step r/2 - 1 (at the estimate)
            out.at.append(estimate)
            if members:
                estimate = adam.peek(avg(members), hyper)
                out.peek_norms.append(adam.last_norm)
            else:
                estimate = adam.theta()
                out.peek_norms.append(0.0)
    return out
