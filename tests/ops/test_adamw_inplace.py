"""Fused AdamW in place: ``out`` may be ``grad`` itself (ACCO's job writes the new parameters over this
rank's reduced gradient slice). Every backend gives exactly the bits of the same step with separate
buffers, for commit and peek, fp32, bf16 and fp16, odd sizes, noop and scale flags; any other overlap is
still rejected."""

from __future__ import annotations

import pytest
import torch

from acco_ds.ops.adamw import adamw_step, adamw_step_cuda_body_on_cpu, adamw_step_ref
from tests.ops.test_adamw import gen, rand_state, require_cpu_ext

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def cuda_body(*args, **kw):
    adamw_step_cuda_body_on_cpu(*args, grid_dim=3, **kw)


BACKENDS = {"auto": adamw_step, "ref": adamw_step_ref, "cuda_body": cuda_body}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("n", [1, 7, 4099, 278011])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("commit", [True, False])
@pytest.mark.parametrize("noop", [0, 1])
def test_in_place_equals_separate_buffers(backend, n, dtype, commit, noop):
    if backend != "ref":
        require_cpu_ext()
    fn = BACKENDS[backend]
    g = gen("inplace", n, dtype, commit, noop)
    master, m, v = rand_state(n, g)
    grad = (torch.randn(n, generator=g) * 3).to(dtype)
    scale = torch.tensor([0.37])
    flag = torch.tensor([noop], dtype=torch.int32)

    sep_state = [t.clone() for t in (master, m, v)]
    sep_out = torch.full((n,), float("nan"), dtype=dtype)
    fn(*sep_state, grad.clone(), sep_out, step=5, commit=commit, scale_tensor=scale, noop_flag=flag, **HP)

    in_state = [t.clone() for t in (master, m, v)]
    buf = grad.clone()
    fn(*in_state, buf, buf, step=5, commit=commit, scale_tensor=scale, noop_flag=flag, **HP)

    raw = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(buf.view(raw), sep_out.view(raw))
    for a, b in zip(in_state, sep_state):
        assert torch.equal(a, b)
    if not commit or noop:  # the state was not written
        for a, b in zip(in_state, (master, m, v)):
            assert torch.equal(a, b)


def test_partial_overlap_still_rejected():
    n = 64
    master, m, v = rand_state(n, gen("overlap"))
    buf = torch.randn(n + 8)
    with pytest.raises(ValueError, match="grad and out overlap"):
        adamw_step(master, m, v, buf[:n], buf[8:], step=1, **HP)
    g = torch.randn(n)
    with pytest.raises(ValueError, match="grad and out overlap"):  # same start, another dtype: not in place
        adamw_step(master, m, v, g, g.view(torch.bfloat16)[:n], step=1, **HP)
