"""The end of a run and a fresh start for ``ACCOPipeline``: the drain, the ranks' agreement on the round count, restart.

Collective: :meth:`finish`, :meth:`restart` and the agreement run on the compute side of every data-parallel rank,
on the control group (``control_group``, a CPU group with timeout ``comm_timeout_s``; the tensor-parallel one for
``_may_end``'s agreement); the all-gathers of theta (``_gather_committed``, :meth:`restart`) run on the job's group
(``executor.group``) once nothing is in flight. They own no state of their own: they
bring the schedule's, the job's and the buffers' state back to a start (nothing in flight, no pending gradients,
the model at theta, a new prologue) and count what no commit will use in ``stats.micro_batches_discarded``.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from acco_ds.core.round_job import all_gather_inplace


class Draining:
    """Mixin of ``ACCOPipeline`` (see the module docstring). Reads and resets the round schedule
    (``core.round_schedule``), the job in flight (``core.in_flight``) and the groups' buffers."""

    def finish(self) -> None:
        """End of training (collective): finish the job in flight and load the committed
        parameters into the model. Gradients of rounds that no commit will use are discarded."""
        if self.boundary_pending:  # the boundary has passed: its step is committed, as with engine.step()
            self.end_step()
        if self.adaptive:
            self._agree_on_round_count()
        if self.in_flight is not None:
            self._finish_in_flight()
        self._read_summaries()
        if self.model_holds == "estimate":  # the g~ of the last peek enters no commit
            self.stats.micro_batches_discarded += int(self.tilde_count[0].item())
            self._gather_committed()
        self.stats.micro_batches_discarded += self._global_pending_count()
        self.counter.reset()
        self.step_count = 0
        for b in self.groups:
            b.acc_flat.zero_()
        self.phase_round = 0  # training may go on: it restarts with a prologue at theta
        self._begin_round_scale()

    def _control_all_reduce(self, t: torch.Tensor, op, what: str, tp: bool = False) -> None:
        """All-reduce a CPU tensor on the control group (``tp``: the tensor-parallel one; timeout
        comm_timeout_s); a failure names the lost peer like a failed round does."""
        try:
            dist.all_reduce(t, op=op, group=self.tp_control_group if tp else self.control_group)
        except RuntimeError as err:
            raise self.executor.failure(what, err) from err

    def _global_pending_count(self) -> int:
        t = torch.tensor([float(self.counter.count)], dtype=torch.float64)
        self._control_all_reduce(t, dist.ReduceOp.SUM, "the end-of-run count of pending micro-batches")
        return int(t.item())

    def _agree_on_round_count(self) -> None:
        """Adaptive ranks may be one round apart when the run stops: the ranks behind end rounds
        (with the micro-batches they have) until all have launched the same number. Collective.

        With max_micro_batches_per_round, a peer may be blocked at its cap, waiting for the job of a
        round this rank has not launched, and would never reach a blocking collective. So this rank
        first announces its round count with a non-blocking all-reduce and, until every rank has
        announced, ends a round (never blocking: only when its job in flight is done) whenever a
        blocked peer waits for more rounds than this rank has launched (``BlockBoard``; without a
        store: whenever its job in flight is done, which may end rounds no peer needed). A round no
        rank put a micro-batch in is a no-op. Then no rank is training any more, and the blocking
        agreement below is safe. Ranks that are level end no round: a drain at a point where every
        rank has launched the same rounds leaves training exactly as it was."""
        if self.counter.cap is not None:
            t = torch.tensor([float(self.round_index)], dtype=torch.float64)
            try:
                work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)
                deadline = time.monotonic() + self.cfg.comm_timeout_s
                while not work.is_completed():
                    needed = self._board.needed()
                    behind = needed is None or needed > self.round_index
                    if behind and self.in_flight is not None and self._in_flight_done():
                        self.end_round()
                    elif time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the peers did not join the drain within comm_timeout_s={self.cfg.comm_timeout_s:g} s"
                        )
                    else:
                        time.sleep(0.002)
                work.wait()
            except RuntimeError as err:
                raise self.executor.failure("the agreement on the round count", err) from err
        t = torch.tensor([float(self.round_index)], dtype=torch.float64)
        self._control_all_reduce(t, dist.ReduceOp.MAX, "the agreement on the round count")
        while self.round_index < int(t.item()):
            self.end_round()

    def _gather_committed(self) -> None:
        """Put theta (the fp32 master, cast) into the model's parameters. Collective."""
        for b in self.groups:
            b.shard_of(b.model_flat).copy_(b.master)
            all_gather_inplace(b.model_flat, self.executor.group)
        self.model_holds = "theta"

    @torch.no_grad()
    def restart(self, masters: Sequence[torch.Tensor] | None = None) -> None:
        """Start over from a committed state: nothing in flight, no pending gradients, a new prologue,
        the model at theta. ``masters``: new fp32 master shards, one per group (a loaded checkpoint);
        None takes theta from the weights the model's parameters hold now (a module-only load wrote
        them there). Adam moments and step counts are kept; the error-feedback residuals (compressed
        rounds) are zeroed: what they withheld belongs to the rounds before the restart. Collective."""
        from acco_ds.core.snapshot import drain

        drain(self)
        self.in_flight = None
        self._in_flight_releases = None
        for i, b in enumerate(self.groups):
            viewed = b.params[0].data.data_ptr()
            flat = b.model_flat
            if not flat.data_ptr() <= viewed < flat.data_ptr() + flat.numel() * flat.element_size():
                raise RuntimeError("acco_ds: the model's parameters no longer view ACCO's parameter buffer.")
            b.job = None
            if masters is None:
                b.master.copy_(b.shard_of(flat).float())
            else:
                b.master.copy_(masters[i])
            for buf in {id(t): t for t in b.param_bufs + b.grad_bufs}.values():
                if buf is not flat:
                    buf.zero_()
            b.shard_of(flat).copy_(b.master)
            all_gather_inplace(flat, self.executor.group)
            if b.tilde is not None:
                b.tilde.zero_()
            b.new_acc()
            b.point_params()
            b.point_grads()
        for residual in self.residuals:  # what earlier rounds withheld is dropped with them (a fresh start)
            if residual is not None:
                residual.zero_()
        self.model_holds = "theta"
        self.viewing_committed = False
        self.phase_round = 0
        self._begin_round_scale()
        self.counter.reset()
        self.step_count = 0
        self.boundary_pending = False
        self.tilde_count[0] = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.applied_dev[0] = torch.full(
            (1,), float(self.state_step), dtype=torch.float64, device=self.device
        )
