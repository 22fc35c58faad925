"""The training loops users train with, each driving DeepSpeed with a config that says ``"type": "ACCO"`` (or
DeepSpeed's own ``"AdamW"``, the ZeRO-1 twin), the only ACCO-specific line being ``import acco_ds``. Started by
``run_local`` (the environment DeepSpeed's per-node launcher gives each rank); runs every entry of ``--runs`` (a
JSON list) one after the other in this process. Each entry: ``name``, ``loop``, ``config`` (the DeepSpeed config),
``samples`` (of the data set), and for accelerate ``gas_arg`` (``Accelerator(gradient_accumulation_steps=...)``)
and ``plugin`` (``GradientAccumulationPlugin`` keyword arguments) or neither. The loops:

- ``bare``: DeepSpeed's own loop, ``engine(**batch)``, ``engine.backward(loss)``, ``engine.step()`` after every
  micro-batch (the engine's counter ends each step); a shorter last step is marked with
  ``engine.set_gradient_accumulation_boundary`` before each of its backwards (what accelerate does);
- ``coalesce``: one ``with engine.coalesce_grad_reduction():`` block per optimizer step, the boundary marked
  before each backward (DeepSpeed's manual-boundary mode), ``engine.step()`` after the block;
- ``accelerate``: accelerate's documented loop over a prepared data loader (``with accelerator.accumulate(model)``,
  ``accelerator.backward``, ``optimizer.step()``, ``optimizer.zero_grad()``, ``DummyOptim``);
- ``trainer``: the Hugging Face Trainer with ``deepspeed=config`` (``tests/ranks/hf_worker.trainer_args``);
- ``lightning``: PyTorch Lightning's ``Trainer(strategy=DeepSpeedStrategy(config=config),
  accumulate_grad_batches=...)``; on CPU ranks with ``tests/ranks/cpu_lightning_shim.py``.

Model and data: the tiny Llama and token sequences of ``hf_worker``, micro-batches of 2. Rank r's micro-batch j in
the bare and coalesce loops is the one accelerate's prepared loader gives it (base batch j * W + r), so those
loops and accelerate's see the same micro-batches. Rank 0 writes ``result.pt``: per run, per optimizer step the
rounds ACCO had run by its end (``stats()["rounds"]``) and DeepSpeed's gradient norm; at the end the committed fp32
parameters and both Adam moments (after ``finish()`` for ACCO), the engine's optimizer steps and accumulation,
the accumulation accelerate used, and ACCO's stats.
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import deepspeed
import torch
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin, DummyOptim, GradientAccumulationPlugin  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

import acco_ds  # noqa: E402,F401  (the only change a user makes)
from tests.ranks import cpu_accelerate_shim, readback  # noqa: E402
from tests.ranks.hf_epochs import release  # noqa: E402
from tests.ranks.hf_worker import Tokens, tiny_llama, trainer_args  # noqa: E402

MICRO = 2


def micro_batch(data: Tokens, rank: int, world: int, j: int) -> dict:
    """Rank ``rank``'s micro-batch ``j`` as accelerate's prepared loader over ``DataLoader(data, MICRO)`` gives it:
    the base loader's batch ``j * world + rank``."""
    first = MICRO * (j * world + rank)
    items = [data[i] for i in range(first, first + MICRO)]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def step_record(engine) -> dict:
    """After an optimizer step: the rounds ACCO has run so far (None for DeepSpeed's own optimizer) and the norm."""
    stats = engine.optimizer.stats() if hasattr(engine.optimizer, "pipeline") else None
    norm = engine.get_global_grad_norm()
    return {
        "rounds": None if stats is None else stats["rounds"],
        "norm": None if norm is None else float(norm),
    }


def engine_and_batches(run: dict):
    """A run's engine over the tiny Llama (``run["config"]``), this rank's count of micro-batches of
    ``run["samples"]`` samples, and its micro-batch ``j`` on the engine's device: ``batch(j)``."""
    model = tiny_llama()
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=run["config"], model_parameters=model.parameters()
    )
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    data = Tokens(samples=run["samples"])

    def batch(j: int) -> dict:
        return {k: v.to(engine.device) for k, v in micro_batch(data, rank, world, j).items()}

    return engine, run["samples"] // (MICRO * world), batch


def bare_loop(run: dict, gas: int) -> dict:
    engine, batches, batch = engine_and_batches(run)
    steps = []
    short_from = batches - batches % gas  # the micro-batches of a shorter last step, marked by the loop
    for j in range(batches):
        loss = engine(**batch(j)).loss
        if j >= short_from:
            engine.set_gradient_accumulation_boundary(j == batches - 1)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            steps.append(step_record(engine))
    return finish(engine, {"steps": steps})


def coalesce_loop(run: dict, gas: int) -> dict:
    engine, batches, batch = engine_and_batches(run)
    steps = []
    for first in range(0, batches, gas):
        size = min(gas, batches - first)
        with engine.coalesce_grad_reduction():  # one block per optimizer step
            for j in range(first, first + size):
                loss = engine(**batch(j)).loss
                engine.set_gradient_accumulation_boundary(j == first + size - 1)
                engine.backward(loss)
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        steps.append(step_record(engine))
    return finish(engine, {"steps": steps})


def accelerate_loop(run: dict, gas: int) -> dict:
    kwargs = {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=run["config"])}
    if run.get("gas_arg") is not None:
        kwargs["gradient_accumulation_steps"] = run["gas_arg"]
    if run.get("plugin") is not None:
        kwargs["gradient_accumulation_plugin"] = GradientAccumulationPlugin(**run["plugin"])
    accelerator = Accelerator(**kwargs)
    model = tiny_llama()
    optimizer = DummyOptim(model.parameters())
    loader = torch.utils.data.DataLoader(Tokens(samples=run["samples"]), batch_size=MICRO)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps, held = [], 0
    for batch in loader:
        with accelerator.accumulate(model):
            held += bool(
                model.inside_no_sync_ctxt
            )  # accelerate entered engine.no_sync() for this micro-batch
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            steps.append(step_record(model))
    out = {"steps": steps, "accelerate_gas": accelerator.gradient_accumulation_steps, "no_sync_batches": held}
    return finish(model, out)


class Rounds(TrainerCallback):
    """The Hugging Face Trainer's optimizer steps: ``step_record`` after each."""

    def __init__(self):
        self.trainer, self.steps = None, []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(step_record(self.trainer.model_wrapped))


def trainer_loop(run: dict, gas: int, out_dir: str) -> dict:
    args = trainer_args(
        SimpleNamespace(gradient_accumulation_steps=gas),
        output_dir=os.path.join(out_dir, run["name"]),
        deepspeed=run["config"],
        num_train_epochs=1,
        save_strategy="no",
    )
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(samples=run["samples"]))
    rounds = Rounds()
    rounds.trainer = trainer
    trainer.add_callback(rounds)
    trainer.train()
    return finish(trainer.model_wrapped, {"steps": rounds.steps, "trainer_steps": trainer.state.global_step})


def lightning_loop(run: dict, gas: int) -> dict:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DeepSpeedStrategy

    from tests.ranks import cpu_lightning_shim

    cpu_lightning_shim.apply()  # CPU-only test machines (see the module); a no-op on GPU

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return None  # the DeepSpeed config's optimizer section builds it

    class Steps(pl.Callback):
        def __init__(self):
            self.steps, self.seen = [], 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            engine = trainer.strategy.deepspeed_engine
            if engine.global_steps > self.seen:
                self.seen = engine.global_steps
                self.steps.append(step_record(engine))

    steps = Steps()
    trainer = pl.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu",
        devices=torch.distributed.get_world_size(),
        strategy=DeepSpeedStrategy(config=json.loads(json.dumps(run["config"]))),
        accumulate_grad_batches=gas,
        max_epochs=1,
        callbacks=[steps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(Tokens(samples=run["samples"]), batch_size=MICRO)
    trainer.fit(Module(), train_dataloaders=loader)
    out = {
        "steps": steps.steps,
        "lightning_batches": trainer.fit_loop.epoch_loop.batch_progress.total.completed,
    }
    return finish(trainer.strategy.deepspeed_engine, out)


def finish(engine, out: dict) -> dict:
    """Add the committed state (ACCO: after ``finish()``), the engine's counts and ACCO's stats to ``out``; free
    the engine and accelerate's state."""
    acco = hasattr(engine.optimizer, "pipeline")
    if acco:
        engine.optimizer.finish()
    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    out["committed"] = readback.full_dict(engine, params)
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = readback.full_dict(engine, params, key)
    out["optimizer_type"] = type(engine.optimizer).__name__
    out["global_steps"] = engine.global_steps
    out["engine_gas"] = engine.gradient_accumulation_steps()
    if acco:
        out["stats"] = engine.optimizer.stats()
    release(engine)
    return out


LOOPS = {
    "bare": bare_loop,
    "coalesce": coalesce_loop,
    "accelerate": accelerate_loop,
    "lightning": lightning_loop,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", required=True, help="JSON list of runs (module docstring)")
    ap.add_argument("--gradient_accumulation_steps", type=int, default=4)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu_accelerate_shim.apply()  # CPU-only test machines; a no-op on GPU
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    with open(args.runs) as f:
        runs = json.load(f)
    gas, results = args.gradient_accumulation_steps, {}
    for run in runs:
        if run["loop"] == "trainer":
            results[run["name"]] = trainer_loop(run, gas, args.out)
        else:
            results[run["name"]] = LOOPS[run["loop"]](run, gas)
    if torch.distributed.get_rank() == 0:
        torch.save(results, os.path.join(args.out, "result.pt"))


if __name__ == "__main__":
    main()
