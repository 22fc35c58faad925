"""Flat buffers and the shard layout of one parameter group.

Layout: the group's trainable parameters, in order, are packed into one flat vector of ``numel``
elements, padded with zeros to ``padded_numel``, a multiple of ``world_size * ALIGN`` so that
every rank's shard has the same size and starts on a 64-byte boundary (ALIGN fp32 elements).
Rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``. This is DeepSpeed ZeRO-1's layout
(contiguous slices of one flat vector, rank order), which is what ``zero_to_fp32`` reassembles.

Buffer ownership (who may read/write a buffer during a round):
- ``params[i]`` (param dtype, padded_numel): two full copies of the parameters. The model's
  ``Parameter.data`` are views into ``params[model_slot]``; the compute side owns it for the
  round. The comm side writes (all-gathers) the other one. At a round end the roles swap.
- ``grads[i]`` (comm dtype, padded_numel): two gradient buffers. The compute side accumulates the
  round's micro-batch gradients into ``grads[acc_slot]``; the comm side reduce-scatters the other.
- shard buffers (fp32 master, exp_avg, exp_avg_sq, the kept g~ sum, scratch): comm side only,
  except while the pipeline is drained (checkpoints, accessors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

ALIGN = 16  # elements; 64 B of fp32, 32 B of bf16: keeps every shard start vector-aligned


@dataclass(frozen=True)
class GroupLayout:
    """Where each parameter of a group lives in the flat vector, and which slice rank r owns."""

    offsets: tuple
    numels: tuple
    shapes: tuple
    numel: int
    padded_numel: int
    world_size: int

    @classmethod
    def build(cls, params: Sequence[torch.Tensor], world_size: int) -> GroupLayout:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        offsets, numels, shapes, off = [], [], [], 0
        for p in params:
            offsets.append(off)
            numels.append(p.numel())
            shapes.append(tuple(p.shape))
            off += p.numel()
        unit = world_size * ALIGN
        padded = max(unit, -(-off // unit) * unit)
        return cls(tuple(offsets), tuple(numels), tuple(shapes), off, padded, world_size)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> range:
        return range(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def real_shard_range(self, rank: int) -> range:
        """The part of rank's shard that holds parameters (padding excluded); may be empty."""
        r = self.shard_range(rank)
        return range(r.start, max(r.start, min(r.stop, self.numel)))


class GroupBuffers:
    """The flat buffers of one parameter group on one rank (see the module docstring for ownership)."""

    def __init__(
        self,
        params: List[torch.nn.Parameter],
        layout: GroupLayout,
        rank: int,
        comm_dtype: torch.dtype,
        keep_tilde: bool,
    ):
        self.params = params
        self.layout = layout
        self.rank = rank
        dev = params[0].device
        pdtype = params[0].dtype
        for p in params:
            if p.dtype != pdtype or p.device != dev:
                raise TypeError(
                    f"all trainable parameters of a group must share dtype and device; saw {p.dtype} on "
                    f"{p.device} and {pdtype} on {dev}. Cast the model (e.g. model.to(torch.bfloat16)) first."
                )
        n, s = layout.padded_numel, layout.shard_numel
        self.param_dtype = pdtype
        self.comm_dtype = comm_dtype
        self.params_flat = [torch.zeros(n, dtype=pdtype, device=dev) for _ in range(2)]
        self.grads_flat = [torch.zeros(n, dtype=comm_dtype, device=dev) for _ in range(2)]
        for p, off, numel in zip(params, layout.offsets, layout.numels):
            self.params_flat[0][off : off + numel].copy_(p.detach().reshape(-1))
        self.params_flat[1].copy_(self.params_flat[0])
        shard = self.params_flat[0][layout.shard_range(rank).start : layout.shard_range(rank).stop]
        self.master = shard.float().clone()
        self.exp_avg = torch.zeros(s, dtype=torch.float32, device=dev)
        self.exp_avg_sq = torch.zeros(s, dtype=torch.float32, device=dev)
        self.grad_shard = torch.zeros(s, dtype=torch.float32, device=dev)
        self.reduce_out = (
            self.grad_shard if comm_dtype == torch.float32 else torch.zeros(s, dtype=comm_dtype, device=dev)
        )
        self.tilde_shard = torch.zeros(s, dtype=torch.float32, device=dev) if keep_tilde else None
        self.out_shard = torch.zeros(s, dtype=pdtype, device=dev)
        self.point_params_at(0)

    def point_params_at(self, slot: int) -> None:
        """Make every model parameter a view into ``params_flat[slot]`` (no copy)."""
        flat = self.params_flat[slot]
        for p, off, numel, shape in zip(
            self.params, self.layout.offsets, self.layout.numels, self.layout.shapes
        ):
            p.data = flat[off : off + numel].view(shape)

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        r = self.layout.shard_range(self.rank)
        return flat[r.start : r.stop]

    def state_numel(self) -> int:
        """Elements of sharded optimizer state held by this rank (master + exp_avg + exp_avg_sq)."""
        return self.master.numel() + self.exp_avg.numel() + self.exp_avg_sq.numel()
