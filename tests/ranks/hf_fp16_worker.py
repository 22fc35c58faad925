"""fp16 with dynamic loss scaling under the Hugging Face Trainer (``--fp16``) and accelerate's own loop
(``Accelerator(mixed_precision="fp16")``, its default ``no_sync()`` between boundaries), each DeepSpeed config's ``"fp16": {"enabled": "auto"}`` filled in by
them, the only ACCO-specific line being ``import acco_ds``. Started by the ``deepspeed`` launcher; runs every config
of ``--configs`` (JSON ``{"trainer": {name: config}, "accelerate": {name: config}}``) one after the other in this
process, ``--epochs`` epochs over ``--samples`` samples each. On CPU ranks DeepSpeed's refusal of fp16 is lifted by
the test start-up hook (``ACCO_DS_TEST_CPU_FP16=1``: tests/ranks/cpu_hook/sitecustomize.py).

Model and data: the tiny Llama and token sequences of ``hf_worker``. Rank 0 writes ``result.pt``: per run
(``trainer_<name>``, ``accelerate_<name>``) the losses (the Trainer's log history, one per optimizer step;
accelerate: one per micro-batch), and per optimizer step what the loop saw after it: whether the step was skipped
(``accelerator.optimizer_step_was_skipped``, which the Trainer reads to hold its LR scheduler), the engine's
``skipped_steps`` and the loss scale (``engine.optimizer.cur_scale``); at the end the engine's count and scale (ACCO:
after ``finish()``), the fp16 section DeepSpeed ran with, and ACCO's stats.
"""

from __future__ import annotations

from accelerate.utils import GradientAccumulationPlugin  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import acco_ds  # noqa: E402,F401  (the only change a user makes)
from tests.ranks.hf_epochs import accelerate_epochs, epochs_trainer, release, run_configs  # noqa: E402


def step_record(accelerator, engine) -> dict:
    """What a loop sees after an optimizer step: skipped or not, the engine's skipped steps, the loss scale."""
    return {
        "skipped": bool(accelerator.optimizer_step_was_skipped),
        "skipped_steps": int(engine.skipped_steps),
        "loss_scale": float(engine.optimizer.cur_scale),
    }


class StepRecords(TrainerCallback):
    """After each optimizer step of the Trainer: ``step_record`` of its accelerator and engine."""

    def __init__(self):
        self.trainer = None
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(step_record(self.trainer.accelerator, self.trainer.model_wrapped))


def train(name: str, config: dict, args) -> dict:
    trainer = epochs_trainer(name, config, args, fp16=args.fp16)
    records = StepRecords()
    records.trainer = trainer
    trainer.add_callback(records)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = {"global_step": trainer.state.global_step, "losses": losses, "steps": records.steps}
    return finish(trainer.model_wrapped, out)


def accelerate_loop(config: dict, args) -> dict:
    """accelerate's documented loop over ``args.epochs`` epochs of a prepared data loader, in fp16."""
    # accelerate's default: engine.no_sync() between boundaries (for ZeRO stage 1), where acco's peek still ends by count
    plugin = GradientAccumulationPlugin(num_steps=args.gradient_accumulation_steps)
    steps = []
    model, losses, _ = accelerate_epochs(
        config,
        args,
        on_sync=lambda accelerator, engine: steps.append(step_record(accelerator, engine)),
        mixed_precision="fp16" if args.fp16 else "no",
        gradient_accumulation_plugin=plugin,
    )
    return finish(model, {"global_step": model.global_steps, "losses": losses, "steps": steps})


def finish(engine, out: dict) -> dict:
    """Add the final skipped steps and loss scale (ACCO: after ``finish()``, its committed state), DeepSpeed's fp16
    settings and ACCO's stats to ``out``; free the engine and accelerate's state."""
    if hasattr(engine.optimizer, "pipeline"):
        engine.optimizer.finish()
        out["stats"] = engine.optimizer.stats()
    out["final_skipped_steps"] = int(engine.skipped_steps)
    out["final_loss_scale"] = float(engine.optimizer.cur_scale)
    out["fp16_enabled"] = bool(engine.fp16_enabled())
    out["loss_scale_args"] = engine.dynamic_loss_scale_args() if engine.dynamic_loss_scale() else None
    out["optimizer_type"] = type(engine.optimizer).__name__
    release(engine)
    return out


def add_fp16(ap) -> None:
    ap.add_argument(
        "--fp16", action="store_true", help="TrainingArguments(fp16=True) / mixed_precision='fp16'"
    )


def main() -> None:
    run_configs(train, accelerate_loop, add_fp16)


if __name__ == "__main__":
    main()
