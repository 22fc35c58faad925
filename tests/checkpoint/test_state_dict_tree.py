"""The inner optimizer's ``state_dict()`` under torch's pytree, as DeepSpeed's own tests read it.

DeepSpeed's universal-checkpoint test (``TestZeROUniversalCheckpointDP``, ZeRO-1, fp32, optimizer state loaded)
all-gathers ``engine.optimizer.optimizer.state_dict()`` with ``torch.utils._pytree.tree_map`` before the save and
after the load of the universal checkpoint, and compares the two on every rank. ACCO's per-group state is a
``ShardState`` (a dict subclass holding the moment shards): unless registered with torch's pytree it is one
opaque leaf there, ``tree_map`` returns it ungathered, and every rank but 0 compares its own shard with rank 0's.

Launcher test (the ranks of tests/ranks/ckpt_state_tree_worker.py): that round trip, saved on 2 and on 4 ranks,
loaded on 2, in sync (the mode the DeepSpeed test runs) and acco (its save has a commit finished but not swapped
in: the gathered step and moments must be the committed ones). In-process tests: the same reads on one rank.
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import acco_ds  # noqa: F401
from tests.checkpoint.common import acco_engine
from tests.ranks import toy
from tests.ranks.inproc import ensure_single_rank_group
from tests.ranks.launch import REPO, run_local

WORKER = REPO / "tests" / "ranks" / "ckpt_state_tree_worker.py"
# (mode, gradient_accumulation_steps): acco splits a step into two rounds
MODES = {"sync": 1, "acco": 2}
LAUNCHES = (2, 4, 2)  # world size per launch: the saves on 2 ranks, those on 4, then every load on 2
SAVE_LAUNCH, LOAD_LAUNCH = {2: 0, 4: 1}, 2


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """{job name: [record per rank]} of the three launches."""
    out = tmp_path_factory.mktemp("state_tree")
    jobs = []
    for mode, gas in MODES.items():
        for world, launch in SAVE_LAUNCH.items():
            ckpt = str(out / f"{mode}_w{world}")
            jobs.append({"name": f"save_{mode}_w{world}", "kind": "save", "launch": launch, "mode": mode,
                         "gas": gas, "ckpt": ckpt})  # fmt: skip
            jobs.append({"name": f"load_{mode}_w{world}", "kind": "load", "launch": LOAD_LAUNCH, "mode": mode,
                         "gas": gas, "ckpt": ckpt})  # fmt: skip
    spec = out / "jobs.json"
    spec.write_text(json.dumps(jobs))
    for launch, world in enumerate(LAUNCHES):
        run_local(WORKER, world, ["--jobs", spec, "--out", out, "--launch_index", launch])
    return {
        job["name"]: [
            torch.load(out / f"{job['name']}.rank{r}.pt", weights_only=False)
            for r in range(LAUNCHES[job["launch"]])
        ]
        for job in jobs
    }


def _unpadded(state: dict, numel: int) -> dict:
    """The test's ``remove_pad_in_opt_state``: every tensor but a step cut to the parameter count."""
    return tree_map(lambda t: t[:numel] if torch.is_tensor(t) and t.numel() > 1 else t, state)


@pytest.mark.launcher
@pytest.mark.parametrize("saved_on", sorted(SAVE_LAUNCH))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_gathered_state_dict_survives_universal_round_trip(records, mode, saved_on):
    """DeepSpeed's check: on every rank of the load, the gathered state dict, padding cut, equals the one rank 0
    gathered before the save; then that the gather reached the moment shards (the full padded length, each
    rank's shard in its place)."""
    saved = records[f"save_{mode}_w{saved_on}"]
    loaded = records[f"load_{mode}_w{saved_on}"]
    numel = saved[0]["numel"]
    want = _unpadded(saved[0]["gathered"], numel)  # the test keeps rank 0's
    (want_state,) = want["state"].values()
    for r, rec in enumerate(loaded):
        got = _unpadded(rec["gathered"], numel)
        assert got["param_groups"] == want["param_groups"], f"rank {r}"
        (got_state,) = got["state"].values()
        assert got_state.keys() == want_state.keys(), f"rank {r}"
        for key, value in want_state.items():
            now = got_state[key]
            if now.shape != value.shape:
                pytest.fail(
                    f"rank {r}: {key} of shape {tuple(now.shape)} after the load, {tuple(value.shape)} before"
                )
            diff = (now - value).abs().max().item()
            assert torch.equal(now, value), f"rank {r}: {key} differs after the load, max |diff| {diff}"
    assert want_state["step"].item() == 2, "two optimizer steps before the save"
    assert (want_state["exp_avg_sq"] > 0).all(), "every parameter has a second moment"
    for rec in saved + loaded:
        (state,) = rec["gathered"]["state"].values()
        assert type(state) is dict, f"the gathered state is a {type(state).__name__}, not a plain dict"
        shard = rec["raw_exp_avg"].numel()
        assert state["exp_avg"].numel() == rec["world"] * shard >= numel
    for r, rec in enumerate(saved):
        (state,) = rec["gathered"]["state"].values()
        shard = rec["raw_exp_avg"].numel()
        assert torch.equal(state["exp_avg"][r * shard : (r + 1) * shard], rec["raw_exp_avg"]), f"rank {r}"


# -- one rank, in this process ------------------------------------------------------------------------------------
@pytest.fixture
def engine():
    ensure_single_rank_group()
    eng = acco_engine(toy.build(3))  # acco mode, GAS 2
    yield eng
    eng.optimizer.pipeline.close()


def _step(eng, first_micro: int) -> None:
    for i in range(eng.gradient_accumulation_steps()):
        eng.backward(eng(*toy.micro_batch(0, first_micro + i)))
        eng.step()


def test_tree_map_reaches_the_moments_and_gives_plain_dicts(engine):
    _step(engine, 0)
    _step(engine, 2)
    engine.optimizer.pipeline.sync_in_flight()  # the commit of step 2 finished, not swapped in
    holder = engine.optimizer.optimizer
    (master,) = holder.state
    raw = dict(dict.items(holder.state[master]))  # no wait, no count of the finished commit
    assert raw["step"].item() == 1
    mapped = tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, holder.state_dict())
    (state,) = mapped["state"].values()
    assert type(state) is dict
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"].item() == 2  # both commits finished
    assert state["exp_avg"] is not raw["exp_avg"] and torch.equal(state["exp_avg"], raw["exp_avg"])
    leaves, _ = tree_flatten(holder.state)
    assert len(leaves) == 3 and all(torch.is_tensor(t) for t in leaves)


def test_pickle_holds_the_current_step(engine):
    _step(engine, 0)
    _step(engine, 2)
    engine.optimizer.pipeline.sync_in_flight()
    (state,) = engine.optimizer.optimizer.state.values()
    copy = pickle.loads(pickle.dumps(state))
    assert type(copy) is dict
    assert copy["step"].item() == 2
    assert torch.equal(copy["exp_avg"], dict.__getitem__(state, "exp_avg"))
