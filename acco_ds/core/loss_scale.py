"""fp16 loss scaling for ACCO's rounds, decided on the device (docs/ALGORITHM.md, "fp16: loss scaling").

The rule is DeepSpeed's ``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py), applied once per
COMMIT (once per optimizer step, as ZeRO-1), to the commits that were computed under the scale in force when their
outcome is known (``counted``):

- overflow: with hysteresis left (``hysteresis > 1`` and the configured hysteresis > 1) the hysteresis drops by one;
  otherwise the scale halves, not below ``min_scale`` (at ``min_scale`` with ``raise_at_min``: the run stops, as
  DeepSpeed's raises); the overflow's iteration is remembered;
- no overflow: with ``consecutive_hysteresis`` the hysteresis is refilled; the scale doubles (and the hysteresis is
  refilled) when ``iteration - last_overflow - 1`` is a positive multiple of ``window``;
- the iteration counts the counted commits.

A commit whose rounds ran under a scale that has changed since (the ``epoch`` of the scale differs) is skipped or
applied as its own gradient says but leaves the scaler alone: it says nothing about the scale in force. In ``sync``
every commit is counted (its outcome is known before the next round starts), so the scaler is ZeRO-1's exactly.

Everything is a small fp64 tensor on the training device: no host read, so every rank takes the same decisions from
the same all-reduced norm without a host synchronisation. A commit's job computes the state after its outcome on the
communication side, from the state at its launch (every mode launches a commit with nothing in flight, so that is
the state its swap-in finds); the swap-in takes it (``DeviceLossScaler.adopt``, no operation on the compute stream).
A commit swapped in after another state change (one restored from a checkpoint) is applied on the compute stream
(``DeviceLossScaler.apply``, the same rule). The host reads the state only when asked (``scale``, ``state_dict``);
the minimum-scale error is raised from the count a job's host summary carries.

Stream contract: ``round_scale`` (a 0-dim fp32 tensor) is what the compute side multiplies its losses by; it is
written only between rounds (``begin_round``, on the compute stream). A job receives ``job_scale()``, a copy it
owns (fp64 [2]: the scale its gradients were computed under, and that scale's epoch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# state vector fields (fp64): the scaler's whole state, what checkpoints carry
SCALE, HYSTERESIS, ITERATION, LAST_OVERFLOW, EPOCH, AT_MIN = range(6)
STATE_FIELDS = ("scale", "hysteresis", "iteration", "last_overflow", "epoch", "overflow_at_min_scale")


@dataclass(frozen=True)
class LossScaleSpec:
    """The loss-scaling settings (DeepSpeed's ``fp16`` keys): ``dynamic`` (``loss_scale`` 0), ``init_scale``
    (``2 ** initial_scale_power``, or the static ``loss_scale``), ``window`` (``loss_scale_window``), ``hysteresis``,
    ``consecutive_hysteresis``, ``min_scale`` (``min_loss_scale``), ``raise_at_min`` (DeepSpeed raises when an
    overflow finds the scale at its minimum)."""

    dynamic: bool
    init_scale: float
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    raise_at_min: bool = True

    def initial_state(self) -> list:
        return [float(self.init_scale), float(self.hysteresis), 0.0, -1.0, 0.0, 0.0]


def updated_state(spec: LossScaleSpec, state: torch.Tensor, overflow: torch.Tensor, counted: torch.Tensor):
    """The scaler state after one commit (``overflow``, ``counted``: bool tensors of one element), as tensor
    operations (no host read). A static scaler never changes. ``state`` is not modified."""
    if not spec.dynamic:
        return state.clone()
    overflow, counted = overflow.reshape(()), counted.reshape(())
    s, h, it, last, epoch, at_min = (state[i] for i in range(6))
    shift = (h == 1.0) | (spec.hysteresis == 1)
    stuck = overflow & shift & (s == spec.min_scale)
    halved = torch.clamp(s / 2.0, min=spec.min_scale)
    stable = it - last - 1.0
    grow = (~overflow) & (stable > 0) & (torch.remainder(stable, float(spec.window)) == 0)
    refill = torch.full_like(h, float(spec.hysteresis))
    if spec.raise_at_min:  # DeepSpeed raises before changing anything
        new_s = torch.where(overflow, torch.where(shift & ~stuck, halved, s), torch.where(grow, s * 2.0, s))
    else:
        new_s = torch.where(overflow, torch.where(shift, halved, s), torch.where(grow, s * 2.0, s))
    h_ok = refill if spec.consecutive_hysteresis else torch.where(grow, refill, h)
    new_h = torch.where(overflow, torch.where(shift, h, h - 1.0), h_ok)
    new_last = torch.where(overflow, it, last)
    new_epoch = torch.where(new_s != s, epoch + 1.0, epoch)
    new_at_min = at_min + (stuck & spec.raise_at_min).double()
    new = torch.stack([new_s, new_h, it + 1.0, new_last, new_epoch, new_at_min])
    return torch.where(counted, new, state)


def ready_scale(spec: LossScaleSpec, state: torch.Tensor) -> torch.Tensor:
    """The scale DeepSpeed's ZeRO-1 unscales a good step by: the scale after that step's update (``stage_1_and_2``
    updates the scaler before it unscales, so a step that grows the scale is unscaled by the grown one). ``sync``
    reproduces it; fp64 [1]."""
    good = torch.zeros(1, dtype=torch.bool, device=state.device)
    return updated_state(spec, state, good, ~good)[SCALE].reshape(1)


def express_residual(residual: torch.Tensor, residual_scale: torch.Tensor, scale: torch.Tensor) -> None:
    """Compressed rounds' error-feedback residual (scaled like the gradients it was withheld from) re-expressed in
    ``scale`` (fp64 [1], the scale of the round about to add it), in place; ``residual_scale`` (fp64 [1], the scale
    it was in) becomes ``scale``. Scales are powers of two (times the initial one), so the rescale is exact unless a
    value leaves the dtype's range. Runs on whichever side holds the residual (the job, or a fused round end after
    the residual's release): a device multiply, no host read."""
    residual.mul_(scale / residual_scale)
    residual_scale.copy_(scale)


class LossScaleError(RuntimeError):
    """The gradients overflowed with the loss scale at its minimum (DeepSpeed stops the run there too)."""


class DeviceLossScaler:
    """The scaler of one pipeline: its state on ``device`` and the scale of the round being computed.

    ``begin_round(refresh)``: the next round computes under the current state's scale when ``refresh`` (every round
    in sync and dpu; in acco only rounds that start a step's accumulation, so that the two rounds a commit sums share
    one scale), else under the previous round's. ``apply(job_scale, overflow, is_commit_outcome)``: a swapped-in
    commit's outcome. ``job_scale()``: what a job is launched with."""

    def __init__(self, spec: LossScaleSpec, device: torch.device):
        self.spec = spec
        self.device = device
        self.state = torch.tensor(spec.initial_state(), dtype=torch.float64, device=device)
        self.round_scale = torch.tensor(float(spec.init_scale), dtype=torch.float32, device=device)
        self._round = self.state[
            SCALE : EPOCH + 1 : EPOCH - SCALE
        ].clone()  # fp64 [2]: scale and epoch of the round in progress
        self._raised = 0

    # -- compute side ---------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the round's scale (an fp16 loss is promoted to fp32: its gradient, the scale, reaches the
        fp16 graph cast to fp16, as DeepSpeed's ``loss * scale`` gives it)."""
        return loss * self.round_scale

    def begin_round(self, refresh: bool) -> None:
        if refresh:
            self._round = self.state[SCALE : EPOCH + 1 : EPOCH - SCALE].clone()
            self.round_scale = self._round[0].to(torch.float32)

    def job_scale(self) -> torch.Tensor:
        """fp64 [2] (scale, epoch) of the round in progress; the job owns the copy."""
        return self._round.clone()

    def apply(self, job_scale: torch.Tensor, overflow: torch.Tensor, empty: torch.Tensor) -> None:
        """A commit was swapped in (the compute stream has waited for its job): update the state with its outcome
        when it ran under the scale in force (same epoch) and was not empty."""
        counted = (job_scale[1] == self.state[EPOCH]).reshape(1) & ~empty.reshape(1)
        self.state = updated_state(self.spec, self.state, overflow.reshape(1).bool(), counted)

    def adopt(self, launched_with: torch.Tensor, next_state: torch.Tensor) -> bool:
        """A commit was swapped in whose job computed the state after its outcome from ``launched_with`` (the state
        at its launch, ``round_job.run_round_job(scaler=)``): take it, with no operation on the compute stream,
        when the state is still that one (no other commit was applied in between; the schedules launch a commit
        with nothing in flight). Returns whether it did; otherwise the caller applies the outcome itself."""
        if self.state is not launched_with:
            return False
        self.state = next_state
        return True

    # -- host side --------------------------------------------------------------------------------------
    def check(self, at_min: float | None = None) -> None:
        """Raise ``LossScaleError`` once an overflow found the scale at its minimum. ``at_min``: the state's count of
        such overflows as a job's host summary carries it (read with the summary, no wait for the compute stream);
        None: read the state itself (a host read that waits for the compute stream)."""
        if not (self.spec.dynamic and self.spec.raise_at_min):
            return
        hits = int(self.state[AT_MIN].item() if at_min is None else at_min)
        if hits > self._raised:
            self._raised = hits
            raise LossScaleError(
                f"acco_ds: the fp16 gradients overflowed with the loss scale at its minimum "
                f"(fp16.min_loss_scale={self.spec.min_scale:g}); DeepSpeed's loss scaler stops the run here too. "
                "Lower fp16.min_loss_scale, check the model for inf/NaN, or train in bf16."
            )

    @property
    def scale(self) -> float:
        """The current scale (a host read)."""
        return float(self.state[SCALE].item())

    def read(self) -> dict:
        """The current state as host numbers, one host read of the state vector (it waits for the compute stream):
        ``STATE_FIELDS`` names to floats, the state after the commits applied so far. For readers outside the
        training path (``acco_ds.deepspeed.loss_scaler_view``); the training path never calls it."""
        return dict(zip(STATE_FIELDS, self.state.tolist()))

    def state_dict(self) -> dict:
        values = self.state.cpu().tolist()
        return {**dict(zip(STATE_FIELDS, values)), "round_scale": self._round.cpu().tolist()}

    def load_state_dict(self, sd: dict) -> None:
        values = [float(sd[k]) for k in STATE_FIELDS]
        self.state = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._round = torch.tensor(sd.get("round_scale", [values[SCALE], values[EPOCH]]), dtype=torch.float64,
                                   device=self.device)  # fmt: skip
        self.round_scale = self._round[0].to(torch.float32)
        self._raised = int(values[AT_MIN])
