"""Start-up shared by the per-rank workers that the ``deepspeed`` launcher starts in the tests.

``scenario_parser()``: the arguments of the scenario-driven workers (``--scenarios`` JSON list,
``--out`` folder, and ``--local_rank``, which the launcher passes). ``init_rank(backend)``: one torch
thread, ``deepspeed.init_distributed``; returns the global rank. ``load_scenarios(path)``.
``attach_per_rank(results, key, pick)``: every rank's ``pick(result)`` of every scenario, in rank
order, under ``results[name][key]`` (collective).
"""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch


def scenario_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    return ap


def init_rank(backend: str = "gloo") -> int:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend=backend)
    return torch.distributed.get_rank()


def load_scenarios(path: str) -> list:
    with open(path) as f:
        return json.load(f)


def attach_per_rank(results: dict, key: str, pick) -> None:
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {name: pick(r) for name, r in results.items()})
    for name in results:
        results[name][key] = [g[name] for g in gathered]
