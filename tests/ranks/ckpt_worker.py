"""Per-rank worker of the checkpoint tests, started by the ``deepspeed`` launcher.

``--phase first`` runs, per fixed-accumulation scenario of the JSON list (toy model, a DeepSpeed
config, ``steps`` optimizer steps, ``save_micro`` micro-batches before the save):

- run A: ``steps`` steps, never interrupted; the committed fp32 parameters after every step.
- run B: ``save_micro`` micro-batches, ``engine.save_checkpoint`` (tag "mid", the engine's
  micro_steps in client_state), then it goes on to ``steps`` in the same process: the save must
  not perturb it. Records the committed fp32 parameters at the save, the model's parameters just
  before and after the save, and the files' view of the state.

``--phase resume`` (a new launch, a new process group): run C builds the model from another seed,
loads "mid" and runs the remaining micro-batches; trajectory, final parameters, stats.

``--phase other_world`` (launched with another world size): loading "mid" resumes from its committed
state (tests/checkpoint/test_reshard.py covers that in depth); loading the module weights only
(load_optimizer_states=False) works too.

Adaptive scenarios (``"adaptive": true``): a linear model whose micro-batch gradient is its own
input vector, rank 1 slowed down; ``first`` trains until ``save_commits`` commits and saves,
``resume`` loads and trains until ``steps`` commits. Each phase records every micro-batch's
(rank, index, round) and every finished job, so the test can check that each gradient entered
exactly the commits the equations give it across the save.
"""

from __future__ import annotations

import os
import time

import deepspeed  # noqa: E402
import torch

import acco_ds  # noqa: E402,F401
from tests.ranks import rank_start, readback, toy  # noqa: E402

TAG = "mid"
LINEAR_DIM = 37


class Linear(torch.nn.Module):
    """loss = <w, c>: a micro-batch's gradient is c, whatever w is."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(LINEAR_DIM))

    def forward(self, c):
        return (self.w * c).sum()


def linear_vector(rank: int, index: int) -> torch.Tensor:
    return torch.randn(LINEAR_DIM, generator=torch.Generator().manual_seed(1_000_003 * rank + index))


def committed(engine) -> torch.Tensor:
    return readback.full_state(engine, toy.trainable(engine.module))


def make_engine(cfg: dict, seed: int = 0):
    model = toy.build(seed)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def feed(engine, rank: int, start: int, stop: int, gas: int, traj: list) -> None:
    """Micro-batches [start, stop); the committed parameters after each accumulation boundary."""
    for i in range(start, stop):
        loss = engine(*toy.micro_batch(rank, i))
        engine.backward(loss)
        engine.step()
        if (i + 1) % gas == 0:
            traj.append(committed(engine))


def close(engine) -> dict:
    opt = engine.optimizer
    opt.finish()
    out = {"final": toy.flat(toy.trainable(engine.module)), "stats": opt.stats()}
    opt.pipeline.close()
    return out


def fixed_first(sc: dict, rank: int, ckpt: str) -> dict:
    cfg, gas = sc["config"], sc["config"]["gradient_accumulation_steps"]
    total = sc["steps"] * gas
    a = make_engine(cfg)
    traj_a: list = []
    feed(a, rank, 0, total, gas, traj_a)
    out = {"traj_a": traj_a, **{f"a_{k}": v for k, v in close(a).items()}}

    b = make_engine(cfg)
    traj_b: list = []
    feed(b, rank, 0, sc["save_micro"], gas, traj_b)
    out["at_save"] = committed(b)
    out["model_before_save"] = toy.flat(toy.trainable(b.module))
    sd = b.module.state_dict()
    out["state_dict_at_save"] = toy.flat(sd[n] for n, p in b.module.named_parameters() if p.requires_grad)
    out["model_holds_at_save"] = b.optimizer.pipeline.model_holds
    b.save_checkpoint(ckpt, tag=TAG, client_state={"micro_steps": b.micro_steps})
    out["model_after_save"] = toy.flat(toy.trainable(b.module))
    out["committed_after_save"] = committed(b)
    feed(b, rank, sc["save_micro"], total, gas, traj_b)
    out["traj_b"] = traj_b
    out.update({f"b_{k}": v for k, v in close(b).items()})
    return out


def fixed_resume(sc: dict, rank: int, ckpt: str) -> dict:
    # "resume_config": the resume's own config (another offload_optimizer setting), else the save's
    cfg = sc.get("resume_config", sc["config"])
    gas = cfg["gradient_accumulation_steps"]
    c = make_engine(cfg, seed=1)  # another initialisation: everything must come from the checkpoint
    path, client = c.load_checkpoint(ckpt, tag=TAG)
    assert path is not None, f"no checkpoint loaded from {ckpt}"
    c.micro_steps = client["micro_steps"]
    out = {"loaded": committed(c), "global_steps": c.global_steps, "lr_after_load": c.get_lr()[0]}
    traj: list = []
    feed(c, rank, sc["save_micro"], sc["steps"] * gas, gas, traj)
    out["traj_c"] = traj
    out.update({f"c_{k}": v for k, v in close(c).items()})
    return out


def other_world(sc: dict, rank: int, ckpt: str) -> dict:
    out = {}
    e = make_engine(sc["config"], seed=1)
    try:
        e.load_checkpoint(ckpt, tag=TAG)
        out["error"] = None
        out["loaded"] = committed(e)
    except Exception as err:  # the test shows the message
        out["error"] = f"{type(err).__name__}: {err}"
    e.optimizer.pipeline.close()
    w = make_engine(sc["config"], seed=1)
    w.load_checkpoint(ckpt, tag=TAG, load_optimizer_states=False)
    out["weights_only"] = committed(w)
    out["model_weights_only"] = toy.flat(toy.trainable(w.module))
    gas = sc["config"]["gradient_accumulation_steps"]
    traj: list = []
    feed(w, rank, 0, 2 * gas, gas, traj)  # training goes on from the loaded weights
    out["trains"] = traj
    w.optimizer.pipeline.close()
    return out


def adaptive(sc: dict, rank: int, ckpt: str, phase: str, state_file: str) -> dict:
    model = Linear()
    engine, opt, _, _ = deepspeed.initialize(
        model=model, config=sc["config"], model_parameters=model.parameters()
    )
    pipe = opt.pipeline
    jobs, micro = [], []
    original = pipe._finish_in_flight

    def spy():
        result = original()
        if result is not None:
            jobs.append((result.job.value, result.commit_index, float(result.count), float(result.grad_norm)))
        return result

    pipe._finish_in_flight = spy
    if phase == "first":
        index, target = 0, sc["save_commits"]
    else:
        engine.load_checkpoint(ckpt, tag=TAG)
        index, target = torch.load(state_file, weights_only=False)["next_index"], sc["steps"]
    start_stats = opt.stats()
    while opt.committed_steps < target:
        if rank == 1:
            time.sleep(sc["slow_ms"] / 1000)
        micro.append((rank, index, pipe.round_index))
        loss = engine(linear_vector(rank, index))
        engine.backward(loss)
        engine.step()
        index += 1
    out = {"micro": micro, "start_stats": start_stats}
    if phase == "first":
        engine.save_checkpoint(ckpt, tag=TAG)
        out["round_index_after_save"] = pipe.round_index
        torch.save({"next_index": index}, state_file)
    else:
        opt.finish()
    out["jobs"], out["stats"] = jobs, opt.stats()
    pipe.close()
    return out


def main() -> None:
    ap = rank_start.scenario_parser()
    ap.add_argument("--phase", choices=["first", "resume", "other_world"], required=True)
    args = ap.parse_args()
    rank = rank_start.init_rank()
    results = {}
    for sc in rank_start.load_scenarios(args.scenarios):
        ckpt = os.path.join(args.out, "ckpt", sc["name"])
        if sc.get("adaptive"):
            if args.phase == "other_world":
                continue
            state_file = os.path.join(args.out, f"{sc['name']}_rank{rank}.pt")
            results[sc["name"]] = adaptive(sc, rank, ckpt, args.phase, state_file)
        elif args.phase == "first":
            results[sc["name"]] = fixed_first(sc, rank, ckpt)
        elif args.phase == "resume":
            results[sc["name"]] = fixed_resume(sc, rank, ckpt)
        elif sc.get("other_world"):
            results[sc["name"]] = other_world(sc, rank, ckpt)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, os.path.join(args.out, f"{args.phase}.pt"))


if __name__ == "__main__":
    main()
