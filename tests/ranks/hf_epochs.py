"""What the rank scripts that train the tiny Llama of ``hf_worker`` over several epochs, once per DeepSpeed config of
``--configs``, have in common: the Trainer of a run, accelerate's documented loop over a prepared data loader, the
release of a run's engine and accelerate state, and the ``main()`` that runs every config in one process."""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState, PartialState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, DummyOptim  # noqa: E402
from transformers import Trainer  # noqa: E402

from tests.ranks import cpu_accelerate_shim  # noqa: E402
from tests.ranks.hf_worker import Tokens, tiny_llama, trainer_args  # noqa: E402


def epochs_trainer(name: str, config: dict, args, **kw) -> Trainer:
    """The Trainer of run ``name``: ``args.epochs`` epochs over ``args.samples`` samples, no saving, its output in
    ``args.output_dir/name``; ``kw``: further ``TrainingArguments``."""
    training_args = trainer_args(
        args,
        output_dir=os.path.join(args.output_dir, name),
        deepspeed=config,
        num_train_epochs=args.epochs,
        save_strategy="no",
        **kw,
    )
    return Trainer(model=tiny_llama(), args=training_args, train_dataset=Tokens(samples=args.samples))


def accelerate_epochs(config: dict, args, on_sync=None, **accelerator_kw):
    """accelerate's documented loop over ``args.epochs`` epochs of a prepared data loader (micro-batch 2):
    ``on_sync(accelerator, engine)`` after each micro-batch that ended an accumulation; ``accelerator_kw``: the
    ``Accelerator``'s other settings. Returns the engine, the loss of each micro-batch and the loader's length."""
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), **accelerator_kw)
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
            if on_sync is not None and accelerator.sync_gradients:
                on_sync(accelerator, model)
    return model, losses, len(loader)


def release(engine) -> None:
    """Close ACCO's pipeline, destroy the engine and reset accelerate's state: the next run builds its own
    accelerate/DeepSpeed state."""
    if hasattr(engine.optimizer, "pipeline"):
        engine.optimizer.pipeline.close()
    engine.destroy()
    AcceleratorState._reset_state(True)
    PartialState._reset_state()
    GradientState._reset_state()


def run_configs(train, accelerate_loop, add_arguments=None) -> None:
    """The rank script's ``main()``: ``train(name, config, args)`` for each Trainer config and
    ``accelerate_loop(config, args)`` for each accelerate config of ``--configs`` (JSON ``{"trainer": {name:
    config}, "accelerate": {name: config}}``), one after the other; rank 0 saves the results (keys
    ``trainer_<name>``, ``accelerate_<name>``) as ``result.pt`` in ``--output_dir``. ``add_arguments(parser)``:
    the script's own options."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--output_dir", required=True)
    ap.add_argument(
        "--configs", required=True, help='JSON file: {"trainer": {name: config}, "accelerate": {...}}'
    )
    ap.add_argument("--samples", type=int, default=88)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--gradient_accumulation_steps", type=int, default=4)
    if add_arguments is not None:
        add_arguments(ap)
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
