"""``core.emulated_stream``: the CUDA executor's streams and events emulated for CPU ranks, and ``StreamExecutor`` on
them (``ACCO_DS_EMULATED_STREAM_EXECUTOR=1``), in one process.

The emulation's contract: an event recorded on a side stream completes ``delay_s`` after its record (events on the
compute stream at once); ``stream.wait_event`` blocks the calling thread until the event completes; the current
stream is per thread. On it ``StreamExecutor.done`` is False for a while after the worker thread finished a job,
and ``wait`` returns only once the job's done event is complete. A one-rank pipeline run on it, with the summaries
read one job late, gives the bits of the run on ``ThreadExecutor``. The whole-run comparisons on two ranks, through
DeepSpeed, are tests/core/test_cuda_paths_on_cpu.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from acco_ds.core import comm
from acco_ds.core.emulated_stream import DELAY_ENV, EXECUTOR_ENV, EmulatedCuda
from tests.core import test_host_step as host
from tests.ranks.inproc import ensure_single_rank_group

SLOW = 0.5  # seconds: long enough that "not yet complete" is seen before it passes on a loaded machine


@pytest.fixture(scope="module")
def group():
    from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    ensure_single_rank_group()


def test_a_side_stream_event_completes_late_and_a_compute_stream_event_at_once():
    cuda = EmulatedCuda(SLOW)
    side = cuda.Stream(priority=comm.SIDE_STREAM_PRIORITY)
    now = cuda.Event()
    now.record(cuda.current_stream())
    assert now.query()
    late = cuda.Event()
    t0 = time.monotonic()
    late.record(side)
    assert not late.query() and not side.query()
    assert cuda.incomplete_looks == 1  # the first look at the event (the stream's query counts nothing)
    late.synchronize()
    assert time.monotonic() - t0 >= SLOW and late.query() and side.query()
    assert cuda.Event().query()  # never recorded: complete, as in CUDA


def test_a_side_stream_event_is_not_complete_at_its_first_look_however_late():
    cuda = EmulatedCuda(0.001)
    side = cuda.Stream()
    for look in ("query", "synchronize", "wait_event"):
        e = cuda.Event()
        e.record(side)
        time.sleep(0.01)  # well past its delay: a host that reached the wait late
        before = cuda.incomplete_looks
        if look == "query":
            assert not e.query()
        elif look == "synchronize":
            e.synchronize()
        else:
            cuda.current_stream().wait_event(e)
        assert cuda.incomplete_looks == before + 1, look
        assert e.query() and cuda.incomplete_looks == before + 1, look  # complete from the second look on
    now = cuda.Event()
    now.record(cuda.current_stream())
    assert now.query() and cuda.incomplete_looks == 3  # the compute stream's events complete when recorded


def test_a_stream_wait_blocks_the_calling_thread_until_the_event_completes():
    cuda = EmulatedCuda(SLOW)
    side = cuda.Stream()
    e = cuda.Event()
    t0 = time.monotonic()
    e.record(side)
    cuda.current_stream().wait_event(e)  # the compute stream waits: this thread does
    assert time.monotonic() - t0 >= SLOW and e.query()


def test_the_current_stream_is_per_thread():
    cuda = EmulatedCuda(0.0)
    side = cuda.Stream()
    seen = {}
    with cuda.stream(side):
        assert cuda.current_stream() is side
        t = threading.Thread(target=lambda: seen.setdefault("other", cuda.current_stream()))
        t.start()
        t.join()
        e = cuda.Event()
        e.record()  # on the current stream
        assert e.stream is side
    assert seen["other"] is cuda.compute and cuda.current_stream() is cuda.compute


def test_stream_executor_on_the_emulation_is_done_only_once_the_device_is():
    cuda = EmulatedCuda(SLOW)
    ex = comm.StreamExecutor(group=None, timeout_s=10.0, device=torch.device("cpu"), cuda=cuda)
    seen = {}

    def job():
        seen["stream"] = cuda.current_stream()
        seen["thread"] = threading.get_ident()
        return "result"

    try:
        ticket = ex.launch("round 0", job)
        assert ticket.ready.stream is cuda.compute and ticket.ready.query()
        assert ticket.finished.wait(10.0)  # the worker thread is through with it ...
        assert not ex.done(ticket)  # ... the device is not
        assert ex.wait(ticket) == "result"
        assert ticket.cuda_done.query() and ex.done(ticket)  # wait returned only after the done event
        assert seen == {"stream": ex.stream, "thread": ex._thread.ident}
        assert cuda.current_stream() is cuda.compute
    finally:
        ex.close()


def test_a_failed_job_and_a_restored_ticket_on_the_emulation():
    cuda = EmulatedCuda(SLOW)
    ex = comm.StreamExecutor(group=None, timeout_s=10.0, device=torch.device("cpu"), cuda=cuda)
    try:

        def failing():
            raise RuntimeError("enqueue failed")

        bad = ex.launch("round 1", failing)
        with pytest.raises(RuntimeError, match="round 1"):
            ex.wait(bad)
        assert ex.done(bad) and bad.cuda_done is None  # no done event: the failure is what waits see
        restored = comm.Ticket("round 2 (restored)")  # as core.snapshot restores a finished job on CPU
        restored.result = "kept"
        restored.finished.set()
        assert ex.done(restored) and ex.wait(restored) == "kept"
    finally:
        ex.close()


def test_make_executor_takes_the_emulation_from_the_environment(group, monkeypatch):
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    ex = comm.make_executor(torch.device("cpu"), 10.0)
    try:
        assert type(ex) is comm.ThreadExecutor
    finally:
        ex.close()
    monkeypatch.setenv(EXECUTOR_ENV, "1")
    monkeypatch.setenv(DELAY_ENV, "0.02")
    ex = comm.make_executor(torch.device("cpu"), 10.0)
    try:
        assert type(ex) is comm.StreamExecutor and isinstance(ex.cuda, EmulatedCuda)
        assert ex.cuda.delay_s == 0.02 and ex.stream.delay_s == 0.02
    finally:
        ex.close()
    monkeypatch.setenv(DELAY_ENV, "-1")
    with pytest.raises(ValueError, match=DELAY_ENV):
        comm.make_executor(torch.device("cpu"), 10.0)


def run_pipeline(monkeypatch, cuda_paths: bool, mode: str, dtype: str, exchange: str, **kw) -> dict:
    """tests/core/test_host_step.py's one-rank run (two groups, 10 micro-batches), with the emulated stream
    executor and the summaries read one job late when ``cuda_paths``."""
    if cuda_paths:
        monkeypatch.setenv(EXECUTOR_ENV, "1")
    else:
        monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    model, pipe = host.build(mode, dtype, exchange, None, **kw)
    monkeypatch.delenv(EXECUTOR_ENV, raising=False)
    pipe.defer_host_reads = cuda_paths
    try:
        norms = host.train(model, pipe)
        state = [(b.master.clone(), b.exp_avg.clone(), b.exp_avg_sq.clone()) for b in pipe.groups]
        params = [p.detach().clone() for p in model.parameters()]
        waits = getattr(getattr(pipe.executor, "cuda", None), "incomplete_looks", None)
        return dict(
            norms=norms, state=state, params=params, stats=pipe.stats, executor=pipe.executor, waits=waits
        )
    finally:
        pipe.close()


RUNS = {
    **{f"{m}_fp16": (m, "fp16", "none", {}) for m in ("sync", "dpu", "acco")},
    **{f"{m}_bf16_int8": (m, "bf16", "int8", {}) for m in ("sync", "dpu", "acco")},
    # capped at their share (acco 1, dpu 2 of GAS 2): the same rounds whatever the timing
    "acco_adaptive": ("acco", "bf16", "none", {"accumulation": "adaptive", "max_micro_batches_per_round": 1}),
    "dpu_adaptive": ("dpu", "bf16", "none", {"accumulation": "adaptive", "max_micro_batches_per_round": 2}),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_pipeline_on_the_emulated_streams_gives_the_bits_of_the_thread_executor(group, monkeypatch, name):
    mode, dtype, exchange, kw = RUNS[name]
    monkeypatch.setenv(DELAY_ENV, "0.005")
    plain = run_pipeline(monkeypatch, False, mode, dtype, exchange, **kw)
    emulated = run_pipeline(monkeypatch, True, mode, dtype, exchange, **kw)
    assert type(plain["executor"]) is comm.ThreadExecutor
    assert type(emulated["executor"]) is comm.StreamExecutor and emulated["waits"] > 0
    host.assert_same_bits(plain, emulated)
