"""Per-rank worker for the tensor-parallel tests (tests/deepspeed/test_tensor_parallel.py), started by the deepspeed
launcher: a tiny Llama built from a transformers config (fp32, untied embeddings: AutoTP splits the
attention/MLP projections and the LM head, the embedding and the norms stay replicated), trained with
``"tensor_parallel": {"autotp_size": T}`` beside ZeRO-1 (ACCO or DeepSpeed's AdamW).

Data follow the data-parallel rank (the ranks of one tensor-parallel group see the same micro-batches),
so a run at TP T x DP D and one at TP 1 x DP D train on the same data. Rank 0 saves, per scenario and
per engine step: every rank's committed slices (``safe_get_full_fp32_param``) and moments, the full
parameters and moments rebuilt over the tensor-parallel group (concatenated along each split
parameter's partition dimension), the reported gradient norm, the loss scale (``engine.optimizer.cur_scale``) and
the engine's ``skipped_steps``, and at the end the stats.

fp16 (``"fp16": {"enabled": true}``): the rank first lifts the CPU accelerator's fp16 refusal
(``allow_fp16_on_cpu``); a scenario's ``poison``, ``[dp_rank, tp_rank, micro-batch index]`` triples, multiplies that
micro-batch's loss by inf on that rank only (a planted overflow; ``tp_rank`` None: every rank of the replica), so a
run at TP T and one at TP 1 can plant the same overflows. While DeepSpeed's ZeRO-1 has no Adam state yet (every
step so far skipped) its moments are recorded as zeros."""

from __future__ import annotations

import os

import deepspeed  # noqa: E402
import torch
import torch.distributed as dist
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import acco_ds  # noqa: E402,F401
from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu
from tests.ranks import llama, rank_start  # noqa: E402

VOCAB, SEQ, MICRO = 64, 12, 2


def tiny_llama() -> LlamaForCausalLM:
    """The tiny Llama (tests/ranks/llama.py) of this script's vocabulary and length, 4 key/value heads, untied."""
    return llama.tiny_llama(VOCAB, SEQ, kv_heads=4, tied=False)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, gradient summed over the tensor-parallel group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: partial outputs summed over the tensor-parallel group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class MpuMLP(torch.nn.Module):
    """A Megatron-style tensor-parallel MLP a user would bring with their own ``mpu``: the first matrix
    split by output rows, the second by input columns (marked ``model_parallel``), a replicated input
    scale and output bias. Initialised from one seeded unsplit model, so every layout is the same model."""

    D, H = 8, 12

    def __init__(self, tp_group):
        super().__init__()
        tp, r = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        g = torch.Generator().manual_seed(0)
        w, v = torch.randn(self.H, self.D, generator=g) * 0.3, torch.randn(self.D, self.H, generator=g) * 0.3
        h = self.H // tp
        self.group = tp_group
        self.scale = torch.nn.Parameter(torch.ones(self.D))
        self.w = torch.nn.Parameter(w[r * h : (r + 1) * h].clone())
        self.v = torch.nn.Parameter(v[:, r * h : (r + 1) * h].clone())
        self.bias = torch.nn.Parameter(torch.zeros(self.D))
        self.w.model_parallel = self.v.model_parallel = True

    def forward(self, x, y):
        z = _CopyToTP.apply(x * self.scale, self.group)
        out = (
            _ReduceFromTP.apply(torch.nn.functional.gelu(z @ self.w.t()) @ self.v.t(), self.group) + self.bias
        )
        return torch.nn.functional.mse_loss(out, y)


class Mpu:
    """The methods DeepSpeed reads from a Megatron-style mpu."""

    def __init__(self, tp_group, dp_group):
        self.tp, self.dp = tp_group, dp_group

    def get_model_parallel_group(self):
        return self.tp

    def get_model_parallel_world_size(self):
        return dist.get_world_size(self.tp)

    def get_model_parallel_rank(self):
        return dist.get_rank(self.tp)

    def get_data_parallel_group(self):
        return self.dp

    def get_data_parallel_world_size(self):
        return dist.get_world_size(self.dp)

    def get_data_parallel_rank(self):
        return dist.get_rank(self.dp)


_MPU = []


def mpu_groups(tp: int) -> Mpu:
    """Consecutive ranks form a tensor-parallel group, as with AutoTP (created once, by every rank)."""
    if not _MPU:
        world = dist.get_world_size()
        tps = [list(range(i, i + tp)) for i in range(0, world, tp)]
        dps = [list(range(j, world, tp)) for j in range(tp)]
        tp_group, _ = dist.new_subgroups_by_enumeration(tps)
        dp_group, _ = dist.new_subgroups_by_enumeration(dps)
        _MPU.append(Mpu(tp_group, dp_group))
    return _MPU[0]


def micro_batch(dp_rank: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * dp_rank + 1_000 + index)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def loss_of(engine, sc: dict, dp_rank: int, index: int) -> torch.Tensor:
    if sc.get("model") == "mpu_mlp":
        g = torch.Generator().manual_seed(7919 * dp_rank + 5_000 + index)
        x, y = torch.randn(4, MpuMLP.D, generator=g), torch.randn(4, MpuMLP.D, generator=g)
        return engine(x, y)
    x = micro_batch(dp_rank, index)
    return engine(input_ids=x, labels=x).loss


def full_over_tp(named: dict, meta: dict, tp_group) -> dict:
    """Each split parameter's slices concatenated over the tensor-parallel group (a collective)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return {k: v.clone() for k, v in named.items()}
    parts = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(parts, named, group=tp_group)
    out = {}
    for name, t in named.items():
        dim = meta.get(name)
        out[name] = t.clone() if dim is None else torch.cat([p[name] for p in parts], dim=dim)
    return out


def run_scenario(sc: dict) -> dict:
    cfg = sc["config"]
    gas = cfg["gradient_accumulation_steps"]
    if cfg.get("fp16", {}).get("enabled"):
        allow_fp16_on_cpu()
    if sc.get("model") == "mpu_mlp":
        mpu = mpu_groups(sc["tp"])
        model = MpuMLP(mpu.tp)
        engine, _, _, _ = deepspeed.initialize(
            model=model, config=cfg, model_parameters=model.parameters(), mpu=mpu
        )
        tp_group = mpu.tp
    else:
        model = tiny_llama()
        engine, _, _, _ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        tp = int(cfg.get("tensor_parallel", {}).get("autotp_size", 1))
        tp_group = groups.get_tensor_model_parallel_group() if tp > 1 else None
    dp_rank = dist.get_rank(engine.seq_data_parallel_group)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    meta = {
        n: p.ds_autotp_universal_checkpoint_meta["partition_dim"]
        for n, p in named
        if getattr(p, "ds_autotp_universal_checkpoint_meta", None)
        and not p.ds_autotp_universal_checkpoint_meta["replicated"]
    }
    steps, adaptive = [], sc.get("adaptive_steps")
    index = 0
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    poison = {(d, t, i) for d, t, i in sc.get("poison", [])}

    def loss_at(i: int) -> torch.Tensor:
        loss = loss_of(engine, sc, dp_rank, i)
        if (dp_rank, tp_rank, i) in poison or (dp_rank, None, i) in poison:
            loss = loss * float("inf")
        return loss

    def moment(p, key: str) -> torch.Tensor:
        # DeepSpeed's ZeRO-1 has no Adam state while every step so far was skipped (the same on every rank)
        if not hasattr(engine.optimizer, "pipeline") and not engine.optimizer.optimizer.state:
            return torch.zeros_like(safe_get_full_fp32_param(p))
        return safe_get_full_optimizer_state(p, key).clone()

    def record():
        got = {
            "params": {n: safe_get_full_fp32_param(p).clone() for n, p in named},
            "exp_avg": {n: moment(p, "exp_avg") for n, p in named},
            "exp_avg_sq": {n: moment(p, "exp_avg_sq") for n, p in named},
        }
        norm = engine.get_global_grad_norm()
        steps.append(
            {
                **{f"full_{k}": full_over_tp(v, meta, tp_group) for k, v in got.items()},
                **got,
                "norm": None if norm is None else float(norm),
                "scale": float(engine.optimizer.cur_scale),
                "skipped": int(engine.skipped_steps),
            }
        )

    if adaptive:  # drive by optimizer steps; the slow replica sleeps per micro-batch
        import time

        opt = engine.optimizer
        micro = []
        if dist.get_rank() == sc.get("lagging_rank"):
            # this rank sees its job in flight done only at every third look, as if its job ran slower than
            # its tensor-parallel peer's: without the group's agreement the two would end rounds apart
            done, looks = opt.pipeline._in_flight_done, [0]

            def lagging() -> bool:
                looks[0] += 1
                return done() and looks[0] % 3 == 0

            opt.pipeline._in_flight_done = lagging
        while opt.committed_steps < adaptive:
            if dp_rank == 1:  # the slow replica; its second tensor-parallel rank slower still, so the
                # jobs of the two tensor-parallel ranks of the fast replica finish at different times
                tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
                time.sleep(sc.get("slow_s", 0.03) * (1 + tp_rank))
            micro.append((opt.pipeline.round_index, opt.pipeline.counter.count))
            engine.backward(loss_at(index))
            engine.step()
            index += 1
        record()
    else:
        for _ in range(sc["steps"]):
            for _ in range(gas):
                engine.backward(loss_at(index))
                engine.step()
                index += 1
            record()
    out = {
        "steps": steps,
        "meta": meta,
        "rank": dist.get_rank(),
        "dp_rank": dp_rank,
        "tp_rank": tp_rank,
        "micro": index,
        "param_dtype": str(named[0][1].dtype),
    }
    if adaptive:
        out["rounds_of_micro"] = micro  # (round index, count before) of every micro-batch
    opt = engine.optimizer
    if hasattr(opt, "pipeline"):
        opt.finish()
        out["stats"] = opt.stats()
        out["final_norm"] = float(opt.pipeline.last_grad_norm)
        out["final_scale"] = float(opt.cur_scale)
        out["final"] = full_over_tp(
            {n: safe_get_full_fp32_param(p).clone() for n, p in named}, meta, tp_group
        )
        opt.pipeline.close()
    return out


def run_checkpoint_scenario(sc: dict, out_dir: str) -> dict:
    """Train ``steps`` engine steps, saving a checkpoint after ``save_after`` and exporting the full model
    (AutoTP's consolidated state dict) right after the save, while acco holds the estimate; then a second
    engine loads the checkpoint and trains the remaining steps on the same data. Returns every rank's final
    slices of both runs, the export and the committed full parameters at the export, and (rank 0) the
    export reloaded through transformers' save_pretrained / from_pretrained."""
    cfg, gas = sc["config"], sc["config"]["gradient_accumulation_steps"]
    ckpt = os.path.join(out_dir, sc["name"] + "_ckpt")

    def engine_and_names():
        engine, _, _, _ = deepspeed.initialize(model=tiny_llama(), config=cfg, model_parameters=None)
        return engine, [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]

    def train(engine, first_step, last_step, dp_rank):
        for step in range(first_step, last_step):
            for j in range(gas):
                x = micro_batch(dp_rank, step * gas + j)
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()

    out = {}
    engine, named = engine_and_names()
    dp_rank = dist.get_rank(engine.seq_data_parallel_group)
    meta = {n: p.ds_autotp_universal_checkpoint_meta["partition_dim"] for n, p in named
            if getattr(p, "ds_autotp_universal_checkpoint_meta", None)
            and not p.ds_autotp_universal_checkpoint_meta["replicated"]}  # fmt: skip
    tp_group = groups.get_tensor_model_parallel_group()
    train(engine, 0, sc["save_after"], dp_rank)
    engine.save_checkpoint(ckpt, tag="t")
    out["model_holds_at_export"] = engine.optimizer.pipeline.model_holds
    export = engine._consolidated_16bit_state_dict()
    committed = full_over_tp({n: safe_get_full_fp32_param(p).clone() for n, p in named}, meta, tp_group)
    if dist.get_rank() == 0:
        out["export"] = {k: v.clone() for k, v in export.items()}
        out["committed_at_export"] = committed
        hf_dir = os.path.join(out_dir, sc["name"] + "_hf")
        model = tiny_llama()
        model.load_state_dict(export)
        model.save_pretrained(hf_dir)
        reloaded = LlamaForCausalLM.from_pretrained(hf_dir)
        out["reloaded"] = {n: p.detach().clone() for n, p in reloaded.named_parameters()}
    train(engine, sc["save_after"], sc["steps"], dp_rank)
    engine.optimizer.finish()
    out["final_uninterrupted"] = {n: safe_get_full_fp32_param(p).clone() for n, p in named}
    engine.optimizer.pipeline.close()

    resumed, named = engine_and_names()
    resumed.load_checkpoint(ckpt, tag="t")
    train(resumed, sc["save_after"], sc["steps"], dp_rank)
    resumed.optimizer.finish()
    out["final_resumed"] = {n: safe_get_full_fp32_param(p).clone() for n, p in named}
    resumed.optimizer.pipeline.close()
    return out


def run_load_scenario(sc: dict) -> dict:
    """Load a checkpoint written by another layout (``load_from``, tag "t") and return the committed
    parameters, rebuilt over the tensor-parallel group."""
    engine, _, _, _ = deepspeed.initialize(model=tiny_llama(), config=sc["config"], model_parameters=None)
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    meta = {n: p.ds_autotp_universal_checkpoint_meta["partition_dim"] for n, p in named
            if getattr(p, "ds_autotp_universal_checkpoint_meta", None)
            and not p.ds_autotp_universal_checkpoint_meta["replicated"]}  # fmt: skip
    engine.load_checkpoint(sc["load_from"], tag="t")
    tp_group = groups.get_tensor_model_parallel_group()
    out = {
        "committed": full_over_tp({n: safe_get_full_fp32_param(p).clone() for n, p in named}, meta, tp_group)
    }
    engine.optimizer.pipeline.close()
    return out


def main() -> None:
    args = rank_start.scenario_parser().parse_args()
    rank_start.init_rank()
    results = {}
    for sc in rank_start.load_scenarios(args.scenarios):
        if "save_after" in sc:
            mine = run_checkpoint_scenario(sc, args.out)
        elif "load_from" in sc:
            mine = run_load_scenario(sc)
        else:
            mine = run_scenario(sc)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results[sc["name"]] = everyone
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(args.out, "results.pt"))


if __name__ == "__main__":
    main()
