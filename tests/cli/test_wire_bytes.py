"""acco_ds.cli.wire_bytes: the ring volume of each counted call, in positional and keyword form; the counter
counts while installed and restores torch.distributed; the benchmark contenders' configs and the e2e bytes
table."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from acco_ds.cli import dsconfig
from acco_ds.cli.wire_bytes import WireCounter, sent_bytes
from benchmarks.harness import runs, tables
from tests.ranks.inproc import ensure_single_rank_group


@pytest.fixture(scope="module")
def group():
    ensure_single_rank_group()


def test_ring_volumes(group, monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    t = torch.zeros(1000)  # 4000 bytes
    assert sent_bytes("all_reduce", (t,), {}) == 2 * 3 / 4 * 4000
    assert sent_bytes("all_reduce", (), {"tensor": t, "group": None}) == 6000
    assert sent_bytes("reduce_scatter_tensor", (t[:250], t), {}) == 3000
    assert sent_bytes("reduce_scatter_tensor", (), {"output": t[:250], "input": t}) == 3000
    assert sent_bytes("all_gather_into_tensor", (t, t[:250]), {}) == 3000
    assert sent_bytes("reduce_scatter_single", (t[:250], t), {}) == 3000
    assert sent_bytes("all_gather_single", (), {"output_tensor": t, "input_tensor": t[:250]}) == 3000
    assert sent_bytes("all_gather", ([t[:10]] * 4, t[:10]), {}) == 3 * 40
    assert sent_bytes("isend", (t.to(torch.int8),), {"dst": 1}) == 1000
    assert sent_bytes("send", (), {"tensor": t.bfloat16(), "dst": 1}) == 2000
    assert sent_bytes("broadcast", (t, 0), {}) == 4000  # this process is rank 0: the source
    assert sent_bytes("broadcast", (t, 1), {}) == 0
    assert sent_bytes("all_to_all_single", (t[:10], t), {}) == 3000
    with pytest.raises(ValueError, match="'all_to_all' is not counted"):
        sent_bytes("all_to_all", (t,), {})


def test_internode_bytes_are_those_of_calls_spanning_nodes(group, monkeypatch):
    """Two ranks a node (consecutive): a call among ranks of one node counts in ``sent`` only; a call whose group
    (or a send whose destination) reaches another node counts in ``sent_internode`` too."""
    groups = {"node": [0, 1], "dp": [0, 2], "world": None}
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2 if group else 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: groups[group])
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: groups[group][r])
    counter = WireCounter(ranks_per_node=2)
    t = torch.zeros(1000)  # 4000 bytes
    counter._wrap("all_reduce", lambda *a, **k: None)(t, group="node")  # 4000 sent, inside the node
    counter._wrap("all_reduce", lambda *a, **k: None)(t, group="dp")  # 4000 sent, across
    counter._wrap("isend", lambda *a, **k: None)(t, dst=1)  # inside
    counter._wrap("isend", lambda *a, **k: None)(t, group="dp", group_dst=1)  # to global rank 2: across
    assert counter.sent == 16000 and counter.sent_internode == 8000
    assert WireCounter().sent_internode == 0.0


def test_counts_while_installed_and_restores(group):
    original = dist.all_reduce
    counter = WireCounter().install()
    try:
        assert dist.all_reduce is not original
        t = torch.ones(10)
        dist.all_reduce(t)  # one rank: a ring of one sends nothing
        dist.broadcast(t, 0)
        assert counter.calls == 2 and counter.sent == 40
        assert torch.equal(t, torch.ones(10))  # the call still ran
    finally:
        counter.uninstall()
    assert dist.all_reduce is original
    dist.broadcast(torch.ones(3), 0)
    assert counter.calls == 2


def test_collectives_held_under_other_names_are_counted(group):
    """DeepSpeed's backend calls all_gather_into_tensor through an attribute bound at its start; wrapped through
    ``bound``, the call is counted as the function it is, and put back afterwards."""

    class Backend:
        def __init__(self):
            self.all_gather_function = dist.all_gather_into_tensor

    backend = Backend()
    original = backend.all_gather_function
    counter = WireCounter().install([(backend, "all_gather_function", "all_gather_into_tensor")])
    try:
        out = torch.zeros(8)
        backend.all_gather_function(output_tensor=out, input_tensor=torch.ones(8))
        assert counter.calls == 1 and counter.sent == 0  # one rank: (W-1)/W of 32 bytes
        assert torch.equal(out, torch.ones(8))
    finally:
        counter.uninstall()
    assert backend.all_gather_function is original
    with pytest.raises(ValueError, match="'barrier' is not counted"):
        WireCounter().install([(backend, "all_gather_function", "barrier")])


def test_deepspeeds_bound_collectives_are_found(group):
    import deepspeed

    from acco_ds.deepspeed.bound_collectives import bound_collectives

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    names = {(attr, name) for _, attr, name in bound_collectives()}
    assert ("all_gather_function", "all_gather_into_tensor") in names
    assert ("reduce_scatter_function", "reduce_scatter_tensor") in names


def test_contender_configs():
    knobs = dsconfig.Knobs(micro_batch=2, grad_accum=4, world_size=2, num_params=1000)
    assert runs.contender_config("zero1", knobs) == dsconfig.build_config("zero1", knobs)
    bf16 = runs.contender_config("zero1-bf16comm", knobs)
    assert bf16["communication_data_type"] == "bf16" and bf16["optimizer"]["type"] == "AdamW"
    for label, comp in (
        ("acco-int8", {"commit": "int8", "peek": "int8", "all_gather": "int8"}),
        ("acco-adaptive-int8", {"commit": "int8", "peek": "int8", "all_gather": "int8"}),
        ("sync-int8", {"commit": "int8", "all_gather": "int8"}),
        ("acco-int8-noef", {"commit": "int8", "peek": "int8", "all_gather": "int8", "error_feedback": False}),
        ("acco-int8-exact-peek", {"commit": "int8", "peek": "none", "all_gather": "int8"}),
        ("acco-int8-peek-int4", {"commit": "int8", "peek": "int4", "all_gather": "int8"}),
    ):
        mode, acc = runs.CONTENDERS[label]
        cfg = runs.contender_config(label, dsconfig.Knobs(**{**knobs.__dict__, "accumulation": acc}))
        assert cfg["optimizer"]["params"]["compression"] == comp, label
        assert cfg["optimizer"]["params"]["mode"] == mode
        assert cfg["optimizer"]["params"]["accumulation"] == acc
    # every change is validated by ACCO's own config when the run starts: check it here already
    from acco_ds.config import ACCOConfig

    for label in runs.CONFIG_CHANGES:
        params = runs.contender_config(label, knobs)["optimizer"]["params"]
        if runs.CONTENDERS[label][0] in ("acco", "dpu", "sync"):
            ACCOConfig.from_params(params)


def test_wire_table_only_with_counts():
    an = {
        "tables": {
            "50mbit": {"zero1": {"wire_bytes_per_step": 12e6}, "acco-int8": {"wire_bytes_per_step": 4e6}}
        }
    }
    lines = tables.wire_table(an)
    assert (
        "| 50mbit | acco-int8 | 4.000 | 0.333 |" in lines and "| 50mbit | zero1 | 12.000 | 1.000 |" in lines
    )
    assert tables.wire_table({"tables": {"none": {"zero1": {"step_time_s": 1.0}}}}) == []


def test_newer_names_are_counted_once(group):
    """torch >= 2.10's deprecated ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` call ``*_single``: a call
    of either name is counted once, and acco_ds's own rounds (which call ``*_single``) are counted."""
    from acco_ds.core.comm import all_gather_single, reduce_scatter_single

    if not hasattr(dist, "reduce_scatter_single"):
        pytest.skip("this torch has no reduce_scatter_single")
    t = torch.ones(8)
    counter = WireCounter().install()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.reduce_scatter_tensor(t[:8], t)
            dist.all_gather_into_tensor(t, t[:8])
        assert counter.calls == 2
        reduce_scatter_single(t[:8], t)
        all_gather_single(t, t[:8])
        assert counter.calls == 4
    finally:
        counter.uninstall()
