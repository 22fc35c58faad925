"""GroupBuffers' parameter and gradient views (acco_ds/core/buffers.py): made once per full buffer, following the
roles as they rotate, and a replaced ``.grad`` is refused."""

from __future__ import annotations

import pytest
import torch

from acco_ds.core.buffers import GradReplacedError, GroupBuffers, GroupLayout

SHAPES = [(3, 5), (7,), (2, 2, 3), (1,)]


def group(world: int = 2, overlapped: bool = True):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    values = [p.detach().clone() for p in params]
    layout = GroupLayout.build(params, world)
    return GroupBuffers(params, layout, 0, torch.float32, False, overlapped), params, values


def views_into(flat: torch.Tensor, tensors, layout) -> bool:
    base = flat.data_ptr()
    return all(
        t.data_ptr() == base + off * flat.element_size() and t.shape == torch.Size(s)
        for t, off, s in zip(tensors, layout.offsets, layout.shapes)
    )


def test_params_and_grads_view_their_buffers_through_the_roles():
    b, params, values = group()
    assert views_into(b.model_flat, params, b.layout)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert views_into(b.acc_flat, [p.grad for p in params], b.layout)
    first_grads = [p.grad for p in params]
    b.point_grads()
    assert all(p.grad is g for p, g in zip(params, first_grads)), (
        "point_grads made new views of the same buffer"
    )
    for _ in range(4):  # rotate the roles as rounds do: every buffer in turn is ACC, then JOB, then MODEL
        b.start_job(in_place=False)
        b.finish_job()
        b.point_params()
        b.new_acc()
        b.point_grads()
        assert views_into(b.model_flat, params, b.layout)
        assert views_into(b.acc_flat, [p.grad for p in params], b.layout)
        assert b.acc_flat.data_ptr() != b.model_flat.data_ptr()


def test_another_flat_gets_views_of_its_own():
    b, params, _ = group()
    other = torch.arange(b.layout.padded_numel, dtype=torch.float32)
    b.point_params(other)
    assert views_into(other, params, b.layout)
    assert torch.equal(params[1], other[b.layout.offsets[1] : b.layout.offsets[1] + 7])
    b.point_params()
    assert views_into(b.model_flat, params, b.layout)


def test_a_replaced_grad_is_refused():
    b, params, _ = group()
    b.check_grads()
    params[2].grad = None  # a parameter without a gradient this micro-batch: allowed
    b.check_grads()
    b.point_grads()
    params[0].grad = params[0].grad.clone()
    with pytest.raises(GradReplacedError, match=r"shape \(3, 5\)"):
        b.check_grads()
    b.point_grads()
    b.check_grads()
