"""Training over several epochs whose data loader's length is not a multiple of the gradient accumulation:
the Hugging Face Trainer, and accelerate's own loop (``accelerator.accumulate``), mark each epoch's shorter
last accumulation as a boundary with ``engine.set_gradient_accumulation_boundary`` and step there. Started by
the ``deepspeed`` launcher; runs every DeepSpeed config of ``--configs`` (JSON ``{"trainer": {name: config},
"accelerate": {name: config}}``) one after the other in this process, the only ACCO-specific line being
``import acco_ds``.

Model and data: the tiny Llama and token sequences of ``hf_worker``. Rank 0 writes ``result.pt``: per run
(``trainer_<name>``, ``accelerate_<name>``), the optimizer steps taken (the Trainer's global step and log
history; the engine's ``global_steps`` under accelerate), the committed fp32 parameters at the end
(``safe_get_full_fp32_param``) and, for ACCO, its stats.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, DummyOptim  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from transformers import Trainer  # noqa: E402

import acco_ds  # noqa: E402,F401  (the only change a user makes)
from tests.ranks import cpu_accelerate_shim  # noqa: E402
from tests.ranks.hf_worker import Tokens, tiny_llama, trainer_args  # noqa: E402


def train(name: str, config: dict, args) -> dict:
    training_args = trainer_args(
        args,
        output_dir=os.path.join(args.output_dir, name),
        deepspeed=config,
        num_train_epochs=args.epochs,
        save_strategy="no",
    )
    trainer = Trainer(model=tiny_llama(), args=training_args, train_dataset=Tokens(samples=args.samples))
    trainer.train()
    out = {"global_step": trainer.state.global_step, "log_history": trainer.state.log_history}
    return finish(trainer.model_wrapped, out)


def accelerate_loop(config: dict, args) -> dict:
    """accelerate's documented loop over ``args.epochs`` epochs of a prepared data loader."""
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    model = tiny_llama()
    optimizer = DummyOptim(model.parameters())
    loader = torch.utils.data.DataLoader(Tokens(samples=args.samples), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _ in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return finish(model, {"global_step": model.global_steps, "losses": losses, "batches": len(loader)})


def finish(engine, out: dict) -> dict:
    """Add the committed weights and ACCO's stats to ``out``; free the engine and accelerate's state."""
    out["committed"] = {
        n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad
    }
    out["optimizer_type"] = type(engine.optimizer).__name__
    if hasattr(engine.optimizer, "pipeline"):
        out["stats"] = engine.optimizer.stats()
        engine.optimizer.pipeline.close()
    engine.destroy()
    AcceleratorState._reset_state(True)  # the next run builds its own accelerate/DeepSpeed state
    PartialState._reset_state()
    GradientState._reset_state()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output_dir", required=True)
    ap.add_argument(
        "--configs", required=True, help='JSON file: {"trainer": {name: config}, "accelerate": {...}}'
    )
    ap.add_argument("--samples", type=int, default=88)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--gradient_accumulation_steps", type=int, default=4)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu_accelerate_shim.apply()  # CPU-only test machines; a no-op on GPU
    with open(args.configs) as f:
        configs = json.load(f)
    results = {f"trainer_{name}": train(name, cfg, args) for name, cfg in configs["trainer"].items()}
    results.update(
        {f"accelerate_{name}": accelerate_loop(cfg, args) for name, cfg in configs["accelerate"].items()}
    )
    if torch.distributed.get_rank() == 0:
        torch.save(results, os.path.join(args.output_dir, "result.pt"))


if __name__ == "__main__":
    main()
