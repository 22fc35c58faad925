"""The runs of tests/ranks/grad_access_worker.py that a test module compares, at 1 rank (in this process) and at 2
ranks (one launch): ``runs_fixtures(scenarios, tmp_name)`` gives the module's fixtures ``one_rank``, ``two_ranks``
and ``runs`` (parametrized over both worlds, the 2-rank one marked ``launcher``), each the results by scenario name."""

from __future__ import annotations

import json

import pytest
import torch

from tests.ranks import grad_access_worker as worker
from tests.ranks.inproc import ensure_single_rank_group
from tests.ranks.launch import REPO, rank_env, run_local

WORLDS = [1, pytest.param(2, marks=pytest.mark.launcher)]


def runs_fixtures(scenarios, tmp_name: str):
    """The fixtures ``one_rank``, ``two_ranks`` and ``runs`` of the scenarios ``scenarios()``; the 2-rank launch
    writes in a temporary folder named ``tmp_name``. Bind them in the test module under those names."""

    @pytest.fixture(scope="module")
    def one_rank():
        ensure_single_rank_group()
        return {sc["name"]: worker.run_scenario(sc, 0) for sc in scenarios()}

    @pytest.fixture(scope="module")
    def two_ranks(tmp_path_factory):
        tmp = tmp_path_factory.mktemp(tmp_name)
        (tmp / "scenarios.json").write_text(json.dumps(scenarios()))
        args = ["--scenarios", tmp / "scenarios.json", "--out", tmp]
        run_local(REPO / "tests" / "ranks" / "grad_access_worker.py", 2, args, env=rank_env())
        return torch.load(tmp / "results.pt", weights_only=False)

    @pytest.fixture(params=WORLDS, ids=lambda w: f"W{w}")
    def runs(request):
        return request.getfixturevalue("one_rank" if request.param == 1 else "two_ranks")

    return one_rank, two_ranks, runs
