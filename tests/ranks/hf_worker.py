"""A Hugging Face Trainer script whose only ACCO-specific line is ``import acco_ds``; the DeepSpeed
config (``--deepspeed``) says ``"type": "ACCO"``. Started by the ``deepspeed`` launcher.

Model: a tiny Llama built from a config (2 layers, tied input/output embeddings), no download;
data: deterministic random token sequences (no tokenizer). Rank 0 writes ``result.pt`` in
``--output_dir``: the trainer's log history, the committed fp32 parameters at the end
(``safe_get_full_fp32_param``) and when training started (after a resume), and ACCO's stats. At the end
the model is exported with ``trainer.save_model`` (``final``) and ``engine.save_16bit_model`` plus its
config (``export16``).
"""

from __future__ import annotations

import argparse
import os

import torch
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from transformers import (  # noqa: E402
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import acco_ds  # noqa: E402,F401  (the only change a user makes)
from tests.ranks import cpu_accelerate_shim, llama  # noqa: E402

VOCAB, SEQ, SAMPLES = 96, 16, 64


def tiny_llama() -> LlamaForCausalLM:
    """The tiny Llama (tests/ranks/llama.py) of this script's vocabulary and length, 2 key/value heads, tied."""
    return llama.tiny_llama(VOCAB, SEQ, kv_heads=2, tied=True)


def trainer_args(args, **kw) -> TrainingArguments:
    """The Trainer settings of the Hugging Face rank scripts (this one and ``epochs_worker``): micro-batch 2,
    ``args.gradient_accumulation_steps``, linear LR 3e-3 with 2 warm-up steps, weight decay 0.01, clipping
    1.0, seed 0, a log every step; ``kw``: the rest (output folder, config, length, saving, evaluation)."""
    return TrainingArguments(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        logging_steps=1,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        weight_decay=0.01,
        max_grad_norm=1.0,
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **kw,
    )


class Tokens(torch.utils.data.Dataset):
    """Sample i: a fixed random sequence; labels = input_ids (the model shifts them)."""

    def __init__(self, samples: int = SAMPLES, seed: int = 1000):
        self.samples, self.seed = samples, seed

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(self.seed + i))
        return {"input_ids": ids, "labels": ids.clone()}


EVAL = Tokens(samples=8, seed=50_000)
EVAL_BATCH = 2


class CommittedEvalLoss(TrainerCallback):
    """After each evaluation: the eval loss of a fresh model loaded with the committed weights
    (``safe_get_full_fp32_param``, a collective: every rank runs the callback), computed over the whole
    eval set in batches of EVAL_BATCH, the mean of the batch losses as the Trainer's eval_loss is."""

    def __init__(self):
        self.trainer = None
        self.losses = []

    def on_evaluate(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        committed = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
        ref = tiny_llama()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(committed[n])
            batches = [
                torch.stack([EVAL[i]["input_ids"] for i in range(k, k + EVAL_BATCH)])
                for k in range(0, len(EVAL), EVAL_BATCH)
            ]
            losses = [float(ref(input_ids=b, labels=b).loss) for b in batches]
        self.losses.append((state.global_step, sum(losses) / len(losses)))


class CommittedAtStart(TrainerCallback):
    """The committed fp32 weights when training starts, i.e. right after ``resume_from_checkpoint`` loaded
    them (collective: every rank runs the callback)."""

    def __init__(self):
        self.trainer = None
        self.weights = None

    def on_train_begin(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        self.weights = {
            n: safe_get_full_fp32_param(p).clone()
            for n, p in engine.module.named_parameters()
            if p.requires_grad
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--deepspeed", required=True)
    ap.add_argument("--max_steps", type=int, default=6)
    ap.add_argument("--save_steps", type=int, default=3)
    ap.add_argument("--resume_from_checkpoint", default=None)
    ap.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps (0: never)")
    ap.add_argument("--gradient_accumulation_steps", type=int, default=2)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu_accelerate_shim.apply()  # CPU-only test machines (see the module); a no-op on GPU
    training_args = trainer_args(
        args,
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        max_steps=args.max_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        per_device_eval_batch_size=EVAL_BATCH,
    )
    model = tiny_llama()
    callback, at_start = CommittedEvalLoss(), CommittedAtStart()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=Tokens(),
        eval_dataset=EVAL if args.eval_steps else None,
        callbacks=[callback, at_start],
    )
    callback.trainer = at_start.trainer = trainer
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    engine = trainer.model_wrapped
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    committed = {
        n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if n in names
    }
    trainer.save_model(os.path.join(args.output_dir, "final"))
    export = os.path.join(args.output_dir, "export16")  # DeepSpeed's own export, with the model's config
    engine.save_16bit_model(export)
    if torch.distributed.get_rank() == 0:
        engine.module.config.save_pretrained(export)
    if torch.distributed.get_rank() == 0:
        torch.save(
            {
                "log_history": trainer.state.log_history,
                "committed": committed,
                "stats": engine.optimizer.stats(),
                "optimizer_type": type(engine.optimizer).__name__,
                "global_step": trainer.state.global_step,
                "committed_eval_losses": callback.losses,
                "committed_at_start": at_start.weights,
                "world_size": torch.distributed.get_world_size(),
            },
            os.path.join(args.output_dir, "result.pt"),
        )


if __name__ == "__main__":
    main()
