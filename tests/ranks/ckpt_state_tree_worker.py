"""Per-rank worker of tests/checkpoint/test_state_dict_tree.py: DeepSpeed's universal-checkpoint unit test
(``TestZeROUniversalCheckpointDP``, fp32, optimizer state loaded) as its ranks run it, without DeepSpeed's test
tree. Every rank reads the inner optimizer's ``state_dict()`` (``engine.optimizer.optimizer``) and all-gathers
every tensor of it that is not a step count with ``torch.utils._pytree.tree_map``, as that test does; each rank
keeps what it got.

Jobs (``--jobs`` JSON list, those with ``"launch"`` equal to ``--launch_index``, in order), all on
``model()`` (two 10 x 10 linear layers, 220 parameters: a shard of 2 or 4 ranks ends in padding) with
``"train_batch_size": 8`` and ``"optimizer": {"type": "ACCO", "params": {"mode": <mode>}}``, ZeRO-1:

- ``"kind": "save"``: a model built from seed ``100 + rank`` (DeepSpeed broadcasts rank 0's) trains ``STEPS``
  steps on this rank's own data, reads the state dict once (the test does, before saving), saves tag ``t`` in
  ``ckpt`` with the client state the test gives (``universal_checkpoint_info``, ``iteration``), rank 0 converts
  it with ``ds_to_universal``'s ``main`` into ``t_universal`` (in this process, as the test does), and every rank
  records the gathered state dict and its own raw moment shard (``dict.__getitem__``, no wait).
- ``"kind": "load"``: a model built from seed ``200 + rank`` loads ``t_universal`` with
  ``"checkpoint": {"load_universal": true}`` and records the gathered state dict; then it trains ``STEPS`` more
  steps (the optimizer state must be usable).

Every rank writes ``<out>/<job name>.rank<r>.pt``: ``{"gathered": ..., "numel": parameters, "world": W,
"raw_exp_avg": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
from types import SimpleNamespace

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
from torch.utils._pytree import tree_map

import acco_ds  # noqa: F401
from tests.ranks import rank_start

HIDDEN, STEPS, TAG = 10, 2, "t"


class Model(torch.nn.Module):
    """DeepSpeed's unit-test ``SimpleModel(10, nlayers=2)``: the first layer is applied three times."""

    def __init__(self):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])

    def forward(self, x, y):
        for i, layer in enumerate(self.linears):
            x = self.linears[i // 2](x) + layer(x)
        return torch.nn.functional.cross_entropy(x, y)


def model(seed: int) -> Model:
    torch.manual_seed(seed)
    return Model()


def gathered(optimizer) -> dict:
    """The universal-checkpoint test's ``gather_opt_state``: every tensor but a one-element CPU one (a step),
    flattened and all-gathered over the ranks, rank order."""

    def gather(t):
        if not torch.is_tensor(t) or (t.device.type == "cpu" and t.numel() == 1):
            return t
        parts = [torch.zeros_like(t.flatten()) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.flatten())
        return torch.cat(parts)

    return tree_map(gather, optimizer.state_dict())


def train(engine, rank: int, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + rank)
    micro = engine.train_micro_batch_size_per_gpu()
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x = torch.randn(micro, HIDDEN, generator=g)
        y = torch.randint(0, HIDDEN, (micro,), generator=g)
        engine.backward(engine(x, y))
        engine.step()


def run(job: dict, rank: int, out: str) -> None:
    cfg = {
        "train_batch_size": 8,
        "gradient_accumulation_steps": job["gas"],
        "optimizer": {"type": "ACCO", "params": {"mode": job["mode"]}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    ckpt = job["ckpt"]
    if job["kind"] == "save":
        net = model(100 + rank)
        engine, *_ = deepspeed.initialize(config=cfg, model=net, model_parameters=net.parameters())
        train(engine, rank, STEPS, seed=1000)
        engine.optimizer.optimizer.state_dict()  # read before the save, as the test does
        client = {UNIVERSAL_CHECKPOINT_INFO: {}, "iteration": STEPS}
        engine.save_checkpoint(ckpt, tag=TAG, client_state=client)
        dist.barrier()
        if rank == 0:
            ds_to_universal(
                SimpleNamespace(
                    input_folder=os.path.join(ckpt, TAG),
                    output_folder=os.path.join(ckpt, f"{TAG}_universal"),
                    num_extract_workers=1,
                    num_merge_workers=1,
                    keep_temp_folder=False,
                    strict=True,
                    inject_missing_state=False,
                )
            )
        dist.barrier()
    else:
        net = model(200 + rank)
        cfg["checkpoint"] = {"load_universal": True}
        engine, *_ = deepspeed.initialize(config=cfg, model=net, model_parameters=net.parameters())
        engine.load_checkpoint(ckpt, tag=f"{TAG}_universal", load_optimizer_states=True)
    state = engine.optimizer.optimizer.state[engine.optimizer.single_partition_of_fp32_groups[0]]
    record = {
        # cloned: the step is not gathered, and torch's state_dict() holds the live step tensor
        "gathered": tree_map(
            lambda t: t.clone() if torch.is_tensor(t) else t, gathered(engine.optimizer.optimizer)
        ),
        "numel": sum(p.numel() for p in engine.module.parameters()),
        "world": dist.get_world_size(),
        "raw_exp_avg": dict.__getitem__(state, "exp_avg").clone(),
    }
    torch.save(record, os.path.join(out, f"{job['name']}.rank{rank}.pt"))  # before training on, as the test
    if job["kind"] == "load":
        train(engine, rank, STEPS, seed=2000)
    engine.optimizer.finish()
    engine.optimizer.pipeline.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--launch_index", type=int, required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    a = ap.parse_args()
    rank = rank_start.init_rank("gloo")
    with open(a.jobs) as f:
        jobs = [j for j in json.load(f) if j["launch"] == a.launch_index]
    for job in jobs:
        run(job, rank, a.out)


if __name__ == "__main__":
    main()
