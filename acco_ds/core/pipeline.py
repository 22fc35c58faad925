"""ACCOPipeline: ACCO's two-stream pipeline over a set of parameter groups, engine-agnostic.

The caller (the DeepSpeed optimizer, or a test) drives it with:

- ``on_micro_batch_end()`` after each micro-batch backward: the parameters' ``.grad`` are
  accumulated into the round's gradient buffer and released (set to None); the round ends when
  the schedule says so (fixed: its share of micro-batches; adaptive: its share and the previous
  round's communication done).
- ``on_engine_step()`` each time the engine's optimizer step is called (LR bookkeeping).
- ``sync_in_flight()`` before reading the committed state (accessors, checkpoints): waits for the
  job in flight without changing what the next round computes at.
- ``finish()`` at the end of training: ends the work in flight and loads the committed
  parameters theta into the model. Collective.

Stream contract: the compute side (the caller's thread / current CUDA stream) owns the model
parameters' buffer and the accumulating gradient buffer of the current round. A round end hands
the accumulated gradient buffer and the *other* parameter buffer to the communication side
(``core.comm`` executor), which reduce-scatters the gradients, steps the sharded AdamW and
all-gathers the new parameters into that other buffer. The next round end waits for the job
(an event on CUDA) and re-points the model's parameters at the gathered buffer (no copy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Sequence

import torch
import torch.distributed as dist

from acco_ds.config import ACCOConfig
from acco_ds.core import schedule
from acco_ds.core.buffers import GroupBuffers, GroupLayout
from acco_ds.core.comm import make_executor
from acco_ds.core.round_job import Hyper, RoundResult, all_gather, run_round_job
from acco_ds.core.schedule import Job, RoundCounter
from acco_ds.ops.accumulate import accumulate_grads


@dataclass
class PipelineStats:
    """ACCO's own figures (per rank unless said global)."""

    rounds: int = 0
    micro_batches_local: int = 0
    micro_batches_committed: int = 0  # global: micro-batches that entered applied commits
    micro_batches_peeked: int = 0  # global: micro-batches that entered peeks
    micro_batches_discarded: int = 0  # global: gradients of rounds that end no commit (end of run)
    comm_wait_s: float = 0.0
    skipped_steps: int = 0
    last_round_counts: List[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def dtype_of(name: str, param_dtype: torch.dtype) -> torch.dtype:
    return {"auto": param_dtype, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


class ACCOPipeline:
    """See the module docstring. ``hypers`` returns the current AdamW settings per group."""

    def __init__(
        self,
        groups_params: Sequence[List[torch.nn.Parameter]],
        hypers: Callable[[], List[Hyper]],
        cfg: ACCOConfig,
        gradient_accumulation_steps: int,
        clip: float,
        dp_group=None,
    ):
        self.cfg = cfg
        self.mode = cfg.mode
        self.adaptive = cfg.accumulation == "adaptive"
        self.gas = gradient_accumulation_steps
        self.clip = float(clip or 0.0)
        self.dp_group = dp_group
        self.world_size = dist.get_world_size(dp_group)
        self.rank = dist.get_rank(dp_group)
        self._hypers = hypers
        share = schedule.micro_batches_per_round(self.mode, self.gas)
        self.counter = RoundCounter(share, self.adaptive, cfg.max_micro_batches_per_round)
        first = groups_params[0][0]
        self.device = first.device
        comm_dtype = dtype_of(cfg.comm_dtype, first.dtype)
        self.groups = [
            GroupBuffers(
                list(ps),
                GroupLayout.build(ps, self.world_size),
                self.rank,
                comm_dtype,
                keep_tilde=self.mode == "acco",
            )
            for ps in groups_params
        ]
        self.executor = make_executor(self.device, cfg.comm_timeout_s, dp_group)
        self.round_index = 0  # rounds launched since the start (global, for names and stats)
        self.phase_round = 0  # rounds since the pipeline (re)started: what schedule.plan sees
        self.commits_launched = 0  # index of the next commit (a peek predicts this one)
        self.acc_slot = 0
        self.model_slot = 0
        self.in_flight = None  # (Ticket, RoundEnd)
        self.model_holds = "theta"  # "theta" (committed) or "estimate" (theta~, acco)
        self.committed_steps = 0  # commits swapped in (applied or skipped)
        self.state_step = 0  # applied commits: the AdamW step count
        self.engine_steps = 0
        self._hyper_history: Dict[int, List[Hyper]] = {}
        self.tilde_count = [torch.zeros(1, dtype=torch.float64, device=self.device)]
        self.last_grad_norm: torch.Tensor | None = None
        self.stats = PipelineStats()

    # -- compute side -------------------------------------------------------------------------
    def on_micro_batch_end(self) -> None:
        self._record_hypers()
        for b in self.groups:
            grads = [p.grad for p in b.params]
            accumulate_grads(b.grads_flat[self.acc_slot], grads, b.layout.offsets, 1.0)
            for p in b.params:
                p.grad = None
        self.counter.add()
        self.stats.micro_batches_local += 1
        if self.counter.may_end(self._in_flight_done()):
            self.end_round()

    def on_engine_step(self) -> None:
        self.engine_steps += 1

    def _in_flight_done(self) -> bool:
        return self.in_flight is None or self.executor.done(self.in_flight[0])

    def _record_hypers(self) -> None:
        if self.engine_steps not in self._hyper_history:
            self._hyper_history[self.engine_steps] = list(self._hypers())

    def _hypers_for(self, commit_index: int) -> List[Hyper]:
        self._record_hypers()
        # the LR schedule advances once per committed step: commit t uses the settings the engine
        # had after t scheduler steps (adaptive rounds may lag behind the engine's steps).
        hyp = self._hyper_history.get(commit_index)
        if hyp is None:
            hyp = self._hyper_history[max(k for k in self._hyper_history if k <= commit_index)]
        for k in [k for k in self._hyper_history if k < commit_index]:
            del self._hyper_history[k]
        return hyp

    def end_round(self) -> None:
        """End the current round: swap in the job in flight, launch this round's job."""
        plan = schedule.plan(self.mode, self.phase_round)
        if plan.wait_previous:
            self._finish_in_flight()
        commit_index = self.commits_launched
        grad_slot = self.acc_slot
        self.acc_slot ^= 1
        for b in self.groups:
            b.grads_flat[self.acc_slot].zero_()
        step = self.state_step + 1
        job = partial(
            run_round_job,
            job=plan.job,
            commit_index=commit_index,
            step=step,
            groups=self.groups,
            hypers=self._hypers_for(commit_index),
            grad_slot=grad_slot,
            target_slot=self.model_slot ^ 1,
            local_count=torch.tensor([float(self.counter.count)], dtype=torch.float64),
            fixed_count=None if self.adaptive else self.counter.count,
            gas=self.gas,
            clip=self.clip,
            group=self.executor.group,
            tilde_count=self.tilde_count,
        )
        name = f"round {self.round_index} ({plan.job.value} of step {commit_index})"
        self.in_flight = (self.executor.launch(name, job), plan)
        self.stats.rounds += 1
        self.round_index += 1
        self.phase_round += 1
        if plan.job is Job.COMMIT:
            self.commits_launched += 1
        self.counter.reset()
        if plan.wait_now:
            self._finish_in_flight()

    def _finish_in_flight(self) -> RoundResult | None:
        if self.in_flight is None:
            return None
        ticket, _ = self.in_flight
        t0 = time.perf_counter()
        result: RoundResult = self.executor.wait(ticket)
        self.stats.comm_wait_s += time.perf_counter() - t0
        self.in_flight = None
        self.model_slot = result.target_slot
        for b in self.groups:
            b.point_params_at(self.model_slot)
        counts = result.rank_counts.tolist()
        self.stats.last_round_counts = [int(c) for c in counts]
        if result.job is Job.COMMIT:
            self.committed_steps += 1
            self.last_grad_norm = result.grad_norm
            if int(result.skipped.item()):
                self.stats.skipped_steps += 1
                self.stats.micro_batches_discarded += int(result.count.item())
            else:
                self.state_step += 1
                self.stats.micro_batches_committed += int(result.count.item())
            self.model_holds = "theta"
        else:
            self.stats.micro_batches_peeked += int(result.round_count.item())
            self.model_holds = "estimate"
        return result

    # -- draining ------------------------------------------------------------------------------
    def sync_in_flight(self) -> None:
        """Block until the job in flight has finished (its state is then readable); the schedule is
        unchanged: the gathered parameters are still swapped in at the planned round end."""
        if self.in_flight is None:
            return
        ticket = self.in_flight[0]
        self.executor.wait(ticket)
        if ticket.cuda_done is not None:
            ticket.cuda_done.synchronize()

    def finish(self) -> None:
        """End of training (collective): finish the job in flight and load the committed
        parameters into the model. Gradients of rounds that no commit will use are discarded."""
        if self.adaptive:
            self._agree_on_round_count()
        if self.in_flight is not None:
            self._finish_in_flight()
        if self.model_holds == "estimate":  # the g~ of the last peek enters no commit
            self.stats.micro_batches_discarded += int(self.tilde_count[0].item())
            self._gather_committed()
        self.stats.micro_batches_discarded += self._global_pending_count()
        self.counter.reset()
        for b in self.groups:
            b.grads_flat[self.acc_slot].zero_()
        self.phase_round = 0  # training may go on: it restarts with a prologue at theta

    def _global_pending_count(self) -> int:
        t = torch.tensor([float(self.counter.count)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.executor.group)
        return int(t.item())

    def _agree_on_round_count(self) -> None:
        """Adaptive ranks may be one round apart when the run stops: the ranks behind end rounds
        (with the micro-batches they have) until all have launched the same number."""
        t = torch.tensor([float(self.round_index)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        while self.round_index < int(t.item()):
            self.end_round()

    def _gather_committed(self) -> None:
        """Put theta (the fp32 master, cast) into the model's parameters. Collective."""
        for b in self.groups:
            b.out_shard.copy_(b.master)
            all_gather(b.params_flat[self.model_slot], b.out_shard, self.executor.group)
        self.model_holds = "theta"

    def close(self) -> None:
        self.executor.close()
