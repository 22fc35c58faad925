"""``core.commit_inputs``: a commit's AdamW inputs captured as the job's step reads them, and a held copy stepped with
them. The stepped copy must have the bits of the rank's own step (``ops.adamw.adamw_step`` on the same state) for
every group, gradient dtype, skip flag and odd size, or a peer's copy would resume another state; and the digest
must tell apart states that differ in one element's last bit."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from acco_ds.core import commit_inputs
from acco_ds.core.commit_inputs import SCALARS, CommitInputs, InputsLayout, state_digest, step_copy
from acco_ds.ops.adamw import adamw_step, hyper_tensor
from acco_ds.ops.adamw_difference import adamw_step_difference

NUMELS = (37, 5, 1024 + 3)


def _groups(dtypes):
    return [
        SimpleNamespace(layout=SimpleNamespace(shard_numel=n), grad_bufs=[torch.zeros(1, dtype=dt)])
        for n, dt in zip(NUMELS, dtypes)
    ]


def _step_tensors(i, n, dtype, noop, gen):
    grad = (torch.randn(n, generator=gen) * 3).to(dtype)
    return dict(
        grad=grad,
        hyper_tensor=hyper_tensor(1e-2 * (i + 1), 0.9, 0.95 + 0.01 * i, 1e-8, 0.1 * i, step=3 + i),
        scale_tensor=torch.tensor([0.37 + i], dtype=torch.float32),
        noop_flag=torch.tensor([noop], dtype=torch.int32),
    )


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.bfloat16, torch.float32, torch.float16)])
@pytest.mark.parametrize("noop", [0, 1])
@pytest.mark.parametrize("emulate_async", [False, True])
def test_a_copy_stepped_with_the_inputs_has_the_bits_of_the_ranks_own_step(dtypes, noop, emulate_async):
    """``emulate_async``: the CPU test mode of the non-blocking captures (data in the slot only once the job's thread
    says its stream work is done), each holding its source's value at the take, however the source changes later."""
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(3 * sum(NUMELS), generator=gen)
    state[1 :: 3 * 7].abs_()  # some positive second moments anywhere is enough: the layout is what is checked
    views = state.split([n for n in NUMELS for _ in range(3)])
    for k in range(2, len(views), 3):
        views[k].abs_()
    own, copy = state.clone(), state.clone()
    own_views = own.split([n for n in NUMELS for _ in range(3)])
    inputs = CommitInputs(_groups(dtypes), torch.device("cpu"), emulate_async=emulate_async)
    capture = inputs.capture(7)
    fn = partial(adamw_step, commit=True)
    for i, (n, dt) in enumerate(zip(NUMELS, dtypes)):
        tensors = _step_tensors(i, n, dt, noop, gen)
        capture.take(i, fn, tensors)
        fn(*own_views[3 * i : 3 * i + 3], **tensors)
        for t in tensors.values():  # the job's later use of its buffers
            t.add_(1)
    assert inputs.has(7) and not inputs.has(5) and not inputs.has(9)
    assert bool(inputs.flat(7).any()) != emulate_async  # landed late: nothing in the slot yet
    inputs.synchronized()
    assert inputs.landed == (4 * len(NUMELS) if emulate_async else 0)
    step_copy(copy, inputs.flat(7), inputs.layout)
    assert torch.equal(copy.view(torch.int32), own.view(torch.int32))
    assert state_digest(copy) == state_digest(own)
    assert noop or not torch.equal(copy, state)


def test_the_layout_aligns_every_gradient_and_holds_the_scalars_last():
    layout = InputsLayout.of([3, 5, 2], [torch.bfloat16, torch.float32, torch.float16])
    assert layout.offsets == (0, 16, 48) and layout.scalars_at == 64
    assert layout.nbytes == 64 + 4 * SCALARS * 3
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    assert [g.dtype for g in layout.grads(flat)] == [torch.bfloat16, torch.float32, torch.float16]
    assert [g.numel() for g in layout.grads(flat)] == [3, 5, 2]
    assert layout.scalars(flat).shape == (3, SCALARS)


def test_a_step_that_is_not_the_plain_adamw_leaves_the_commit_without_inputs():
    gen = torch.Generator().manual_seed(1)
    inputs = CommitInputs(_groups((torch.float32,) * 3), torch.device("cpu"))
    plain = partial(adamw_step, commit=True)
    capture = inputs.capture(4)
    capture.take(0, plain, _step_tensors(0, NUMELS[0], torch.float32, 0, gen))
    capture.take(1, partial(adamw_step_difference, block_size=32, bits=8, commit=True), {})
    capture.take(2, plain, _step_tensors(2, NUMELS[2], torch.float32, 0, gen))
    assert not inputs.has(4)
    capture = inputs.capture(6)  # the slot of commit 4, rewritten: its previous inputs are gone
    capture.none()
    assert not inputs.has(6) and not inputs.has(4)
    with pytest.raises(KeyError, match="commit 6"):
        inputs.flat(6)


def test_a_slot_is_complete_only_once_every_group_was_taken():
    gen = torch.Generator().manual_seed(2)
    inputs = CommitInputs(_groups((torch.float32,) * 3), torch.device("cpu"))
    capture = inputs.capture(3)
    for i in range(2):
        capture.take(i, partial(adamw_step, commit=True), _step_tensors(i, NUMELS[i], torch.float32, 0, gen))
    assert not inputs.has(3)


@pytest.mark.parametrize("numel", [1000, 1001, 1, 2])
def test_the_digest_sees_one_bit(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    for at in {0, numel // 2, numel - 1}:  # the odd tail element included
        y = x.clone()
        y.view(torch.int32)[at] ^= 1
        assert state_digest(x) != state_digest(y), at
    assert state_digest(torch.empty(0)) == 0
    assert commit_inputs.state_digest(x.clone()) == state_digest(x)


def test_the_digest_is_the_sum_of_the_words_modulo_2_64():
    # words of all ones wrap: the definition, computed with Python's integers
    x = torch.full((7,), -1, dtype=torch.int32).view(torch.float32)
    words = [0xFFFFFFFFFFFFFFFF] * 3 + [0xFFFFFFFF]
    want = sum(words) % 2**64
    assert state_digest(x) == (want - 2**64 if want >= 2**63 else want)
    z = torch.randn(513, generator=torch.Generator().manual_seed(5))
    raw = z.numpy().tobytes()
    total = sum(int.from_bytes(raw[i : i + 8], "little") for i in range(0, 512 * 4, 8)) + int.from_bytes(
        raw[-4:], "little"
    )
    total %= 2**64
    assert state_digest(z) == (total - 2**64 if total >= 2**63 else total)
