"""``optimizer.params.host_threads``: the OpenMP threads of the CPU kernels the round's job runs on the communication
worker thread (the host AdamW of offload on GPU ranks; the job's AdamW, quantization and quantized-sum kernels on
CPU ranks).

- the option's values and errors, and the 'auto' formula: on GPU ranks ``max(1, CPUs // ranks on the node - 1)``,
  on CPU ranks ``None`` (``torch.get_num_threads()``, as before the option);
- ``acco_ds.ops.adamw.set_host_threads`` is the calling thread's alone;
- in a real one-rank engine the worker thread's kernel calls receive the configured count while the training
  thread keeps ``torch.get_num_threads()``, it is logged at start-up, and the bits are those of the default count.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from acco_ds.config import ALLOWED, MAX_HOST_THREADS, ACCOConfig, ACCOConfigError, available_cpus, local_ranks
from acco_ds.ops import _build
from acco_ds.ops.adamw import host_threads, set_host_threads


@pytest.mark.parametrize(
    "value", ["many", "", "4", 0, -1, 2.5, True, None, float("inf"), MAX_HOST_THREADS + 1]
)
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(value):
    with pytest.raises(ACCOConfigError) as err:
        ACCOConfig.from_params({"host_threads": value})
    text = str(err.value)
    assert f"optimizer.params.host_threads={value!r}" in text, text
    assert ALLOWED["host_threads"] in text, text


@pytest.mark.parametrize(
    "value, want", [("auto", "auto"), (1, 1), (7, 7), (4.0, 4), (MAX_HOST_THREADS, 1024)]
)
def test_the_values_allowed(value, want):
    got = ACCOConfig.from_params({"host_threads": value}).host_threads
    assert got == want and type(got) is type(want)


def test_the_default_is_auto():
    assert ACCOConfig().host_threads == "auto"


@pytest.mark.parametrize(
    "cpus, ranks, want",
    [
        (16, 1, 15),
        (16, 2, 7),
        (16, 8, 1),
        (16, 16, 1),
        (16, 32, 1),
        (64, 8, 7),
        (2, 1, 1),
        (1, 1, 1),
        (3, 1, 2),
    ],
)
def test_auto_on_gpu_ranks_leaves_the_training_thread_a_core(cpus, ranks, want):
    cfg = ACCOConfig()
    assert cfg.host_thread_count("cuda", cpus=cpus, ranks_on_node=ranks) == want


def test_auto_on_cpu_ranks_keeps_torchs_count_and_an_integer_is_used_everywhere():
    assert ACCOConfig().host_thread_count("cpu", cpus=16, ranks_on_node=1) is None
    fixed = ACCOConfig(host_threads=5)
    assert fixed.host_thread_count("cpu", cpus=2, ranks_on_node=2) == 5
    assert fixed.host_thread_count("cuda", cpus=2, ranks_on_node=2) == 5


def test_auto_reads_the_affinity_and_the_launchers_local_size(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert local_ranks() == 1
    monkeypatch.setenv("LOCAL_SIZE", "4")  # DeepSpeed's launcher
    assert local_ranks() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun wins
    assert local_ranks() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "zero")
    assert local_ranks() == 4
    monkeypatch.setenv("LOCAL_SIZE", "0")
    assert local_ranks() == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7}, raising=False)
    assert available_cpus() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ACCOConfig().host_thread_count("cuda") == 3


def test_the_setting_is_the_calling_threads_alone():
    default = torch.get_num_threads()
    seen = {}

    def worker():
        set_host_threads(default + 2)
        seen["worker"] = host_threads()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["worker"] == default + 2
    assert host_threads() == default, "another thread's setting leaked into this one"
    try:
        set_host_threads(3)
        assert host_threads() == 3
        set_host_threads(None)
        assert host_threads() == torch.get_num_threads()
    finally:
        set_host_threads(None)
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="host threads"):
            set_host_threads(bad)


# -- a real one-rank engine ---------------------------------------------------------------------------------

KERNELS = {
    "adamw_cpu": {"adamw_cpu", "adamw_quantized_sum_cpu"},
    "quantize_cpu": {"quantize_cpu", "quantized_sum_squares_cpu", "dequantize_cpu"},
}


class _Spy:
    """Stands in for a compiled module: records (function, calling thread, thread count) of each kernel call."""

    def __init__(self, module, names, calls):
        self._module, self._names, self._calls = module, names, calls

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if name not in self._names:
            return fn

        def call(*args):
            self._calls.append((name, threading.get_ident(), args[-1]))
            return fn(*args)

        return call


def _engine(params):
    deepspeed = pytest.importorskip("deepspeed")
    import acco_ds  # noqa: F401  (registers "ACCO")
    from tests.ranks import toy
    from tests.ranks.inproc import ensure_single_rank_group

    ensure_single_rank_group()
    cfg = {
        "train_micro_batch_size_per_gpu": toy.MICRO_BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "ACCO", "params": params},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    model = toy.build()
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def _train(engine, steps=2):
    from tests.ranks import toy

    for step in range(steps):
        for j in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(*toy.micro_batch(0, step * 2 + j)))
            engine.step()
    engine.optimizer.finish()
    return [p.detach().clone() for p in engine.module.parameters()]


SCENARIOS = {
    "uncompressed": ({"mode": "dpu"}, {"adamw_cpu"}),
    "int8 quantized in the job": (
        {"mode": "dpu", "compression": {"commit": "int8", "fuse_round_end": False}},
        {"quantize_cpu", "quantized_sum_squares_cpu", "adamw_quantized_sum_cpu"},
    ),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_round_jobs_kernels_get_the_configured_threads_and_the_same_bits(name, monkeypatch, caplog):
    for kind in KERNELS:
        if _build.load(kind) is None:
            pytest.skip(f"the CPU extension {kind} is not built: {_build.why_missing(kind)}")
    params, expected = SCENARIOS[name]
    default = torch.get_num_threads()
    want = default + 1  # differs from the count the kernels took before the option
    calls = []
    load = _build.load
    monkeypatch.setattr(_build, "load", lambda kind: _Spy(load(kind), KERNELS.get(kind, set()), calls))
    with caplog.at_level(logging.INFO, logger="acco_ds"):
        engine = _engine({**params, "host_threads": want})
    try:
        got = _train(engine)
    finally:
        engine.optimizer.pipeline.close()
    main = threading.get_ident()
    on_worker = [(n, t) for n, ident, t in calls if ident != main]
    assert expected <= {n for n, _ in on_worker}, calls
    assert all(t == want for _, t in on_worker), (
        f"the job's kernels did not get host_threads={want}: {on_worker}"
    )
    assert all(t == default for n, ident, t in calls if ident == main), "the training thread's count changed"
    assert any(f"on {want} threads: host_threads={want}" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]

    monkeypatch.setattr(_build, "load", load)
    engine = _engine(params)  # the default, 'auto': torch.get_num_threads() on this CPU rank
    try:
        ref = _train(engine)
    finally:
        engine.optimizer.pipeline.close()
    assert all(torch.equal(a, b) for a, b in zip(got, ref)), "the thread count changed the bits"
