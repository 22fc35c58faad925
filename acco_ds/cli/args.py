"""Command-line options of ``acco-train`` (``python -m acco_ds.train``).

Contract: ``parse(argv)`` returns the namespace with every default filled in and checked
(world size, threads per rank and output folder resolved); a bad value exits with a message
naming the option, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import os
import time

from acco_ds.cli.dsconfig import ALL_MODES
from acco_ds.cli.in_launcher import started_by_torchrun
from acco_ds.models.hf import ALL_ARCHS

DEFAULT_MODES = ["acco", "zero1"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="acco-train",
        description=(
            "Train a byte-level decoder (the built-in tiny GPT, or GPT-2 / Llama from transformers configs) on the "
            "Python standard library sources with "
            "ACCO (acco_ds) and/or plain DeepSpeed ZeRO, side by side. Launches its own ranks "
            "(2 CPU ranks with gloo, or every GPU with NCCL) through the DeepSpeed launcher."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = ap.add_argument_group("what to run")
    run.add_argument(
        "--mode",
        nargs="+",
        choices=ALL_MODES,
        default=None,
        help="one run per mode, in this order: acco | dpu | sync (the ACCO optimizer), zero1 (DeepSpeed "
        "ZeRO-1 AdamW), zero1-overlap (ZeRO-1 with overlap_comm, reduce buckets of a quarter of the model), "
        "zero2 (DeepSpeed ZeRO-2 with overlap_comm). Default: acco zero1; under torchrun (one run): acco",
    )
    run.add_argument(
        "--accumulation",
        choices=("fixed", "adaptive"),
        default="fixed",
        help="ACCO accumulation for the acco and dpu runs (sync is always fixed)",
    )
    run.add_argument(
        "--config",
        default=None,
        help="a DeepSpeed JSON config to train with instead of the generated ones (one run; --mode, "
        "--accumulation and the optimizer options are then taken from the file)",
    )
    run.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    run.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch per rank")
    run.add_argument(
        "--grad-accum", type=int, default=4, help="micro-batches per optimizer step per rank (even for acco)"
    )
    run.add_argument(
        "--world-size", type=int, default=None, help="ranks (default: all GPUs, else 2 CPU ranks)"
    )
    run.add_argument(
        "--threads", type=int, default=None, help="torch threads per rank (default: cores / ranks on CPU)"
    )
    run.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size (DeepSpeed AutoTP, with --model gpt2|llama): consecutive ranks form a "
        "tensor-parallel group, ACCO (or ZeRO) runs data parallelism across the groups",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="auto: bf16 on GPU, fp32 on CPU; fp16: fp16 parameters with DeepSpeed's dynamic loss scaling in "
        "every mode (GPUs without bf16; on CPU ranks fp16 is computed without fast kernels, slowly)",
    )
    run.add_argument(
        "--initial-scale-power",
        type=int,
        default=None,
        help="--dtype fp16: the first loss scale is 2 ** this (DeepSpeed's fp16.initial_scale_power; default 16)",
    )
    run.add_argument(
        "--loss-scale-window",
        type=int,
        default=None,
        help="--dtype fp16: steps without overflow before the loss scale doubles (DeepSpeed's "
        "fp16.loss_scale_window; default 1000)",
    )
    opt = ap.add_argument_group("optimizer (AdamW, shared by every mode)")
    opt.add_argument(
        "--lr", type=float, default=2e-3, help="peak learning rate (linear warm-up, cosine decay)"
    )
    opt.add_argument("--min-lr", type=float, default=2e-4)
    opt.add_argument(
        "--peek-lr-scale",
        type=float,
        default=1.0,
        help="acco: optimizer.params.peek_lr_scale, the LR factor of the estimate's step (1.0: the paper's; "
        "docs/REFERENCE.md); the other modes have no peek",
    )
    opt.add_argument("--warmup-steps", type=int, default=15)
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--grad-clip", type=float, default=1.0)
    model = ap.add_argument_group("model")
    model.add_argument(
        "--model",
        choices=ALL_ARCHS,
        default="tiny",
        help="tiny: the built-in GPT decoder; gpt2 | llama: transformers' GPT2LMHeadModel / LlamaForCausalLM "
        "built from a config of the sizes below (byte vocabulary, random initialisation, nothing downloaded)",
    )
    model.add_argument("--n-layer", type=int, default=4)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--d-model", type=int, default=128)
    model.add_argument("--context", type=int, default=128, help="bytes per sequence")
    model.add_argument(
        "--d-ff",
        type=int,
        default=0,
        help="gpt2/llama: MLP width (0: 4 x d-model for gpt2, 8/3 x d-model for llama)",
    )
    model.add_argument(
        "--n-kv-head", type=int, default=0, help="llama: key/value heads (grouped-query attention; 0: n-head)"
    )
    out = ap.add_argument_group("data and output")
    out.add_argument(
        "--corpus", default=None, help="a directory of *.py files (default: the stdlib of this Python)"
    )
    out.add_argument("--eval-windows", type=int, default=256, help="validation sequences of each evaluation")
    out.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="evaluate the validation loss (on the committed parameters) at the start and every N optimizer "
        "steps too, for the summary's time to the baseline's final loss; their time is left out of the training "
        "clock (default: steps / 10, at least 1; 0: at the end only)",
    )
    out.add_argument("--out", default=None, help="output folder (default: ./acco_out/<timestamp>)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    ckpt = ap.add_argument_group("checkpoints (a restarted job resumes by itself; see docs/MULTINODE.md)")
    ckpt.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="save a checkpoint every N optimizer steps and at the end (0: no saves)",
    )
    ckpt.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where the saves go (default with --save-every: OUT/runs/<mode>/checkpoints); a run whose "
        "folder holds a complete save resumes from it, at whatever world size it has",
    )
    ckpt.add_argument("--keep-checkpoints", type=int, default=2, help="the newest saves kept")
    ckpt.add_argument(
        "--memory-state",
        action="store_true",
        help="ACCO runs: optimizer.params.memory_state.enabled=true: every step's committed state kept in node "
        "memory and copied to a rank on another node; a run restarted by torchrun resumes from it, no disk save "
        "needed (docs/RELIABILITY.md)",
    )
    ckpt.add_argument(
        "--memory-state-form",
        choices=("inputs", "state"),
        default=None,
        help="with --memory-state: optimizer.params.memory_state.peer_copy_form, what a copy to the other node sends "
        "after a commit (default: the config's, inputs)",
    )
    het = ap.add_argument_group("heterogeneous workers (demo)")
    het.add_argument("--slow-rank", type=int, default=-1, help="this rank gets extra compute per micro-batch")
    het.add_argument(
        "--slow-factor", type=float, default=1.0, help="... so that it is this many times slower"
    )
    return ap


def _cuda() -> bool:
    from acco_ds.cli.launch import _cuda_available  # DS_ACCELERATOR=cpu: a CPU run on a GPU machine too

    return _cuda_available()


def _check_model(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The HF sizes must make a valid config (checked here, before any rank starts)."""
    if a.model == "tiny":
        if a.d_ff or a.n_kv_head:
            ap.error("--d-ff and --n-kv-head apply to --model gpt2|llama, not to the built-in tiny model")
        return
    from acco_ds.models.hf import HFModelConfig

    try:
        HFModelConfig(
            arch=a.model,
            n_layer=a.n_layer,
            n_head=a.n_head,
            d_model=a.d_model,
            context=a.context,
            d_ff=a.d_ff,
            n_kv_head=a.n_kv_head,
        )
    except ValueError as err:
        ap.error(f"--model {a.model}: {err}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        ap.error(f"--model {a.model} needs the transformers package: pip install 'acco_ds[hf]'")


def _check_tp(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--tp must split the ranks and the model (checked before any rank starts)."""
    if a.tp < 1:
        ap.error(f"--tp must be >= 1, got {a.tp}")
    if a.tp == 1:
        return
    if a.model == "tiny":
        ap.error(f"--tp {a.tp}: tensor parallelism (DeepSpeed AutoTP) needs --model gpt2 or llama")
    if a.world_size % a.tp:
        ap.error(f"--tp {a.tp} does not divide --world-size {a.world_size}")
    heads = {"--n-head": a.n_head, "--n-kv-head": a.n_kv_head or a.n_head}
    for flag, n in heads.items():
        if n % a.tp:
            ap.error(f"--tp {a.tp} must divide {flag} ({n}): AutoTP splits the attention heads")


FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000}
"""DeepSpeed's own defaults of the loss-scale options acco-train exposes."""


def _check_fp16(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The loss-scale options need ``--dtype fp16``; their ranges are DeepSpeed's (a power in [0, 64) keeps
    the scale finite in fp32, a window >= 1). Fills in DeepSpeed's defaults with fp16."""
    given = [name for name in FP16_DEFAULTS if getattr(a, name) is not None]
    if a.dtype != "fp16":
        if given:
            flag = "--" + given[0].replace("_", "-")
            ap.error(f"{flag} applies to --dtype fp16 (loss scaling), not to --dtype {a.dtype}")
        return
    if a.config:
        ap.error(
            "--dtype fp16 with --config: the file's own fp16 section decides the precision; "
            'drop --dtype, or add "fp16": {"enabled": true} to the file'
        )
    for name, default in FP16_DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, default)
    if not 0 <= a.initial_scale_power < 64:
        ap.error(
            f"--initial-scale-power must be in [0, 63] (the first scale is 2 ** it), got {a.initial_scale_power}"
        )
    if a.loss_scale_window < 1:
        ap.error(f"--loss-scale-window must be >= 1, got {a.loss_scale_window}")


def _in_launcher_defaults(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Under torchrun every process is one rank of one run: the world size is the launcher's, and every
    rank (and every restart) must write into the same folder."""
    world = int(os.environ["WORLD_SIZE"])
    if a.world_size not in (None, world):
        ap.error(f"--world-size {a.world_size}: under torchrun the world size is the launcher's ({world})")
    a.world_size = world
    if not a.out:
        ap.error("--out is required under torchrun: every rank and every restart writes into that folder")
    a.mode = a.mode or ["acco"]
    if len(a.mode) != 1 and not a.config:
        ap.error(f"under torchrun acco-train trains one run: pass one --mode, got {' '.join(a.mode)}")
    if a.threads is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        a.threads = 1 if _cuda() else max(1, (os.cpu_count() or 1) // local)


def parse(argv=None) -> argparse.Namespace:
    from acco_ds.cli.launch import default_world_size

    ap = build_parser()
    a = ap.parse_args(argv)
    for name in (
        "steps",
        "micro_batch",
        "grad_accum",
        "n_layer",
        "n_head",
        "d_model",
        "context",
        "eval_windows",
    ):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    a.in_launcher = started_by_torchrun()
    if a.in_launcher:
        _in_launcher_defaults(ap, a)
    a.mode = a.mode or DEFAULT_MODES
    a.world_size = a.world_size or default_world_size()
    if a.save_every < 0:
        ap.error(f"--save-every must be >= 0 (0: no saves), got {a.save_every}")
    if a.keep_checkpoints < 1:
        ap.error(f"--keep-checkpoints must be >= 1, got {a.keep_checkpoints}")
    if a.checkpoint_dir and len(a.mode) > 1 and not a.config:
        ap.error(
            f"--checkpoint-dir holds the saves of one run, but --mode lists {len(a.mode)}: {' '.join(a.mode)}"
        )
    if a.world_size < 1:
        ap.error(f"--world-size must be >= 1, got {a.world_size}")
    if a.peek_lr_scale != 1.0:
        from acco_ds.config import MAX_PEEK_LR_SCALE

        if not 0.0 < a.peek_lr_scale <= MAX_PEEK_LR_SCALE:
            ap.error(f"--peek-lr-scale must be in (0, {MAX_PEEK_LR_SCALE:g}], got {a.peek_lr_scale}")
        if "acco" not in a.mode or a.config:
            ap.error(
                "--peek-lr-scale applies to the acco run (--mode acco, no --config: a config file sets "
                "optimizer.params.peek_lr_scale itself)"
            )
    if a.threads is None:
        a.threads = 1 if _cuda() else max(1, (os.cpu_count() or 1) // a.world_size)
    if a.threads < 1:
        ap.error(f"--threads must be >= 1, got {a.threads}")
    if "acco" in a.mode and a.grad_accum % 2 and not a.config:
        ap.error(f"--mode acco needs an even --grad-accum (two rounds of GAS/2 per step), got {a.grad_accum}")
    if a.slow_rank >= a.world_size:
        ap.error(f"--slow-rank {a.slow_rank} is not a rank of --world-size {a.world_size}")
    if a.slow_factor < 1.0:
        ap.error(f"--slow-factor must be >= 1 (1: no slowdown), got {a.slow_factor}")
    if a.dtype == "auto":
        a.dtype = "bf16" if _cuda() else "fp32"
    _check_fp16(ap, a)
    _check_model(ap, a)
    _check_tp(ap, a)
    if a.memory_state_form is not None and not a.memory_state:
        ap.error(f"--memory-state-form {a.memory_state_form} applies with --memory-state only")
    if len(set(a.mode)) != len(a.mode):
        ap.error(f"--mode lists a mode twice: {' '.join(a.mode)}")
    if a.eval_every is None:
        a.eval_every = max(1, a.steps // 10)
    if a.eval_every < 0:
        ap.error(f"--eval-every must be >= 0 (0: the validation loss at the end only), got {a.eval_every}")
    a.out = a.out or os.path.join("acco_out", time.strftime("%Y%m%d-%H%M%S"))
    return a
