"""fp16 loss scaling per round for ``ACCOPipeline`` (the scaler itself is ``core.loss_scale.DeviceLossScaler``).

State owned here: ``scaler`` (None without loss scaling) and ``residual_scales`` (per group, the loss scale each
error-feedback residual is expressed in; set up with the residuals by ``ACCOPipeline.__init__``). Which thread:
:meth:`scale_loss`, :meth:`_begin_round_scale` and :meth:`_loss_scale_args` run on the compute side at a round's
start and end; :meth:`_apply_loss_scale` runs there too, when a commit is swapped in, and updates the scaler on the
device after the compute stream waited for the commit's job (never a host read of the scale). The job (the
executor's side) reads the scale and scaler state handed to it in ``_loss_scale_args``.
"""

from __future__ import annotations

import torch

from acco_ds.core import schedule
from acco_ds.core.round_job import RoundResult
from acco_ds.core.schedule import Job


class RoundScale:
    """Mixin of ``ACCOPipeline`` (see the module docstring): each round's loss scale, and the scaler's update at each
    commit swapped in. Reads ``mode``, ``phase_round``, ``world_size``, ``compression`` and ``device``."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward on: times the scale of the round in progress (fp16), else ``loss`` itself."""
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    def _loss_scale_args(self, plan: schedule.RoundEnd) -> dict:
        """A job's loss-scale arguments: the scale its gradients were computed under; sync unscales a step by the
        scale after the step's own update, as ZeRO-1 does (``loss_scale.ready_scale``)."""
        if self.scaler is None:
            return {}
        args = {"loss_scale": self.scaler.job_scale(), "residual_scales": self.residual_scales}
        if plan.job is Job.COMMIT:
            args["scaler"] = (self.scaler.spec, self.scaler.state)
            args["unscale_ready"] = self.mode == "sync"
        args["predivide"] = self._predivides(plan.job)
        if plan.job is Job.COMMIT and self.mode == "acco":
            w = float(self.world_size)
            # the kept g~ in this commit's units: predivided by W exactly where the commit's gradients are
            args["tilde_factor"] = (w if self._predivides(Job.PEEK) else 1.0) / (
                w if args["predivide"] else 1.0
            )
        return args

    def _predivides(self, job: Job) -> bool:
        """fp16 rounds whose gradients are reduced uncompressed divide them by W first, as ZeRO-1
        (``run_round_job(predivide=)``); compressed ones sum dequantized fp32 values, which do not overflow."""
        comp = self.compression[job]
        return self.scaler is not None and self.world_size > 1 and (comp is None or not comp.gradients)

    def _begin_round_scale(self) -> None:
        """The round starting now computes under the scaler's current scale, except acco's rounds of g (odd phase):
        they keep the scale of the g~ round their commit adds them to."""
        if self.scaler is not None:
            self.scaler.begin_round(refresh=self.mode != "acco" or self.phase_round % 2 == 0)

    def _apply_loss_scale(self, result: RoundResult) -> None:
        """A commit swapped in: its outcome updates the scaler (on the device, after the compute stream waited for
        its job). An empty commit says nothing about the scale."""
        if self.scaler is None or result.job is not Job.COMMIT or result.loss_scale is None:
            return
        if result.next_scaler_state is not None:
            if self.scaler.adopt(result.scaler_state, result.next_scaler_state):
                return
            result.at_min = None  # the state applied here is not the job's: check() reads it
        if result.skipped_flag is not None and result.empty_flag is not None:
            overflow, empty = result.skipped_flag, result.empty_flag
        else:  # restored from a checkpoint: the summary is on the host and complete
            overflow = torch.tensor([result.skipped], device=self.device)
            empty = torch.tensor([result.empty], device=self.device)
        self.scaler.apply(result.loss_scale, overflow & ~empty, empty)
