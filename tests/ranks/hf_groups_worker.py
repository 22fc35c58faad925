"""Per-rank worker of tests/deepspeed/test_hf_param_groups.py: the Hugging Face Trainer with a DeepSpeed config
whose optimizer is ``"type": "ACCO"`` (``--deepspeed``), weight decay 0.01 (``trainer_args``), and the Trainer's own two parameter
groups: the parameters ``Trainer.get_decay_parameter_names`` lists with the weight decay, the others (biases,
norm weights) with 0, as the Trainer builds its AdamW. With an ``"optimizer"`` section in the DeepSpeed config,
transformers hands DeepSpeed every trainable parameter in one group (``deepspeed_init``'s ``model_parameters``);
this script hands it those two groups instead, at the one place the Trainer passes them on
(``transformers.integrations.deepspeed.deepspeed_optim_sched``).

Rank 0 writes ``result.pt`` in ``--output_dir``: the parameter names of each group, each group's settings as the
engine's optimizer holds them, and per optimizer step (a callback; collectives, every rank runs it) the lrs the
step used, the committed fp32 weights and both Adam moments of every parameter, and ACCO's committed-step count.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers.integrations.deepspeed as hf_deepspeed
from transformers import Trainer, TrainerCallback

import acco_ds  # noqa: F401  (registers "ACCO")
from tests.ranks import cpu_accelerate_shim, readback
from tests.ranks.hf_worker import Tokens, tiny_llama, trainer_args


def group_parameters(trainer, weight_decay: float) -> list:
    """The Trainer's decay / no-decay groups (as ``Trainer.create_optimizer`` builds them)."""
    decay = set(trainer.get_decay_parameter_names(trainer.model))
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


class Record(TrainerCallback):
    """Per optimizer step: the lrs it used (read at its start), then the committed weights and moments."""

    def __init__(self):
        self.trainer = None
        self.steps = []
        self.start = None
        self._lrs = None

    def _engine(self):
        return self.trainer.model_wrapped

    def _committed(self) -> dict:
        named = [(n, p) for n, p in self._engine().module.named_parameters() if p.requires_grad]
        out = {"params": readback.full_dict(self._engine(), named)}
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = readback.full_dict(self._engine(), named, key)
        return out

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self._committed()["params"]

    def on_step_begin(self, args, state, control, **kwargs):
        self._lrs = [float(g["lr"]) for g in self._engine().optimizer.param_groups]

    def on_step_end(self, args, state, control, **kwargs):
        record = self._committed()
        record["lrs"] = self._lrs
        record["committed_steps"] = self._engine().optimizer.committed_steps
        record["skipped_steps"] = int(self._engine().skipped_steps)
        self.steps.append(record)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--deepspeed", required=True)
    ap.add_argument("--max_steps", type=int, default=4)
    ap.add_argument("--gradient_accumulation_steps", type=int, default=2)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu_accelerate_shim.apply()  # CPU-only test machines; a no-op on GPU
    training_args = trainer_args(
        args,
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        max_steps=args.max_steps,
        save_strategy="no",
    )
    record = Record()
    trainer = Trainer(model=tiny_llama(), args=training_args, train_dataset=Tokens(), callbacks=[record])
    record.trainer = trainer
    groups = group_parameters(trainer, training_args.weight_decay)
    original = hf_deepspeed.deepspeed_optim_sched

    def with_groups(trainer_, hf_config, args_, steps, model_parameters):
        return original(trainer_, hf_config, args_, steps, groups)

    hf_deepspeed.deepspeed_optim_sched = with_groups
    trainer.train()
    engine = trainer.model_wrapped
    ids = [[id(p) for p in g["params"]] for g in groups]
    names = [[n for n, p in trainer.model.named_parameters() if id(p) in group] for group in ids]
    settings = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    if hasattr(engine.optimizer, "pipeline"):
        engine.optimizer.finish()
    if torch.distributed.get_rank() == 0:
        torch.save(
            {
                "names": names,
                "settings": settings,
                "start": record.start,
                "steps": record.steps,
                "optimizer_type": type(engine.optimizer).__name__,
            },
            os.path.join(args.output_dir, "result.pt"),
        )


if __name__ == "__main__":
    main()
