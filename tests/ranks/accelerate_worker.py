"""An accelerate training loop whose only ACCO-specific line is ``import acco_ds``: the DeepSpeed
config of the accelerate launch (``--deepspeed_config_file``) says ``"type": "ACCO"``. Started by
``accelerate launch --use_deepspeed ...``.

The loop is accelerate's documented one (``accumulate``, ``backward``, ``optimizer.step``,
``scheduler.step``, ``zero_grad`` with DeepSpeed's ``DummyOptim``/``DummyScheduler``), on a tiny
GPT-2 built from a config (tied embeddings, no download) and deterministic token data.
``--save_at k`` saves the state with ``accelerator.save_state`` after optimizer step k (DeepSpeed's
checkpoint files); ``--resume`` loads it with ``accelerator.load_state`` and continues from there.
Rank 0 writes ``result.pt``: losses and grad norms per step, the committed fp32 parameters at the end.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DummyOptim, DummyScheduler  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import acco_ds  # noqa: E402,F401  (the only change a user makes)
from tests.ranks import cpu_accelerate_shim  # noqa: E402

VOCAB, SEQ, SAMPLES, MICRO = 80, 12, 96, 2


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def batch(rank: int, index: int) -> dict:
    """Micro-batch ``index`` of ``rank``: the data order is explicit, so a resumed run sees the
    micro-batches the uninterrupted run saw."""
    g = torch.Generator().manual_seed(10_000 * rank + index)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save_at", type=int, default=3)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu_accelerate_shim.apply()  # CPU-only test machines (see the module); a no-op on GPU
    accelerator = Accelerator()
    gas = accelerator.state.deepspeed_plugin.deepspeed_config["gradient_accumulation_steps"]
    model = tiny_gpt2()
    optimizer = DummyOptim(model.parameters())
    scheduler = DummyScheduler(optimizer)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    rank = accelerator.process_index
    state_dir = os.path.join(args.out, "state")
    start = 0
    if args.resume:
        accelerator.load_state(state_dir)
        start = args.save_at
    losses, norms = {}, {}
    for step in range(start, args.steps):
        total = 0.0
        for j in range(gas):
            with accelerator.accumulate(model):
                loss = model(**batch(rank, step * gas + j)).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # DeepSpeed clips (config); this returns its grad norm
                    norms[step + 1] = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total += loss.item() / gas
        losses[step + 1] = total
        if not args.resume and step + 1 == args.save_at:
            accelerator.save_state(state_dir)
    engine = model  # accelerate returns the DeepSpeedEngine
    committed = {
        n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad
    }
    if accelerator.is_main_process:
        torch.save(
            {
                "losses": losses,
                "norms": norms,
                "committed": committed,
                "optimizer_type": type(engine.optimizer).__name__,
                "stats": engine.optimizer.stats(),
                "lr": scheduler.get_last_lr() if hasattr(scheduler, "get_last_lr") else None,
                "distributed_type": str(accelerator.distributed_type),
                "num_processes": accelerator.num_processes,
            },
            os.path.join(args.out, "resumed.pt" if args.resume else "result.pt"),
        )
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
