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

from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

import acco_ds  # noqa: E402,F401  (the only change a user makes)
from tests.ranks.hf_epochs import accelerate_epochs, epochs_trainer, release, run_configs  # noqa: E402


def train(name: str, config: dict, args) -> dict:
    trainer = epochs_trainer(name, config, args)
    trainer.train()
    out = {"global_step": trainer.state.global_step, "log_history": trainer.state.log_history}
    return finish(trainer.model_wrapped, out)


def accelerate_loop(config: dict, args) -> dict:
    """accelerate's documented loop over ``args.epochs`` epochs of a prepared data loader."""
    model, losses, batches = accelerate_epochs(
        config, args, gradient_accumulation_steps=args.gradient_accumulation_steps
    )
    return finish(model, {"global_step": model.global_steps, "losses": losses, "batches": batches})


def finish(engine, out: dict) -> dict:
    """Add the committed weights and ACCO's stats to ``out``; free the engine and accelerate's state."""
    out["committed"] = {
        n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad
    }
    out["optimizer_type"] = type(engine.optimizer).__name__
    if hasattr(engine.optimizer, "pipeline"):
        out["stats"] = engine.optimizer.stats()
    release(engine)
    return out


def main() -> None:
    run_configs(train, accelerate_loop)


if __name__ == "__main__":
    main()
