#!/usr/bin/env python3
"""Plant known bugs in a scratch copy of the project and check that its own tests catch each one.

    python scripts/mutation_check.py                 # every mutant (about 40 min on 2 CPU cores)
    python scripts/mutation_check.py --only M06,M08  # a subset
    python scripts/mutation_check.py --list          # the mutants, without running anything

What it does: copies the working tree (as it is on disk, uncommitted changes included; no .git) to a
scratch folder, checks that the copy imports its own ``acco_ds`` and that the tests each mutant names
pass there unmutated (the baseline), then, for each mutant, replaces one exact piece of source text
(it must occur exactly once, else the mutant is reported "stale": the code moved and the mutant must
be updated), rebuilds the CPU extension when a C++ source changed, runs the mutant's tests with
``pytest -x``, and restores the file. A mutant is "caught" when its tests fail, "SURVIVED" when they
pass. Writes the table (Markdown) to stdout and, with ``--out``, to a file.

Exit status: 0 when every mutant was caught; 1 when one survived or is stale; 2 when the baseline
fails (the report would mean nothing).

The mutants are gradient-scale bugs that once survived the tests, and others of
the same family: each is a wrong equation that a plausible edit could introduce.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAJ = ["tests/core/test_trajectories.py"]
OPS = ["tests/ops/test_adamw.py"]


@dataclass(frozen=True)
class Mutant:
    id: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple

    @property
    def native(self) -> bool:
        return self.path.startswith("csrc/")


MUTANTS = [
    Mutant(
        "M01",
        "weight decay dropped (Python AdamW)",
        "acco_ds/ops/adamw.py",
        "p.mul_(1.0 - s.lr * s.weight_decay)",
        "p.mul_(1.0)",
        tuple(OPS),
    ),
    Mutant(
        "M02",
        "weight decay dropped (C++/CUDA AdamW math)",
        "csrc/adamw/adamw_math.h",
        "p = p * h.decay;",
        "p = p * 1.0f;",
        tuple(OPS),
    ),
    Mutant(
        "M03",
        "bias corrections swapped (the kernels' scalars)",
        "acco_ds/ops/adamw_settings.py",
        "        bc1 = 1.0 - beta1**step\n        bc2 = 1.0 - beta2**step",
        "        bc1 = 1.0 - beta2**step\n        bc2 = 1.0 - beta1**step",
        tuple(OPS + TRAJ),
    ),
    Mutant(
        "M04",
        "commit uses only g (the kept g~ is not added)",
        "acco_ds/core/round_job.py",
        "grad.add_(b.tilde)",
        "grad.add_(b.tilde, alpha=0.0)",
        tuple(TRAJ),
    ),
    Mutant(
        "M05",
        "the peek writes the optimizer state",
        "acco_ds/core/round_job.py",
        "        commit = job is Job.COMMIT\n",
        "        commit = True\n",
        tuple(TRAJ),
    ),
    Mutant(
        "M06",
        "commit divides g + g~ by n instead of n + n~",
        "acco_ds/core/round_job.py",
        "count = count + tilde_count[0]",
        "count = count + 0 * tilde_count[0]",
        tuple(TRAJ),
    ),
    Mutant(
        "M07",
        "fixed accumulation: the update multiplied by W (the count is one rank's)",
        "acco_ds/core/round_job.py",
        "rank_counts = torch.full((world,), float(fixed_count), dtype=torch.float64, device=dev)",
        "rank_counts = torch.full((world,), float(fixed_count) / world, dtype=torch.float64, device=dev)",
        tuple(TRAJ),
    ),
    Mutant(
        "M08",
        "adaptive: the optimizer's scale divided by the local count (norm and stats global)",
        "acco_ds/core/round_job.py",
        "    scale = avg_scale\n",
        "    scale = avg_scale if fixed_count is not None else torch.full_like(avg_scale, gas / max(local_count, 1))\n",
        ("tests/core/test_adaptive.py",),
    ),
    Mutant(
        "M09",
        "a job's bias corrections use the applied step count instead of the step it computes",
        "acco_ds/core/round_hypers.py",
        "h.hyper_scalars(applied + 1)",
        "h.hyper_scalars(max(applied, 1))",
        tuple(TRAJ),
    ),
    Mutant(
        "M10",
        "the clipping coefficient is not applied",
        "acco_ds/core/round_job.py",
        "scale = torch.where(ratio > 1.0, avg_scale / ratio, avg_scale)",
        "scale = torch.where(ratio > 1.0, avg_scale, avg_scale)",
        tuple(TRAJ),
    ),
    Mutant(
        "M11",
        "the global norm is taken before averaging (reported and clipped on the sum)",
        "acco_ds/core/round_job.py",
        "grad_norm = (sumsq.sqrt() * avg_scale64).to(torch.float32)",
        "grad_norm = (sumsq.sqrt() * avg_scale64 * count / gas).to(torch.float32)",
        tuple(TRAJ),
    ),
    Mutant(
        "M12",
        "dpu without the delay (each round waits for its own commit)",
        "acco_ds/core/schedule.py",
        "return RoundEnd(Job.COMMIT, wait_previous=r > 0, wait_now=False, commit_index=r)",
        "return RoundEnd(Job.COMMIT, wait_previous=r > 0, wait_now=True, commit_index=r)",
        tuple(TRAJ),
    ),
    Mutant(
        "M13",
        "the peek's estimate is not all-gathered (stage 2 computes at stale parameters)",
        "acco_ds/core/round_job.py",
        "            in_flight = all_gather_inplace(target, group, traffic, wait=offload is None)\n",
        "            if job is Job.COMMIT:\n"
        "                in_flight = all_gather_inplace(target, group, traffic, wait=offload is None)\n",
        tuple(TRAJ),
    ),
    Mutant(
        "M14",
        # "one step ahead" (applied + 1) is an equivalent mutant since the device-side hyper table:
        # the history never holds a step the engine has not reached, so the lookup falls back to
        # the same entry; one step behind is not equivalent
        "the LR schedule is read one step behind (a commit uses the previous step's LR)",
        "acco_ds/core/round_hypers.py",
        "settings = self._hypers_for(applied)\n",
        "settings = self._hypers_for(max(applied - 1, 0))\n",
        tuple(TRAJ),
    ),
    Mutant(
        "M15",
        "mixed dtypes: micro-batch gradients folded in twice as large",
        "acco_ds/core/buffers.py",
        "accumulate_grads(self.acc_flat, [p.grad], [off], 1.0)",
        "accumulate_grads(self.acc_flat, [p.grad], [off], 2.0)",
        tuple(TRAJ),
    ),
    Mutant(
        "M16",
        "a resumed run loses the g~ kept by the last peek",
        "acco_ds/core/snapshot.py",
        'b.tilde.copy_(g["tilde"])',
        "b.tilde.zero_()",
        ("tests/checkpoint/test_resume.py",),
    ),
    Mutant(
        "M17",
        "the new accumulation buffer is not zeroed at a round end",
        "acco_ds/core/buffers.py",
        "        self.grad_bufs[self.acc].zero_()\n",
        "",
        tuple(TRAJ),
    ),
    Mutant(
        "M18",
        "the gloo reduce-scatter adds a peer's slice twice",
        "acco_ds/core/round_job.py",
        "        chunks[me].add_(received)\n",
        "        chunks[me].add_(received, alpha=2.0)\n",
        tuple(TRAJ),
    ),
    Mutant(
        "M19",
        "the device-side step count also counts skipped commits (late host reads, as on CUDA)",
        "acco_ds/core/round_job.py",
        "applied[0].add_((~(skipped | empty)).double())",
        "applied[0].add_(1.0)",
        ("tests/reliability/test_nonfinite.py",),
    ),
    Mutant(
        "M20",
        "tensor parallelism: replicated parameters counted in the norm on every tensor-parallel rank",
        "acco_ds/core/pipeline.py",
        "b.set_norm_ranges(flags, count_replicated=tp_rank == 0)",
        "b.set_norm_ranges(flags, count_replicated=True)",
        ("tests/deepspeed/test_tensor_parallel.py",),
    ),
    Mutant(
        "M21",
        "evaluation shows the training weights instead of the committed ones",
        "acco_ds/core/committed_view.py",
        "        b.point_params(flat)\n",
        "        b.point_params()\n",
        ("tests/deepspeed/test_evaluation.py",),
    ),
    Mutant(
        "M22",
        "a short sync step is averaged over its own micro-batches (ZeRO-1 divides by W * GAS whatever the count)",
        "acco_ds/core/pipeline.py",
        "b.acc_flat.mul_(self.counter.count / self.gas)",
        "b.acc_flat.mul_(1.0)",
        ("tests/deepspeed/test_engine_boundary.py",),
    ),
    Mutant(
        "M23",
        "a boundary inside acco's estimate round commits its g~ together with the g~ already committed",
        "acco_ds/core/pipeline.py",
        "                    b.tilde.zero_()\n",
        "                    pass\n",
        ("tests/deepspeed/test_engine_boundary.py",),
    ),
    Mutant(
        "M24",
        "ACCO's weight_decay default differs from DeepSpeed AdamW's (0.01 instead of 0)",
        "acco_ds/config.py",
        "    weight_decay: float = 0.0\n",
        "    weight_decay: float = 0.01\n",
        ("tests/deepspeed/test_adamw_defaults.py",),
    ),
    Mutant(
        "M25",
        "compressed rounds: error feedback dropped (the residual is never added nor kept)",
        "acco_ds/core/round_job.py",
        "                residuals[i] if compression.error_feedback else None,\n",
        "                None,\n",
        # the job quantizes only where the round end did not (fuse_round_end false): the unfused twins' test
        (
            "tests/core/test_trajectories.py::test_compressed_steps_match_reference",
            "tests/core/test_trajectories.py::test_fused_round_end_gives_the_job_quantized_bits",
        ),
    ),
    Mutant(
        "M26",
        "compressed rounds: the residual is not carried to the next round (zeroed before it is added)",
        "acco_ds/core/compressed_comm.py",
        "quantize_with_residual(chunks[r], rests[r], block_size, bits=bits, out=(q[r], scales[r]))",
        "quantize_with_residual(chunks[r], rests[r].zero_(), block_size, bits=bits, out=(q[r], scales[r]))",
        ("tests/core/test_trajectories.py::test_compressed_steps_match_reference",),
    ),
    Mutant(
        "M27",
        "quantizer: one scale per tensor instead of one per block",
        "acco_ds/ops/quantize.py",
        "    scale = _scales(blocks, qmax)\n",
        "    scale = _scales(blocks.reshape(1, -1), qmax).expand(blocks.shape[0]).contiguous()\n",
        ("tests/ops/test_quantize.py",),
    ),
    Mutant(
        "M28",
        "checkpoints: the error-feedback residuals are not restored (the resumed run starts them at zero)",
        "acco_ds/core/snapshot.py",
        "                residual.copy_(r)\n",
        "                residual.zero_()\n",
        ("tests/checkpoint/test_resume.py::test_resume_matches_uninterrupted",),
    ),
    Mutant(
        "M29",
        "compressed peeks: the peeks' quantization error leaks into the committed state (an uncompressed commit "
        "does not send what they withheld)",
        "acco_ds/core/round_job.py",
        "            if job is Job.COMMIT and residuals is not None and residuals[i] is not None:\n",
        "            if False:\n",
        ("tests/core/test_trajectories.py::test_compressed_steps_match_reference",),
    ),
    Mutant(
        "M30",
        "fused AdamW + parameter difference: the owner writes its exact new parameters into its own slice, not "
        "base + the dequantized difference it sends (the peers apply the difference: the replicas diverge)",
        "csrc/adamw/adamw_difference_cpu.cpp",
        "    quant::add_deq_impl<O>(q + lo, scales + b, base + lo, out + lo, n, n);\n",
        "    for (int64_t i = 0; i < n; ++i) out[lo + i] = fresh[i];\n",
        ("tests/core/test_trajectories.py::test_compressed_replicas_are_bitwise_identical",),
    ),
    Mutant(
        "M30b",
        "composed AdamW + parameter difference (the GPU's and int4's path): the owner keeps its exact new "
        "parameters in its own slice (the replicas diverge)",
        "acco_ds/ops/adamw_difference.py",
        "        add_dequantized(flat, own_base.view(-1), q, scales, block_size)\n",
        "        pass\n",
        ("tests/core/test_trajectories.py::test_compressed_replicas_are_bitwise_identical",),
    ),
    Mutant(
        "M31",
        "compressed exchange in its collective (NCCL) form: the owner sums the peers' chunks in another order "
        "than the point-to-point form (other bits at W = 3)",
        "acco_ds/core/compressed_comm.py",
        "            got_q[r].copy_(_from_wire(got_wire[r], shard, bits))\n    return QuantizedShard(got_q, got_s, order)\n",
        "            got_q[r].copy_(_from_wire(got_wire[r], shard, bits))\n"
        "    return QuantizedShard(got_q, got_s, [(me + k) % world for k in range(world)])\n",
        ("tests/core/test_trajectories.py::test_collective_exchange_gives_the_point_to_point_bits",),
    ),
    Mutant(
        "M32",
        "Triton quantizer: the scale rounded to the nearest fp32 instead of up (|x| / scale may pass 127)",
        "acco_ds/ops/triton_kernels/quantize.py",
        "    scale = tl.where(scale.to(tl.float64) < wide, up, scale)\n",
        "    scale = tl.where(scale.to(tl.float64) < wide, scale, scale)\n",
        ("tests/ops/test_quantize_triton.py::test_triton_kernels_under_interpreter",),
    ),
    Mutant(
        "M33",
        "the AdamW step on the quantized chunks: an acco commit's gradient without the g~ its peek kept (C++)",
        "csrc/adamw/adamw_quantized_sum_cpu.cpp",
        "    if (tilde != nullptr) quant::add_tilde<G>(gs, tilde + lo, n);\n",
        "",
        (
            "tests/ops/test_quantized_sum_step.py",
            "tests/core/test_trajectories.py::test_compressed_steps_match_reference",
        ),
    ),
    Mutant(
        "M34",
        "the norm of the quantized chunks: the squares taken before the kept g~ is added (C++)",
        "csrc/quantize/quantize_cpu.cpp",
        "    if (tilde != nullptr) add_tilde<S>(s, tilde + first + blo, m);\n",
        "",
        (
            "tests/ops/test_quantized_sum_step.py",
            "tests/core/test_trajectories.py::test_compressed_steps_match_reference",
        ),
    ),
    Mutant(
        "M35",
        "the round job: a compressed peek's step reads its own buffer slice, which the unsummed exchange never "
        "wrote, instead of the g~ its norm pass wrote",
        "acco_ds/core/round_job.py",
        "            source = b.tilde if unsummed else grad\n",
        "            source = grad\n",
        ("tests/core/test_trajectories.py::test_compressed_steps_match_reference",),
    ),
    Mutant(
        "M36",
        "the fused round end: the folds quantize without the error-feedback residual (what earlier rounds withheld "
        "is never sent, and the residual keeps the stale value)",
        "acco_ds/core/fused_round_end.py",
        "        self.residuals = [r if compression.error_feedback else None for r in residuals]\n",
        "        self.residuals = [None for r in residuals]\n",
        ("tests/core/test_fused_round_end.py::test_fused_round_end_gives_the_unfused_bits",),
    ),
    Mutant(
        "M37",
        "the fused round end: the leftover pass skips the blocks of a parameter that got no gradient in the last "
        "micro-batch (their q and scales are never written)",
        "acco_ds/core/fused_round_end.py",
        "            covered = (self.owner >= 0) & folded[self.owner.clamp(min=0)]\n",
        "            covered = self.owner >= 0\n",
        ("tests/core/test_fused_round_end.py::test_fused_round_end_gives_the_unfused_bits",),
    ),
    Mutant(
        "M38",
        "the fused round end: the first fold writes the residual without waiting for the job in flight to release "
        "it (it reads what that job has not written yet)",
        "acco_ds/core/fused_round_end.py",
        "                self.releases[group].wait(\n",
        "                (lambda *args, **kwargs: None)(\n",
        (
            "tests/core/test_fused_round_end.py::test_the_first_fold_waits_for_the_job_that_holds_the_residual",
        ),
    ),
    Mutant(
        "M39",
        "the C++ fold + quantize: the buffer's sum with the last gradient is quantized unrounded (not as the "
        "accumulation would have stored it in a bf16 buffer)",
        "csrc/quantize/fold_quantize_cpu.cpp",
        "  const float sum = to_f32(from_f32<B>(to_f32(buf[i]) + to_f32(grad[i])));\n",
        "  const float sum = to_f32(buf[i]) + to_f32(grad[i]);\n",
        ("tests/ops/test_fold_quantize.py",),
    ),
    Mutant(
        "M40",
        "fp16: an overflow seen on one rank only (a rank whose own gradients are finite ignores the others' "
        "overflow and steps)",
        "acco_ds/core/round_job.py",
        "    dist.all_reduce(sumsq, op=dist.ReduceOp.SUM, group=group)\n",
        "    mine = torch.isfinite(sumsq)\n    dist.all_reduce(sumsq, op=dist.ReduceOp.SUM, group=group)\n"
        "    sumsq = torch.where(mine & ~torch.isfinite(sumsq), torch.zeros_like(sumsq), sumsq)\n",
        ("tests/core/test_fp16_trajectories.py::test_matches_reference",),
    ),
    Mutant(
        "M41",
        "fp16: a round unscaled by another round's scale (the scaler's current scale instead of the one the round "
        "computed under)",
        "acco_ds/core/round_scale.py",
        '        args = {"loss_scale": self.scaler.job_scale(), "residual_scales": self.residual_scales}',
        '        args = {"loss_scale": self.scaler.state[[0, 4]].clone(), "residual_scales": self.residual_scales}',
        ("tests/core/test_fp16_trajectories.py::test_matches_reference",),
    ),
    Mutant(
        "M42",
        "fp16: the loss scale updated per round (peeks too) instead of once per optimizer step",
        "acco_ds/core/round_scale.py",
        "        if self.scaler is None or result.job is not Job.COMMIT or result.loss_scale is None:",
        "        if self.scaler is None or result.loss_scale is None:",
        ("tests/core/test_fp16_trajectories.py::test_matches_reference",),
    ),
    Mutant(
        "M43",
        "fp16: a skipped step still advances the LR schedule (its overflow not reported to the engine)",
        "acco_ds/deepspeed/optimizer.py",
        "        self.overflow = self._take_unreported_skip()",
        "        self.overflow = self._take_unreported_skip() and False",
        ("tests/core/test_fp16_trajectories.py::test_matches_reference",),
    ),
    Mutant(
        "M44",
        "fp16: a skipped step still advances Adam's step count (bias corrections)",
        "acco_ds/core/in_flight.py",
        "                self.stats.skipped_steps += 1\n",
        "                self.stats.skipped_steps += 1\n                self.state_step += 1\n",
        ("tests/core/test_fp16_trajectories.py::test_matches_reference",),
    ),
    Mutant(
        "M46",
        "fp16: the loss scaler's state not restored on resume",
        "acco_ds/core/snapshot.py",
        '        pipeline.scaler.load_state_dict(snap["loss_scale"])',
        "        pass",
        ("tests/checkpoint/test_fp16_checkpoints.py::test_resume_is_bit_exact",),
    ),
    Mutant(
        "M47",
        "fp16: a compressed round's error-feedback residual left in the scale of the round it came from",
        "acco_ds/core/loss_scale.py",
        "    residual.mul_(scale / residual_scale)\n",
        "",
        ("tests/core/test_fp16_trajectories.py::test_compressed_matches_reference",),
    ),
    Mutant(
        "M48",
        "the round's job run by the training thread at its round end (the executor's launch runs it inline instead "
        "of handing it to the worker thread: on CUDA, the training thread enqueues the whole job)",
        "acco_ds/core/comm.py",
        "        self._queue.put((ticket, job))\n",
        "        ticket.result = self._run(ticket, job)\n        ticket.finished.set()\n",
        ("tests/core/test_round_end_host_work.py",),
    ),
    Mutant(
        "M49",
        "fp16: the minimum-scale check reads the scaler's device state on the host at every commit (a host wait for "
        "the compute stream inside a round) instead of the count the job's summary carries",
        "acco_ds/core/in_flight.py",
        "self.scaler.check(None if result.at_min is None else result.at_min.tolist()[0])",
        "self.scaler.check(None)",
        ("tests/core/test_round_end_host_work.py",),
    ),
    Mutant(
        "M50",
        "fp16: the scaler's next state computed on the compute stream at every swap-in (the job's state not adopted)",
        "acco_ds/core/round_scale.py",
        "            if self.scaler.adopt(result.scaler_state, result.next_scaler_state):",
        "            if False:",
        ("tests/core/test_round_end_host_work.py",),
    ),
    Mutant(
        "M51",
        "offload: the host step reads its staging buffers without waiting for the copies of its inputs",
        "acco_ds/core/host_step.py",
        "        self._wait(partial(copies.wait_host, staged.ready), group, INPUTS_PHASE)\n",
        "",
        ("tests/core/test_host_step.py::test_a_step_waits_for_its_inputs_copies",),
    ),
    Mutant(
        "M52",
        "offload: the new parameters not copied back from the host (the all-gather sends the device's old shard)",
        "acco_ds/core/host_step.py",
        "        copies.copy(staged.out, staged.out_host)\n",
        "",
        ("tests/core/test_host_step.py",),
    ),
    Mutant(
        "M53",
        "offload: the groups serialised again (each group's inputs staged only once the previous group's all-gather "
        "was issued: no group's host step overlaps an all-gather)",
        "acco_ds/core/round_job.py",
        "    staged = [offload.stage(i, c[2], c[3]) for i, c in enumerate(calls)] if offload is not None else None\n",
        # group i staged at its turn, after group i-1's all-gather was issued (on CUDA: behind it on the stream)
        "    staged = type('Lazy', (), {'__getitem__': lambda _, i: offload.stage(i, calls[i][2], calls[i][3])})()"
        " if offload is not None else None\n",
        (
            "tests/core/test_host_step_order.py::test_the_next_groups_inputs_are_staged_and_stepped_before_a_groups_all_gather_is_waited",
        ),
    ),
    Mutant(
        "M54",
        "offload on gloo: each group's all-gather waited at once (the next group's host step never runs beside it)",
        "acco_ds/core/round_job.py",
        "            in_flight = all_gather_inplace(target, group, traffic, wait=offload is None)\n",
        "            in_flight = all_gather_inplace(target, group, traffic, wait=True)\n",
        (
            "tests/core/test_host_step_order.py::test_the_next_groups_inputs_are_staged_and_stepped_before_a_groups_all_gather_is_waited",
        ),
    ),
    Mutant(
        "M55",
        "offload: the staging buffers not allocated at set-up (each made by the first job that needs it)",
        "acco_ds/core/round_job.py",
        "        staging=host_staging(groups, compression, world, ranged),\n",
        "        staging=None,\n",
        (
            "tests/core/test_host_step_order.py::test_the_staging_is_allocated_at_set_up_with_exact_sizes_and_no_job_allocates",
        ),
    ),
    Mutant(
        "M56",
        "offload: the host step's waits for its copies without a deadline (a stalled copy blocks the worker thread)",
        "acco_ds/core/host_step.py",
        "        if not wait(self.timeout_s):\n",
        "        if not wait(None):\n",
        (
            "tests/core/test_host_step_order.py::test_a_copy_to_the_host_slower_than_the_timeout_raises_naming_the_rank_group_and_wait",
            "tests/core/test_host_step_order.py::test_a_copy_back_slower_than_the_timeout_raises_naming_that_wait",
        ),
    ),
    Mutant(
        "M57",
        "the optimizer's step answers overflow before reading the commits swapped in: with the summaries read one "
        "job late (CUDA), a skip reaches the engine one step late in sync and dpu",
        "acco_ds/deepspeed/optimizer.py",
        "        self.pipeline.read_swapped_commits()\n",
        "",
        (
            "tests/reliability/test_nonfinite.py::test_late_host_reads_change_nothing_of_the_math",
            "tests/core/test_cuda_paths_on_cpu.py::test_deepspeed_sees_the_same_run",
        ),
    ),
    Mutant(
        "M58",
        "inside no_sync() no round ends (accelerate's accumulate() then runs one acco round per step)",
        "acco_ds/core/round_schedule.py",
        "            if (self.adaptive or not boundary) and self._may_end():\n",
        "            if False:\n",
        ("tests/deepspeed/test_engine_boundary.py::test_held_micro_batches_run_the_bare_loops_rounds",),
    ),
    Mutant(
        "M59",
        "the first fold of a round writes the residual after its deadline without the job's release",
        "acco_ds/core/fused_round_end.py",
        "            if time.monotonic() > deadline:\n                raise RuntimeError(",
        "            if time.monotonic() > deadline:\n                return\n                raise RuntimeError(",
        (
            "tests/core/test_fused_round_end.py::test_a_job_that_never_releases_the_residual_is_an_error_not_a_race",
        ),
    ),
    Mutant(
        "M60",
        "a backward run by torch without the engine (a shared loss over several engines' modules) leaves its "
        "gradients in fresh .grad tensors outside ACCO's buffer",
        "acco_ds/deepspeed/optimizer.py",
        "            self.pipeline.adopt_grads()\n",
        "            pass\n",
        ("tests/deepspeed/test_module_direct.py::test_shared_loss_with_bare_backward",),
    ),
    Mutant(
        "M61",
        "peek_lr_scale ignored: the peeks step with the commit's LR whatever the factor",
        "acco_ds/core/round_hypers.py",
        "            if job is Job.PEEK and self._peek_lr_scale != 1.0:\n",
        "            if False:\n",
        (
            "tests/core/test_trajectories.py::test_peek_lr_scale_matches_reference[W2-acco_fp32_clip_peek_lr_x1.5]",
        ),
    ),
    Mutant(
        "M62",
        "peek_lr_scale applied to every job: the commits step with the scaled LR too",
        "acco_ds/core/round_hypers.py",
        "            if job is Job.PEEK and self._peek_lr_scale != 1.0:\n",
        "            if self._peek_lr_scale != 1.0:\n",
        (
            "tests/core/test_trajectories.py::test_peek_lr_scale_matches_reference[W2-acco_fp32_clip_peek_lr_x1.5]",
        ),
    ),
    Mutant(
        "M45",
        "every parameter group stepped with the first group's AdamW settings (per-group lr, betas and weight "
        "decay ignored: the HF Trainer's no-decay group decayed)",
        "acco_ds/deepspeed/optimizer.py",
        "        return [AdamWSettings.from_param_group(g) for g in self.optimizer.param_groups]\n",
        "        return [AdamWSettings.from_param_group(self.optimizer.param_groups[0]) for g in self.optimizer.param_groups]\n",
        ("tests/deepspeed/test_param_group_settings.py::test_sync_steps_each_group_with_its_settings",),
    ),
    Mutant(
        "M63",
        "a record in node memory marked complete before its data is written (a killed writer leaves it torn)",
        "acco_ds/core/state_records.py",
        "        _SLOT.pack_into(self._mm, self._slot_offsets[slot], seq, key, 0)\n",
        "        _SLOT.pack_into(self._mm, self._slot_offsets[slot], seq + 1, key, 0)\n",
        ("tests/core/test_state_records.py::test_a_writer_killed_mid_write_leaves_its_previous_record",),
    ),
    Mutant(
        "M64",
        "the memory resume one commit behind: a step's counters paired with the commit before its own",
        "acco_ds/core/commit_records.py",
        '            c = commits.get(step.meta["last_commit"])\n',
        '            c = commits.get(step.meta["last_commit"] - 1)\n',
        ("tests/checkpoint/test_memory_state.py",),
    ),
    Mutant(
        "M65",
        "the memory resume drops the commit in flight at the step (its outcome and the scaler's update lost)",
        "acco_ds/deepspeed/checkpoint/memory.py",
        '    acco["in_flight"] = {"result": info["result"]} if in_flight is not None else None\n',
        '    acco["in_flight"] = None\n',
        ("tests/checkpoint/test_memory_state.py",),
    ),
    Mutant(
        "M66",
        "a node's copy one commit behind: each step's copy sends the commit before the one it names",
        "acco_ds/core/peer_copies.py",
        "                    found = self.state.commits.view(key)\n",
        "                    found = self.state.commits.view(key - 1) or self.state.commits.view(key)\n",
        ("tests/checkpoint/test_memory_state.py::test_a_lost_node_is_resumed_from_the_copies",),
    ),
    Mutant(
        "M67",
        "no copies on another node (peer_copy ignored): a lost node's state is gone with it",
        "acco_ds/deepspeed/checkpoint/memory.py",
        "    if ms.peer_copy:\n",
        "    if False:\n",
        ("tests/checkpoint/test_memory_state.py::test_a_lost_node_is_resumed_from_the_copies",),
    ),
    Mutant(
        "M68",
        "the weights and moments read back before the commit in flight is applied (accessors, batched)",
        "acco_ds/deepspeed/accessors.py",
        "    _drain(optimizer)\n    params = list(params)\n",
        "    params = list(params)\n",
        ("tests/core/test_trajectories.py::test_matches_reference",),
    ),
    Mutant(
        "M69",
        "each rank's fragment read back at its parameter's start, not at its offset in the parameter",
        "acco_ds/deepspeed/accessors.py",
        "view[frag.param_start : frag.param_start + frag.numel]",
        "view[0 : frag.numel]",
        ("tests/core/test_trajectories.py::test_matches_reference",),
    ),
    Mutant(
        "M70",
        "a closed pipeline keeps its gloo groups (and their event-loop threads) to the process's end",
        "acco_ds/core/pipeline.py",
        "        if release_groups(groups, busy=self.executor.running()):\n",
        "        if False:\n",
        ("tests/core/test_group_release.py",),
    ),
    Mutant(
        "M71",
        "the groups released but still referenced: their gloo devices and loop threads stay alive",
        "acco_ds/core/pipeline.py",
        "            self.executor.group = self.control_group = self.tp_norm_group = self.tp_control_group = None\n",
        "            pass\n",
        ("tests/core/test_group_release.py",),
    ),
    Mutant(
        "M72",
        "the memory state's copies to a peer keep their gloo group after the pipeline closed",
        "acco_ds/core/peer_copies.py",
        "        if release_groups([self.group], busy=self._thread.is_alive()):\n",
        "        if False:\n",
        ("tests/checkpoint/test_memory_state.py::test_a_lost_node_is_resumed_from_the_copies",),
    ),
    Mutant(
        "M76",
        "a held copy stepped with the first group's step scalars (another group's settings)",
        "acco_ds/core/commit_inputs.py",
        "        row = scalars[i]\n",
        "        row = scalars[0]\n",
        ("tests/core/test_commit_inputs.py",),
    ),
    Mutant(
        "M77",
        "the holder keeps its step of a ward's inputs whatever its digest (a copy with other bits resumed)",
        "acco_ds/core/peer_copies.py",
        "        ok = mine == digest\n",
        "        ok = True\n",
        ("tests/checkpoint/test_memory_state.py",),
    ),
    Mutant(
        "M78",
        "a process's first copy sent as inputs (the holder has no commit before it to step)",
        "acco_ds/core/peer_copies.py",
        "        if inputs is None or as_state or self._sent_commit != key - 1 or not inputs.has(key):\n",
        "        if inputs is None or as_state or not inputs.has(key):\n",
        ("tests/checkpoint/test_memory_state.py",),
    ),
    Mutant(
        "M79",
        "a commit's skip flag not captured with its inputs (a skipped commit stepped on the copy)",
        "acco_ds/core/commit_inputs.py",
        '            owner._copy(row[9:10], tensors["noop_flag"].reshape(-1)[:1].to(torch.float32))\n',
        "            owner._copy(row[9:10], torch.zeros_like(row[9:10]))\n",
        ("tests/core/test_commit_inputs.py", "tests/checkpoint/test_memory_state.py"),
    ),
    Mutant(
        "M80",
        "the state digest blind to an odd last element (a copy wrong in that element kept)",
        "acco_ds/core/commit_inputs.py",
        "        total += int(words[-1])\n",
        "        pass\n",
        ("tests/core/test_commit_inputs.py",),
    ),
    Mutant(
        "M81",
        "the state digest summing the 64-bit words' low halves only (a change in an odd element's bits unseen)",
        "acco_ds/core/commit_inputs.py",
        "    total = int(words[:even].view(np.uint64).sum(dtype=np.uint64)) if even else 0\n",
        "    total = int((words[:even].view(np.uint64) & 0xFFFFFFFF).sum(dtype=np.uint64)) if even else 0\n",
        ("tests/core/test_commit_inputs.py",),
    ),
    Mutant(
        "M82",
        "a commit's captured inputs read before the job's host read ends its stream work (non-blocking copies unlanded)",
        "acco_ds/core/commit_records.py",
        "                self.inputs.synchronized()\n",
        "                pass\n",
        ("tests/checkpoint/test_memory_state.py",),
    ),
    Mutant(
        "M83",
        "a commit's copy's form decided before the commit is recorded (its inputs' capture may still be running)",
        "acco_ds/core/peer_copies.py",
        '        flat, commit_blob = self._own_commit(key) if new_commit else (None, b"")\n'
        "        # the commit is recorded, its job over: only now is its form the holder's too (see _form)\n"
        "        form = self._form(key, self._to_state) if new_commit else NO_COMMIT\n",
        "        form = self._form(key, self._to_state) if new_commit else NO_COMMIT\n"
        '        flat, commit_blob = self._own_commit(key) if new_commit else (None, b"")\n',
        ("tests/checkpoint/test_memory_state.py",),
    ),
    Mutant(
        "M84",
        "a step's copy sent at once, beside the round job in flight when the step was recorded",
        "acco_ds/core/peer_copies.py",
        "                if after is not None and self.executor is not None:\n",
        "                if False:\n",
        ("tests/core/test_peer_copies.py",),
    ),
    Mutant(
        "M85",
        "the CUDA executor's wait for a job over once its thread enqueued it, its side-stream work still running",
        "acco_ds/core/comm.py",
        "        while not self.done(ticket):\n",
        "        while False:\n",
        ("tests/core/test_peer_copies.py",),
    ),
    Mutant(
        "M86",
        "the store host keeps the store up after its report even when every other rank is lost",
        "acco_ds/core/liveness.py",
        "        if _hosts_store(self.rank) and readers:\n",
        "        if _hosts_store(self.rank):\n",
        ("tests/core/test_liveness.py",),
    ),
    Mutant(
        "M87",
        "a loop that records no step with memory_state on is not told so",
        "acco_ds/deepspeed/optimizer.py",
        "        memory_records.after_step(self)\n",
        "",
        ("tests/deepspeed/test_engine_boundary.py",),
    ),
    Mutant(
        "M88",
        "the step records are not counted: a loop that records every step is told it records none",
        "acco_ds/core/commit_records.py",
        "        self.steps_recorded += 1\n",
        "",
        ("tests/deepspeed/test_engine_boundary.py",),
    ),
    Mutant(
        "M73",
        "Triton fused round end: the folded sum not rounded to the buffer's dtype before it is quantized",
        "acco_ds/ops/triton_kernels/fold_quantize.py",
        "        v = round_to(v + _load_f32(grad_ptr, idx - offset, mask, G_DT), B_DT)\n",
        "        v = v + _load_f32(grad_ptr, idx - offset, mask, G_DT)\n",
        ("tests/ops/test_fold_quantize_triton.py::test_triton_kernels_under_interpreter",),
    ),
    Mutant(
        "M74",
        "Triton fused round end, blocks longer than a tile: the residual stored in the buffer's dtype",
        "acco_ds/ops/triton_kernels/fold_quantize.py",
        "_store_as(res_ptr, idx, tl.where(finite, lost, 0.0), mask, RES_DT)",
        "_store_as(res_ptr, idx, tl.where(finite, lost, 0.0), mask, B_DT)",
        ("tests/ops/test_fold_quantize_triton.py::test_triton_kernels_under_interpreter",),
    ),
    Mutant(
        "M75",
        "Triton fused round end, row kernel: chunk c starts at c * (chunk - 1) (wrong with 2 or more chunks)",
        "acco_ds/ops/triton_kernels/fold_quantize.py",
        "    cstart = c * chunk\n    start = cstart + (b - c * nb) * block_size\n    lanes = tl.arange(0, TILE)\n",
        "    cstart = c * (chunk - 1)\n    start = cstart + (b - c * nb) * block_size\n    lanes = tl.arange(0, TILE)\n",
        ("tests/ops/test_fold_quantize_triton.py::test_triton_kernels_under_interpreter",),
    ),
]


def copy_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", ".ruff_cache", ".pytest_cache", "build", "gpu_bundle"
    )
    shutil.copytree(ROOT, dst, ignore=ignore, symlinks=True)


def env_for(scratch: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(scratch)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_tests(scratch: Path, tests, timeout: float) -> tuple:
    """(passed, seconds, tail of the output)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=scratch, env=env_for(scratch), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - t0, "timed out (counted as caught: the mutant broke the run)"
    out = proc.stdout + proc.stderr
    return proc.returncode == 0, time.monotonic() - t0, out[-3000:]


def build_cpu_ext(scratch: Path) -> None:
    env = env_for(scratch)
    env.update(ACCO_DS_BUILD_CUDA="0", ACCO_DS_BUILD_EXT="1")
    proc = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"building the CPU extension in {scratch} failed:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )


def check_imports_scratch(scratch: Path) -> None:
    code = "import acco_ds; print(); print(acco_ds.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=scratch, env=env_for(scratch), capture_output=True, text=True
    )
    where = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    if not where.startswith(str(scratch)):
        raise RuntimeError(f"the scratch copy imports acco_ds from {where!r}, not from {scratch}")


def mutate(scratch: Path, m: Mutant) -> str | None:
    """Apply ``m``; return the original text, or None when its source text is not there exactly once."""
    path = scratch / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        return None
    path.write_text(text.replace(m.old, m.new))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutant ids (default: all)")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per test run")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    ap.add_argument("--out", default=None, help="also write the Markdown table to this file")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.id in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.id}  {m.what}  [{m.path}]  -> {' '.join(m.tests)}")
        return 0
    if not chosen:
        print(f"no mutant matches --only {args.only!r}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="acco_mutants_")) / "tree"
    copy_tree(scratch)
    rows, status = [], 0
    try:
        check_imports_scratch(scratch)
        baseline = sorted({t for m in chosen for t in m.tests})
        ok, secs, tail = run_tests(scratch, baseline, args.timeout)
        print(f"baseline ({' '.join(baseline)}): {'pass' if ok else 'FAIL'} in {secs:.0f} s", flush=True)
        if not ok:
            print(tail, file=sys.stderr)
            return 2
        for m in chosen:
            original = mutate(scratch, m)
            if original is None:
                rows.append((m, "STALE (source text not found exactly once)", 0.0))
                status = 1
                print(f"{m.id}: stale", flush=True)
                continue
            try:
                if m.native:
                    build_cpu_ext(scratch)
                passed, secs, tail = run_tests(scratch, m.tests, args.timeout)
            finally:
                (scratch / m.path).write_text(original)
                if m.native:
                    build_cpu_ext(scratch)
            verdict = "SURVIVED" if passed else "caught"
            if passed:
                status = 1
            rows.append((m, verdict, secs))
            print(f"{m.id}: {verdict} in {secs:.0f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch.parent, ignore_errors=True)
    table = ["| id | planted bug | where | tests run | result | time |", "|---|---|---|---|---|---|"]
    for m, verdict, secs in rows:
        table.append(f"| {m.id} | {m.what} | {m.path} | {', '.join(m.tests)} | {verdict} | {secs:.0f} s |")
    text = "\n".join(table) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
