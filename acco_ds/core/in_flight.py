"""The job in flight of ``ACCOPipeline``, its swap-in, and the bookkeeping done when its summary is read.

State owned here: ``in_flight`` (the launched job's ``(Ticket, RoundEnd)``, or None) and ``_in_flight_releases``
(its residual releases, ``core.fused_round_end``), set by ``ACCOPipeline.end_round`` and cleared at the swap-in;
``_unread`` (results swapped in whose host summary is not read yet, oldest first) and ``defer_host_reads`` (read
them one job late: always on CUDA); what the summaries count: ``committed_steps``, ``state_step`` (with
``step_tensor``, the 0-dim CPU tensor that follows it in place) and the ``stats`` the jobs fill; ``last_grad_norm``
(a device tensor, selected when a commit is swapped in, never read on the host here); ``model_holds``, what
the model's parameters view since the last swap-in ("theta" after a commit, "estimate" after acco's peek).

Which thread: everything here runs on the compute side (the caller's thread). The swap-in waits for the job (CUDA: the
compute stream waits on its done event, the host does not), then the model's parameters view the job's gathered
buffer and the buffer the model computed at is the compute side's again (``GroupBuffers.finish_job``). A summary is
read on the host (``RoundResult.wait_summary``) at once, or one job later with ``defer_host_reads``, or when the
engine's step asks for the commits swapped in (:meth:`read_swapped_commits`).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from acco_ds.core.round_job import RoundResult
from acco_ds.core.schedule import Job


class InFlight:
    """Mixin of ``ACCOPipeline`` (see the module docstring): the job in flight, its summaries and their accounting.
    Reads ``executor``, ``groups``, ``scaler`` and ``device``."""

    def _init_in_flight(self, defer_host_reads: bool) -> None:
        """Nothing in flight, nothing unread, no commit applied; the model at theta."""
        self.in_flight = None  # (Ticket, RoundEnd)
        self._in_flight_releases = None  # List[ResidualRelease] of the job in flight, when it holds residuals
        self.model_holds = "theta"  # "theta" (committed) or "estimate" (theta~, acco)
        self.committed_steps = 0  # commits swapped in (applied or skipped)
        # applied commits as a 0-dim fp32 CPU tensor, updated in place (the "step" of optimizer.state)
        self.step_tensor = torch.zeros((), dtype=torch.float32)
        self.state_step = 0  # applied commits: the AdamW step count (a property: step_tensor follows it)
        self.defer_host_reads = defer_host_reads
        self._unread: deque = deque()  # results swapped in whose summary is not read yet (oldest first)
        self.last_grad_norm: torch.Tensor | None = None

    @property
    def state_step(self) -> int:
        """Commits applied to the sharded state (swapped in and read): AdamW's step count."""
        return self._state_step

    @state_step.setter
    def state_step(self, value: int) -> None:
        self._state_step = int(value)
        self.step_tensor.fill_(float(value))

    def _in_flight_done(self) -> bool:
        return self.in_flight is None or self.executor.done(self.in_flight[0])

    def _finish_in_flight(self) -> RoundResult | None:
        """Wait for the job in flight (CUDA: the compute stream waits on its event, the host does not)
        and make its gathered parameters the model's. Its bookkeeping follows when its summary is read
        (at once, or one job later with ``defer_host_reads``)."""
        if self.in_flight is None:
            return None
        ticket, _ = self.in_flight
        t0 = time.perf_counter()
        result: RoundResult = self.executor.wait(ticket)
        self.stats.comm_wait_s += time.perf_counter() - t0
        self.in_flight = None
        self._in_flight_releases = None
        for b in self.groups:
            b.finish_job()
            b.point_params()
        self.viewing_committed = False
        self.model_holds = "theta" if result.job is Job.COMMIT else "estimate"
        if result.job is Job.COMMIT:
            self._report_norm(result)
        self._apply_loss_scale(result)
        self._unread.append(result)
        self._read_summaries(keep=1 if self.defer_host_reads else 0)
        return result

    def _report_norm(self, result: RoundResult) -> None:
        """``last_grad_norm`` once a commit is swapped in (the compute stream has waited for its job): the
        commit's global gradient norm (inf/NaN for a skipped one), or the previous norm when the commit was
        empty. Selected on the device, never read on the host, so the norm of the commit a step waited for is
        reported at that step, as DeepSpeed's ZeRO-1 reports it, even while the summary is read a job later."""
        norm = result.grad_norm
        if self.last_grad_norm is None:
            self.last_grad_norm = norm.clone()
            return
        if result.empty_flag is not None:
            empty = result.empty_flag
        else:  # restored from a checkpoint: the summary is on the host and complete
            empty = torch.tensor([result.empty], device=norm.device)
        self.last_grad_norm = torch.where(empty, self.last_grad_norm.reshape(norm.shape), norm)

    def _read_summaries(self, keep: int = 0) -> None:
        """Read the summaries of the swapped-in jobs, oldest first, all but the newest ``keep``, and do
        their bookkeeping."""
        while len(self._unread) > keep:
            result = self._unread.popleft()
            t0 = time.perf_counter()
            result.wait_summary()
            self.stats.comm_wait_s += time.perf_counter() - t0
            self._account(result)

    def read_swapped_commits(self) -> None:
        """Read the summaries of the commits swapped in so far (and of every job before the newest of them), so
        that their skips and applied steps are counted now: the engine's optimizer step calls it before it asks
        for ``overflow``, and a commit's skip is then reported at the engine step that swapped the commit in, on
        every device, as DeepSpeed's ZeRO-1 reports an overflow at the step that made it.

        With ``defer_host_reads`` (CUDA) this is a host wait for the newest swapped-in commit's job: in sync the
        job the step just waited for (the compute stream waits for it anyway, and ZeRO-1 fp16 reads its overflow
        flag on the host at each step too), in dpu the previous step's commit, which had a round of compute to
        finish. A peek swapped in after the newest commit stays unread (acco's commits are read by then): no
        wait for a job whose communication is still meant to overlap."""
        newest = max((i for i, r in enumerate(self._unread) if r.job is Job.COMMIT), default=None)
        if newest is not None:
            self._read_summaries(keep=len(self._unread) - newest - 1)

    def _account(self, result: RoundResult) -> None:
        skipped, empty, count, round_count, *rank_counts = result.summary.tolist()
        count, round_count = int(count), int(round_count)
        self.stats.last_round_counts = [int(c) for c in rank_counts]
        if result.traffic is not None:
            self.stats.last_round_bytes_sent = result.traffic.sent
            self.stats.last_round_bytes_received = result.traffic.received
            self.stats.bytes_sent += result.traffic.sent
            self.stats.bytes_received += result.traffic.received
        if result.clock is not None:
            for phase, seconds in result.clock.seconds().items():
                name = f"job_{phase}_s"
                setattr(self.stats, name, getattr(self.stats, name) + seconds)
        if result.job is Job.COMMIT:
            self.committed_steps += 1
            if empty:  # nothing to commit: state and parameters unchanged
                self.stats.empty_commits += 1
            elif skipped:
                self.stats.skipped_steps += 1
                self.stats.micro_batches_discarded += count
            else:
                self.state_step += 1
                self.stats.micro_batches_committed += count
            if self.scaler is not None:
                self.scaler.check(None if result.at_min is None else result.at_min.tolist()[0])
        else:
            if skipped and not empty:  # non-finite g~: estimate = theta, commit skips
                self.stats.skipped_peeks += 1
            elif not empty:
                self.stats.micro_batches_peeked += round_count

    def sync_in_flight(self) -> None:
        """Block until the job in flight has finished (its state is then readable); the schedule is
        unchanged: the gathered parameters are still swapped in at the planned round end. The
        summaries of the jobs already swapped in are read (their bookkeeping done)."""
        self._read_summaries()
        if self.in_flight is None:
            return
        ticket = self.in_flight[0]
        self.executor.wait(ticket)
        if ticket.cuda_done is not None:
            ticket.cuda_done.synchronize()
