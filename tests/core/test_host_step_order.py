"""Optimizer offload's round job (``core.round_job`` with ``core.host_step``) on one CPU rank, the staged path a GPU
rank runs: the order of the job's operations per parameter group, the staging buffers allocated at set-up, and the
bounded waits for the copies.

Order: every group's inputs are copied to the host right after the norm, before the first all-gather is issued, and
group i+1's host step runs before group i's all-gather is waited for (on CUDA it runs on the side stream meanwhile;
on gloo its transfers stay in flight). Staging: the buffers of every job exist right after the pipeline is built,
with the exact sizes ``round_job.host_staging`` lists, counted by ``held_bytes()``; no job allocates one, and every
one is used. Waits: a copy slower than the timeout raises a RuntimeError naming the rank, the group and the wait."""

from __future__ import annotations

import pytest
import torch

from acco_ds.core import host_step as host_step_module
from acco_ds.core import round_job
from acco_ds.core.host_step import (
    BACK_PHASE,
    COPY_DELAY_ENV,
    INPUTS_PHASE,
    PAGE,
    HostMemory,
    HostStep,
    OffloadSpec,
    StreamCopies,
    ThreadCopies,
)
from tests.core.test_host_step import EXCHANGES, build, train
from tests.ranks.inproc import ensure_single_rank_group


@pytest.fixture(scope="module", autouse=True)
def group():
    from acco_ds.deepspeed.cpu_fp16 import allow_fp16_on_cpu

    allow_fp16_on_cpu()
    ensure_single_rank_group()


def _group_of(tensor, candidates) -> int | None:
    for g, tensors in enumerate(candidates):
        if any(tensor.data_ptr() == t.data_ptr() for t in tensors):
            return g
    return None


class RecordingCopies(ThreadCopies):
    """The copy thread, recording each copy as it is issued: ``("to_host", g)`` into group g's staging buffers,
    ``("to_device", g)`` out of them."""

    def __init__(self, log, host):
        super().__init__()
        self.log, self.host = log, host

    def copy(self, dst, src):
        staging = [list(s.values()) for s in self.host._staging]
        if (g := _group_of(dst, staging)) is not None:
            self.log.append(("to_host", g))
        elif (g := _group_of(src, staging)) is not None:
            self.log.append(("to_device", g))
        super().copy(dst, src)


def record_the_job(monkeypatch, pipe):
    """Spies on the step functions the job calls (``("step", g)``) and on its all-gathers (``("gather", g)`` when
    issued, ``("gathered", g)`` when done: at its return, or where it returns a pending gather it was not told to
    wait for, at that gather's wait)."""
    log = []
    masters = [[b.master] for b in pipe.groups]
    targets = [list(b.param_bufs) for b in pipe.groups]
    pipe.host_step.copies.close()
    pipe.host_step.copies = RecordingCopies(log, pipe.host_step)

    def stepping(fn):
        def spy(*args, **kw):
            log.append(("step", _group_of(args[0], masters)))
            return fn(*args, **kw)

        return spy

    for name in ("adamw_step", "adamw_step_difference", "adamw_step_quantized_sum"):
        monkeypatch.setattr(round_job, name, stepping(getattr(round_job, name)))

    def gathering(fn):
        def spy(full, *args, **kw):
            g = _group_of(full, targets)
            log.append(("gather", g))
            pending = fn(full, *args, **kw)
            # done at its return: the form that returns nothing, or an all-gather told to wait (its contract; at
            # W = 1 there is nothing to wait for, so the spy goes by the contract)
            if pending is None or kw.get("wait", args[2] if len(args) > 2 else True):
                log.append(("gathered", g))
                return pending
            wait = pending.wait

            def waited():
                wait()
                log.append(("gathered", g))

            pending.wait = waited
            return pending

        return spy

    monkeypatch.setattr(round_job, "all_gather_inplace", gathering(round_job.all_gather_inplace))
    monkeypatch.setattr(
        round_job, "exchange_quantized_difference", gathering(round_job.exchange_quantized_difference)
    )
    return log


def jobs_in(log, groups: int) -> list:
    """The log cut into jobs: each ends with the last group's all-gather done."""
    jobs, job = [], []
    for event in log:
        job.append(event)
        if event == ("gathered", groups - 1):
            jobs.append(job)
            job = []
    assert not job, job
    return jobs


@pytest.mark.parametrize("exchange", ["none", "int4-gather"])
@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_the_next_groups_inputs_are_staged_and_stepped_before_a_groups_all_gather_is_waited(
    monkeypatch, mode, exchange
):
    """With two groups: group 1's copies to the host are issued before group 0's all-gather, and (uncompressed
    all-gather) group 1's host step runs before group 0's all-gather is waited for. The job that ran the groups one
    after another (copies, step, copy back, all-gather, then the next group) fails both."""
    model, pipe = build(mode, "bf16", exchange, OffloadSpec(staged=True))
    try:
        log = record_the_job(monkeypatch, pipe)
        train(model, pipe, micro_batches=6)
    finally:
        pipe.close()
    jobs = jobs_in(log, len(pipe.groups))
    assert len(jobs) >= 3
    for job in jobs:
        for g in range(len(pipe.groups)):  # each group: its inputs, its step, its copy back, its all-gather
            first = {e: job.index(e) for e in reversed(job)}
            assert first[("to_host", g)] < first[("step", g)] < first[("to_device", g)] < first[("gather", g)]
        last_to_host_1 = max(i for i, e in enumerate(job) if e == ("to_host", 1))
        assert last_to_host_1 < job.index(("gather", 0)), job
        if exchange == "none":
            assert job.index(("step", 1)) < job.index(("gathered", 0)), job
            assert job.index(("gathered", 0)) < job.index(("gather", 1)), (
                job
            )  # one all-gather in flight at a time


class Allocations:
    """A spy on ``host_step.allocate_staging``: the bytes of every block allocated."""

    def __init__(self, monkeypatch):
        self.blocks = []
        real = host_step_module.allocate_staging

        def spy(nbytes, pin):
            self.blocks.append(nbytes)
            return real(nbytes, pin)

        monkeypatch.setattr(host_step_module, "allocate_staging", spy)


@pytest.mark.parametrize("exchange", list(EXCHANGES))
@pytest.mark.parametrize("dtype,comm_dtype", [("bf16", "auto"), ("fp16", "auto"), ("bf16", "fp32")])
@pytest.mark.parametrize("mode", ["sync", "dpu", "acco"])
def test_the_staging_is_allocated_at_set_up_with_exact_sizes_and_no_job_allocates(
    monkeypatch, mode, dtype, comm_dtype, exchange
):
    from acco_ds.plan import memory_model

    allocations = Allocations(monkeypatch)
    used = set()
    real_buffer = HostStep._buffer

    def buffer(self, group, name, like):
        used.add((group, (name, tuple(like.shape), like.dtype)))
        return real_buffer(self, group, name, like)

    monkeypatch.setattr(HostStep, "_buffer", buffer)
    model, pipe = build(mode, dtype, exchange, OffloadSpec(staged=True), comm_dtype=comm_dtype)
    try:
        host = pipe.host_step
        want = round_job.host_staging(pipe.groups, pipe.compression, 1, False)
        assert allocations.blocks == [host.allocated_bytes()]  # one block, at set-up
        assert all(m.registered is None for m in host._memory)  # a CPU rank stages in plain memory
        reserved = set()
        for g, b in enumerate(pipe.groups):
            assert host.staging_keys(g) == want[g]
            for key, buf in host._staging[g].items():
                name, shape, dt = key
                assert tuple(buf.shape) == shape and buf.dtype == dt and buf.is_contiguous()
                assert buf.data_ptr() % host_step_module.STAGING_ALIGN == 0
                reserved.add((g, key))
            exact = sum(buf.numel() * buf.element_size() for buf in host._staging[g].values())
            assert host.staging_bytes(g) == exact == b.held_bytes()["host_staging"] > 0
        assert (
            sum(
                -(-n // 64) * 64
                for n in (t.numel() * t.element_size() for s in host._staging for t in s.values())
            )
            == host.allocated_bytes()
        )
        if exchange == "none":  # the analytic bytes of a GPU rank's group
            for b in pipe.groups:
                D, C = b.param_dtype.itemsize, b.comm_dtype.itemsize
                away = memory_model.acco_held_bytes(mode, D, C, 1, b.layout.padded_numel, offloaded=True)
                assert away["host_staging"] == b.held_bytes()["host_staging"]
        before = [{k: t.data_ptr() for k, t in s.items()} for s in host._staging]
        train(model, pipe, micro_batches=8)
        assert allocations.blocks == [host.allocated_bytes()]  # none inside a job
        assert [{k: t.data_ptr() for k, t in s.items()} for s in host._staging] == before
        assert used == reserved  # every buffer allocated at set-up is one a job used
    finally:
        pipe.close()


def test_a_pipeline_without_offload_holds_no_staging():
    _, pipe = build("acco", "bf16", "none", None)
    try:
        assert pipe.host_step is None
        assert all("host_staging" not in b.held_bytes() for b in pipe.groups)
    finally:
        pipe.close()


def test_the_pipelines_host_step_waits_at_most_comm_timeout_s():
    _, pipe = build("acco", "bf16", "none", OffloadSpec(staged=True), comm_timeout_s=123.0)
    try:
        assert pipe.host_step.timeout_s == 123.0 and pipe.host_step.rank == 0
    finally:
        pipe.close()


def _step(master, exp_avg, exp_avg_sq, *, out, grad):
    out.copy_(grad * 2)


def test_a_copy_to_the_host_slower_than_the_timeout_raises_naming_the_rank_group_and_wait(monkeypatch):
    monkeypatch.setenv(COPY_DELAY_ENV, "0.5")
    host = HostStep(2, torch.device("cpu"), OffloadSpec(staged=True), timeout_s=0.05, rank=3)
    state = (torch.zeros(8), torch.zeros(8), torch.zeros(8))
    try:
        assert host.copies.delay_s == 0.5
        with pytest.raises(
            RuntimeError, match=f"rank 3, parameter group 1: .*{INPUTS_PHASE}.*comm_timeout_s=0.05"
        ):
            host.run(1, _step, state, {"grad": torch.ones(8)}, torch.zeros(8))
    finally:
        host.close()


def test_a_copy_back_slower_than_the_timeout_raises_naming_that_wait():
    copies = ThreadCopies(delay_s=0.0)
    host = HostStep(1, torch.device("cpu"), OffloadSpec(staged=True), copies=copies, timeout_s=0.1, rank=1)
    grad, out = torch.arange(8.0), torch.zeros(8)
    try:
        staged = host.stage(0, {"grad": grad}, out)
        assert copies.wait_host(staged.ready, 10.0)  # the inputs are on the host; the copy back will be late
        copies.delay_s = 0.5
        with pytest.raises(RuntimeError, match=f"rank 1, parameter group 0: .*{BACK_PHASE}"):
            host.step(staged, _step, (torch.zeros(8),) * 3)
    finally:
        host.close()


def test_with_time_to_spare_the_same_late_copies_arrive():
    copies = ThreadCopies(delay_s=0.05)
    host = HostStep(1, torch.device("cpu"), OffloadSpec(staged=True), copies=copies, timeout_s=5.0)
    grad, out = torch.arange(8.0), torch.zeros(8)
    try:
        host.run(0, _step, (torch.zeros(8),) * 3, {"grad": grad}, out)
    finally:
        host.close()
    assert torch.equal(out, grad * 2)


class Marker:
    """A CUDA event that completes at its ``done_after``-th query (None: never)."""

    def __init__(self, done_after):
        self.done_after, self.queries, self.synchronized = done_after, 0, False

    def query(self):
        self.queries += 1
        return self.done_after is not None and self.queries >= self.done_after

    def synchronize(self):
        self.synchronized = True


def test_the_cuda_wait_polls_its_event_until_done_or_the_deadline():
    copies = StreamCopies(torch.device("cuda", 0))
    done = Marker(5)
    assert copies.wait_host(done, 10.0) and done.queries == 5 and not done.synchronized
    never = Marker(None)
    assert not copies.wait_host(never, 0.05) and never.queries > 1
    unbounded = Marker(None)
    assert copies.wait_host(unbounded, None) and unbounded.synchronized
    assert copies.wait_device(0.0)  # the stream orders the copies back before the all-gather


class FakeCudart:
    def __init__(self, error=0):
        self.error, self.registered, self.unregistered = error, [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        self.registered.append((ptr, size, flags))
        return self.error

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_pinned_staging_registers_whole_pages_of_its_own_allocation_with_the_exact_bytes(monkeypatch):
    """CUDA's pinned staging: plain host memory registered with the driver (cudaHostRegister), not the caching host
    allocator's power-of-two blocks; the registered pages lie inside the block's own allocation."""
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    memory = HostMemory(10_000, pin=True)
    ((ptr, size, _),) = rt.registered
    raw = memory._raw
    assert ptr % PAGE == 0 and size % PAGE == 0 and size >= 10_000
    assert raw.data_ptr() <= ptr and ptr + size <= raw.data_ptr() + raw.numel()
    assert memory.data.numel() == 10_000 and memory.data.data_ptr() == ptr
    assert memory.allocated == 10_000 + 2 * PAGE
    memory.release()
    memory.release()
    assert rt.unregistered == [ptr]
    rt.error = 2
    with pytest.raises(RuntimeError, match="pin_memory=false"):
        HostMemory(100, pin=True)
