"""``acco-plan``: will ACCO pay off on my cluster? Predicted step time, samples/s and memory per GPU
of DeepSpeed ZeRO-1 (with and without overlap_comm), ZeRO-2, acco_ds sync, DPU, fixed and adaptive
ACCO, and a recommendation, from the model size, the cluster's links and a micro-batch's compute
time; with ``--offload`` also the contenders that keep the optimizer in host memory, and whether to.
``acco-plan --help`` lists the options; docs/PLAN.md gives the equations.

Contract: ``main(argv) -> int`` prints the table (``--json``: the JSON instead; ``--json FILE``: the
table, and the JSON written to FILE) and returns 0; a bad option exits with status 2 and a message
naming the option, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from acco_ds.plan import units
from acco_ds.plan.model import COMPRESSED_CONTENDERS, CONTENDERS, DEEPSPEED_BUCKET, MIXED_HALVES, PlanInputs
from acco_ds.plan.offload import CONTENDERS as OFFLOAD_CONTENDERS
from acco_ds.plan.offload import HOST_ADAM_BW, HOST_ADAM_BW_DEEPSPEED, PCIE_BW
from acco_ds.plan.planner import predict, recommend
from acco_ds.plan.primitives import DTYPE_SIZE
from acco_ds.plan.quality import MAX_PEEK_LR_SCALE

EXAMPLE = """examples:
  acco-plan --params 125M --nodes 4 --gpus-per-node 8 --intra-bw 200GB/s --inter-bw 100Gbit/s \\
            --t-micro-batch 60ms --micro-batch 8 --gas 4
  acco-plan --model-config ./my-model/config.json --nodes 2 --gpus-per-node 4 --intra-bw 150GB/s \\
            --inter-bw 25Gbit/s --tflops 150 --seq-len 2048 --micro-batch 4 --gas 8 --json plan.json
  acco-plan --params 7B --gpus-per-node 1 --t-micro-batch 2s --gas 4 --gpu-memory 80GiB --offload
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="acco-plan",
        description="Predict whether ACCO (acco_ds) beats DeepSpeed ZeRO-1 on a cluster: step time, "
        "samples/s and memory per GPU of each contender, and the mode / accumulation / GAS to use. "
        "The model and its equations: docs/PLAN.md.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = ap.add_argument_group("model")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", help="trainable parameters, e.g. 125M, 2.7B, 7e9")
    src.add_argument(
        "--model-config",
        help="a transformers config.json, a local model folder, or a model name in the local HF cache "
        "(parameters counted exactly on the meta device; nothing downloaded)",
    )
    m.add_argument(
        "--param-dtype",
        default="bf16",
        help=f"one of {', '.join(DTYPE_SIZE)} (default bf16; fp16: with loss scaling, the bytes of bf16)",
    )
    m.add_argument(
        "--comm-dtype", default=None, help="gradient/parameter communication dtype (default: --param-dtype)"
    )
    c = ap.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    c.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel size, a divisor of --gpus-per-node (default 1)"
    )
    c.add_argument(
        "--intra-bw",
        help="intra-node bus bandwidth per GPU, as nccl-tests' busbw reports it, e.g. 450GB/s (NVLink 4), "
        "20GB/s (PCIe); needed when a node holds more than one data-parallel rank",
    )
    c.add_argument("--intra-latency", default="5us", help="intra-node latency per ring step (default 5us)")
    c.add_argument(
        "--inter-bw",
        help="inter-node bandwidth per node (all its NICs together), e.g. 400Gbit/s, 3200Gbit/s; "
        "needed with --nodes > 1",
    )
    c.add_argument("--inter-latency", default="10us", help="inter-node latency per ring step (default 10us)")
    c.add_argument(
        "--hbm-bw", default="2TB/s", help="memory bandwidth the optimizer step streams at (default 2TB/s)"
    )
    c.add_argument(
        "--accelerator",
        choices=("gpu", "cpu"),
        default="gpu",
        help="cpu: DeepSpeed's CPU accelerator, whose streams are no-ops (overlap_comm overlaps nothing), "
        "and memory counts what the CPU heap keeps",
    )
    c.add_argument(
        "--gpu-memory", help="memory per GPU, e.g. 80GiB: contenders whose model states exceed it are flagged"
    )
    w = ap.add_argument_group("work per step")
    w.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per GPU (default 1)")
    w.add_argument("--gas", type=int, default=2, help="micro-batches per optimizer step per GPU (default 2)")
    w.add_argument(
        "--t-micro-batch", help="measured compute time of one micro-batch (forward+backward), e.g. 85ms"
    )
    w.add_argument("--tflops", type=float, help="achieved TFLOP/s per GPU (instead of --t-micro-batch)")
    w.add_argument("--tokens-per-micro-batch", help="tokens of one micro-batch per GPU (with --tflops)")
    w.add_argument(
        "--seq-len", type=int, help="tokens per sequence: tokens per micro-batch = micro-batch x this"
    )
    w.add_argument(
        "--train-steps",
        type=int,
        help="optimizer steps of the run (with the tokens per step: picks the quality study's regime closest to it "
        "for the time to ZeRO-1's loss; docs/PLAN.md)",
    )
    w.add_argument(
        "--peek-lr-scale",
        type=float,
        default=1.0,
        help="your ACCO config's optimizer.params.peek_lr_scale (default 1.0, the paper's estimate): the time to "
        "ZeRO-1's loss then uses the quality study's variant with that scale where it ran one (docs/PLAN.md)",
    )
    w.add_argument(
        "--reduce-bucket-size",
        default=str(DEEPSPEED_BUCKET),
        help=f"DeepSpeed's reduce_bucket_size in elements (default {DEEPSPEED_BUCKET:.0e}, DeepSpeed's)",
    )
    w.add_argument(
        "--block-size",
        type=int,
        default=256,
        help="compressed rounds (the *-int8 rows): elements per int8 block, one fp32 scale each (default 256, "
        "acco_ds's compression.block_size)",
    )
    o = ap.add_argument_group("optimizer offload (zero_optimization.offload_optimizer device cpu)")
    o.add_argument(
        "--offload",
        action="store_true",
        help="also predict ZeRO-Offload, acco_ds sync and fixed / adaptive ACCO with the fp32 master and Adam's "
        "moments in host memory, and say whether to offload (GPU ranks only)",
    )
    o.add_argument(
        "--pcie-bw",
        help=f"with --offload: one GPU's host copies, each direction, pinned memory (default {PCIE_BW / 1e9:g}GB/s, "
        "PCIe 4.0 x16; PCIe 5.0 x16 about 50GB/s)",
    )
    o.add_argument(
        "--host-adam-bw",
        help=f"with --offload: bytes/s acco_ds's host AdamW streams for one GPU (default {HOST_ADAM_BW / 1e9:g}GB/s: "
        "its commit measured on 2 cores, benchmarks/results/kernels/host_2threads; measure yours with python -m "
        "benchmarks.kernels --threads <cores per GPU>, the 'acco commit' row's GB/s)",
    )
    o.add_argument(
        "--host-adam-bw-deepspeed",
        help=f"with --offload: bytes/s DeepSpeedCPUAdam streams for one GPU (default "
        f"{HOST_ADAM_BW_DEEPSPEED / 1e9:g}GB/s, measured in the same run; the 'DeepSpeedCPUAdam' row's GB/s)",
    )
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the plan as JSON to FILE (the table still prints), or alone: print JSON instead of the "
        "table. Scripts should give a FILE: importing DeepSpeed (which acco_ds does) may log a line on stdout",
    )
    return ap


def _opt(ap, name: str, fn, text, **kw):
    try:
        return fn(text, **kw)
    except ValueError as err:
        ap.error(f"{name}: {err}")


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)


def resolve(argv=None) -> tuple:
    """Parse and check the options: ``(PlanInputs, json target or None)``; a bad one exits with status 2."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.train_steps is not None and a.train_steps < 1:
        ap.error(f"--train-steps must be an integer >= 1, got {a.train_steps}")
    if not 0 < a.peek_lr_scale <= MAX_PEEK_LR_SCALE:
        ap.error(
            f"--peek-lr-scale must be in (0, {MAX_PEEK_LR_SCALE:g}] (acco_ds's range), got {a.peek_lr_scale}"
        )
    for name in ("nodes", "gpus_per_node", "tp", "micro_batch", "gas"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(a, name)}")
    if a.gpus_per_node % a.tp:
        ap.error(
            f"--tp {a.tp} does not divide --gpus-per-node {a.gpus_per_node}: tensor parallelism stays "
            f"inside a node; allowed: {_divisors(a.gpus_per_node)}"
        )
    comm_dtype = a.comm_dtype or a.param_dtype
    for name, v in (("--param-dtype", a.param_dtype), ("--comm-dtype", comm_dtype)):
        if v not in DTYPE_SIZE:
            ap.error(f"{name}: unknown dtype {v!r}; allowed: {', '.join(DTYPE_SIZE)}")
    if {a.param_dtype, comm_dtype} == MIXED_HALVES:
        ap.error(
            f"--comm-dtype {comm_dtype} with --param-dtype {a.param_dtype}: fp16 and bf16 do not mix (a scaled fp16 "
            f"gradient loses in bf16 the precision its loss scale bought); allowed: --comm-dtype {a.param_dtype} or fp32"
        )
    largest_frac, context = 0.0, None
    if a.params is not None:
        params = _opt(ap, "--params", units.parse_count, a.params)
    else:
        from acco_ds.plan.hfconfig import count_params

        try:
            size = count_params(a.model_config)
        except (ValueError, OSError) as err:
            ap.error(f"--model-config: {err}")
        params, largest_frac, context = float(size.params), size.largest / size.params, size.context
    ranks_per_node = a.gpus_per_node // a.tp
    intra_bw = inter_bw = 0.0
    if ranks_per_node > 1:
        if not a.intra_bw:
            ap.error(
                f"--intra-bw is needed: a node holds {ranks_per_node} data-parallel ranks (e.g. 450GB/s)"
            )
        intra_bw = _opt(ap, "--intra-bw", units.parse_bandwidth, a.intra_bw)
    if a.nodes > 1:
        if not a.inter_bw:
            ap.error(f"--inter-bw is needed with --nodes {a.nodes} (e.g. 400Gbit/s per node)")
        inter_bw = _opt(ap, "--inter-bw", units.parse_bandwidth, a.inter_bw)
    tokens = None
    if a.seq_len is not None and a.seq_len < 1:
        ap.error(f"--seq-len must be >= 1, got {a.seq_len}")
    if a.tokens_per_micro_batch is not None and a.seq_len is not None:
        ap.error("--tokens-per-micro-batch and --seq-len: give one of them")
    if a.tokens_per_micro_batch is not None:
        tokens = _opt(ap, "--tokens-per-micro-batch", units.parse_count, a.tokens_per_micro_batch)
    elif a.seq_len is not None:
        tokens = float(a.micro_batch * a.seq_len)
    if (a.t_micro_batch is None) == (a.tflops is None):
        ap.error(
            "give the compute of one micro-batch: --t-micro-batch (measured) or --tflops with its tokens"
        )
    if a.t_micro_batch is not None:
        t_mb = _opt(ap, "--t-micro-batch", units.parse_time, a.t_micro_batch, positive=True)
    else:
        if not a.tflops > 0:
            ap.error(f"--tflops must be > 0, got {a.tflops}")
        if tokens is None and context:
            tokens = float(a.micro_batch * context)
        if tokens is None:
            ap.error("--tflops needs the tokens of a micro-batch: --tokens-per-micro-batch or --seq-len")
        # 6 N T model flops per micro-batch; a tensor-parallel group shares them
        t_mb = 6 * params * tokens / a.tp / (a.tflops * 1e12)
    bucket = _opt(ap, "--reduce-bucket-size", units.parse_count, a.reduce_bucket_size)
    if a.block_size < 1:
        ap.error(f"--block-size must be an integer >= 1, got {a.block_size}")
    gpu_mem = _opt(ap, "--gpu-memory", units.parse_memory, a.gpu_memory) if a.gpu_memory else None
    bws = {
        "--pcie-bw": PCIE_BW,
        "--host-adam-bw": HOST_ADAM_BW,
        "--host-adam-bw-deepspeed": HOST_ADAM_BW_DEEPSPEED,
    }
    for name in list(bws):
        text = getattr(a, name[2:].replace("-", "_"))
        if text is None:
            continue
        if not a.offload:
            ap.error(f"{name} {text}: only with --offload (it sets a figure of the offload model)")
        bws[name] = _opt(ap, name, units.parse_bandwidth, text)
    if a.offload and a.accelerator != "gpu":
        ap.error(
            f"--offload with --accelerator {a.accelerator}: a CPU rank's optimizer state is in host memory already "
            "(nothing to copy); allowed: --offload with --accelerator gpu"
        )
    return PlanInputs(
        params=params,
        t_micro_batch=t_mb,
        micro_batch=a.micro_batch,
        gas=a.gas,
        nodes=a.nodes,
        gpus_per_node=a.gpus_per_node,
        tp=a.tp,
        param_dtype=a.param_dtype,
        comm_dtype=comm_dtype,
        intra_bw=intra_bw,
        intra_latency=_opt(ap, "--intra-latency", units.parse_time, a.intra_latency),
        inter_bw=inter_bw,
        inter_latency=_opt(ap, "--inter-latency", units.parse_time, a.inter_latency),
        hbm_bw=_opt(ap, "--hbm-bw", units.parse_bandwidth, a.hbm_bw),
        accelerator=a.accelerator,
        reduce_bucket=bucket,
        largest_frac=largest_frac,
        tokens_per_micro_batch=tokens,
        gpu_memory=gpu_mem,
        block_size=a.block_size,
        offload=a.offload,
        pcie_bw=bws["--pcie-bw"],
        host_adam_bw=bws["--host-adam-bw"],
        host_adam_bw_deepspeed=bws["--host-adam-bw-deepspeed"],
        train_steps=a.train_steps,
        peek_lr_scale=a.peek_lr_scale,
    ), a.json


def _fmt(x, spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _note(r) -> str:
    if r.host_memory_bytes is None:
        return r.note
    return f"{r.note}; host memory {r.host_memory_bytes / 2**30:.2f} GiB"


def render(plan, rec: dict) -> str:
    i, d = plan.inputs, plan.derived
    ms = 1e3
    lines = [
        f"acco-plan: {i['params'] / 1e6:,.1f}M parameters ({d['params_per_gpu'] / 1e6:,.1f}M per GPU, tp "
        f"{i['tp']}), {i['param_dtype']} parameters, {i['comm_dtype']} communication",
        f"cluster: {i['nodes']} node(s) x {i['gpus_per_node']} GPUs = data-parallel world {d['dp_world']} "
        f"({d['ranks_per_node']} per node); accelerator {i['accelerator']}",
        f"step: micro-batch {i['micro_batch']} x GAS {i['gas']}, one micro-batch {ms * i['t_micro_batch']:.2f} ms "
        f"-> compute {ms * d['compute_step_s']:.1f} ms per step",
        f"collectives of {d['comm_bytes'] / 1e6:,.1f} MB: reduce-scatter {ms * d['reduce_scatter_s']:.2f} ms "
        f"(intra {ms * d['rs_phases']['intra_s']:.2f} + inter {ms * d['rs_phases']['inter_s']:.2f}), "
        f"all-gather {ms * d['all_gather_s']:.2f} ms, all-reduce {ms * d['all_reduce_s']:.2f} ms; "
        f"AdamW commit {ms * d['opt_commit_s']:.2f} ms",
        f"comm/compute: one round's communication {ms * d['comm_round_s']:.1f} ms / a step's compute "
        f"{ms * d['compute_step_s']:.1f} ms = {d['comm_compute_ratio']:.3f} (fixed ACCO hides it up to 0.5)",
        f"int8 rounds (*-int8 rows; blocks of {i['block_size']}): {d['int8_bytes'] / 1e6:,.1f} MB per collective, "
        f"a round {ms * d['comm_round_int8_s']:.1f} ms (its job's quantize passes {ms * d['quantize_fused_s']:.2f} ms; "
        f"the gradients quantized in the round's last backward, {ms * d['fold_s']:.2f} ms more compute; adaptive "
        f"rounds quantize in their job: {ms * d['quantize_s']:.2f} ms)",
    ]
    lines.append(
        f"memory_state (optimizer.params.memory_state): {d['memory_state_bytes_per_step'] / 1e6:,.1f} MB per rank and "
        f"step to its copy's holder on another node ({ms * d['memory_state_inter_s']:.1f} ms of the node's link for "
        f"all its ranks, beside the rounds; peer_copy_form 'state': {d['memory_state_state_bytes_per_step'] / 1e6:,.1f} "
        f"MB, {ms * d['memory_state_state_inter_s']:.1f} ms), {d['memory_state_host_bytes'] / 2**30:.2f} GiB of host "
        "memory per rank"
    )
    if i.get("offload"):
        lines += [
            f"offload (*-offload rows): PCIe {i['pcie_bw'] / 1e9:g} GB/s, host AdamW {i['host_adam_bw'] / 1e9:g} GB/s "
            f"(acco_ds) / {i['host_adam_bw_deepspeed'] / 1e9:g} GB/s (DeepSpeedCPUAdam); a round's job: gradient shard "
            f"to the host {ms * d['offload_to_host_s']:.1f} ms + host AdamW commit {ms * d['offload_host_commit_s']:.1f}"
            f" / peek {ms * d['offload_host_peek_s']:.1f} ms + parameters back {ms * d['offload_to_device_s']:.1f} ms, "
            f"with the collectives {ms * d['offload_job_commit_s']:.1f} / {ms * d['offload_job_peek_s']:.1f} ms "
            f"(job/compute {d['offload_job_compute_ratio']:.3f}; fixed ACCO hides it up to 0.5); ZeRO-Offload waits "
            f"{ms * d['offload_deepspeed_serial_s']:.1f} ms per step (fp32 gradients to the host "
            f"{ms * d['offload_deepspeed_to_host_s']:.1f} ms, DeepSpeedCPUAdam {ms * d['offload_deepspeed_host_s']:.1f}"
            " ms, with the collectives and the copy back)",
        ]
    lines += [
        "",
        "| contender | step ms | samples/s | x ZeRO-1 | micro-batches/step/GPU | exposed comm ms | memory/GPU GiB "
        "| bytes/param | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in plan.rows:
        mem = f"{r.memory_bytes / 2**30:.2f}" + ("" if r.fits is not False else " (does not fit)")
        lines.append(
            f"| {r.contender} | {_fmt(None if r.step_s is None else ms * r.step_s, '.1f')} "
            f"| {_fmt(r.samples_per_s, ',.1f')} "
            f"| {_fmt(r.x_zero1, '.2f')} | {_fmt(r.micro_batches_per_step, 'g')} "
            f"| {_fmt(None if r.exposed_comm_s is None else ms * r.exposed_comm_s, '.1f')} | {mem} "
            f"| {r.memory_bytes_per_param:.2f} | {_note(r)} |"
        )
    tok = i.get("tokens_per_micro_batch")
    if tok:
        lines.append(f"(tokens/s = samples/s x {tok / i['micro_batch']:g} tokens per sequence)")
    lines += [
        "memory: model states and communication buffers at the peak (docs/PLAN.md); activations not included.",
        "",
        f"recommendation: {rec['mode']}"
        + (f", {rec['accumulation']} accumulation" if rec["accumulation"] else "")
        + f", GAS {rec['gas']}"
        + (", optimizer offloaded to the host" if rec.get("offload") else ""),
        f"why: {rec['reason']}",
    ]
    if rec.get("offload"):
        lines.append(f'add to zero_optimization: "offload_optimizer": {json.dumps(rec["offload"])}')
    if rec.get("compression"):
        lines.append(f'add to optimizer.params: "compression": {json.dumps(rec["compression"])}')
    if rec.get("alternative"):
        lines.append(f"alternative: {rec['alternative']}")
    lines += time_to_loss_lines(rec.get("time_to_loss"))
    return "\n".join(lines)


def time_to_loss_lines(t: dict | None) -> list:
    """What the recommendation's ``time_to_loss`` (``planner.time_to_loss``) says: ACCO's speed-up in time to
    ZeRO-1's final loss, or that it is not known, and the quality study's regime it rests on."""
    if not t:
        return []
    who = f"{t['contender']} against {t['against']}"
    if t["samples_speedup"] is None:
        head = f"time to the same loss ({who}): n/a ({t['contender']} does not run at this GAS)"
    elif t["time_speedup"] is not None:
        across = " (across run lengths)" if t.get("factor_basis") == "across_lengths" else ""
        head = (
            f"time to the same loss ({who}): {t['samples_speedup']:.2f}x the samples/s / {t['factor']:.2f}x the "
            f"steps{across} = {t['time_speedup']:.2f}x, ACCO reaches ZeRO-1's final loss "
            + ("sooner" if t["time_speedup"] > 1 else "no sooner")
        )
    elif t.get("time_speedup_at_least") is not None:
        head = (
            f"time to the same loss ({who}): at least {t['time_speedup_at_least']:.2f}x: {t['samples_speedup']:.2f}x "
            f"the samples/s / at most {t['factor']:.2f}x the steps (a bound across run lengths: the study's shortest "
            "run already reached ZeRO-1's loss)"
        )
    else:
        across = t.get("factor_basis") == "across_lengths"
        bound = (t.get("regime") or {}).get("bound")
        lengths = {"lower": " nor across run lengths", "both": " (across run lengths: bounds both ways)"}
        lengths = lengths.get(bound, "") if across else ""
        head = (
            f"time to the same loss ({who}): not known: {t['samples_speedup']:.2f}x the samples/s, but in the study's "
            f"regime below ACCO never reached ZeRO-1's final validation loss within its steps{lengths}"
        )
    return [head, f"regime: {t['regime_text']}"]


def main(argv=None) -> int:
    inputs, json_to = resolve(argv)
    plan = predict(inputs)
    rec = recommend(plan, inputs)
    names = list(CONTENDERS + COMPRESSED_CONTENDERS + (OFFLOAD_CONTENDERS if inputs.offload else ()))
    doc = json.dumps(plan.to_dict() | {"recommendation": rec, "contenders": names}, indent=1)
    if json_to == "-":
        print(doc)
        return 0
    if json_to:
        Path(json_to).write_text(doc + "\n")
    print(render(plan, rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
