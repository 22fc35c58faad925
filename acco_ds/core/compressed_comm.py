"""The compressed exchanges of a round (docs/ALGORITHM.md, "Compressed rounds"): the gradient
reduce-scatter and the parameter all-gather, and the byte counts of a round's collectives.

:func:`exchange_quantized_gradients` replaces the reduce-scatter of ``round_job`` when the round's
gradients are compressed: each rank quantizes its WHOLE flat gradient buffer (``acco_ds.ops.quantize``,
blockwise int8 with one fp32 scale per block; the blocks are cut inside each rank's shard-sized chunk, the last
block of a chunk short), adding its error-feedback residual first and keeping what quantization lost in it; it
sends chunk r's int8 values and scales to rank r (no backend sums int8: on gloo point-to-point, one peer at a
time, as the uncompressed gloo path; on NCCL one ``all_to_all_single`` of the values and one of the scales) and
returns the W chunks of its own shard, unsummed (:class:`QuantizedShard`). The owner's sum of them (fp32, in the
order own, me-1, me-2, ... mod W on every backend, stored in the buffer's dtype) is never written: the norm and
the AdamW step read the chunks themselves (``acco_ds.ops.quantized_sum_step``); from there the round goes on
exactly as an uncompressed one (average, norm, clipping, AdamW, all-gather).
:func:`compressed_reduce_scatter_inplace` stores the sum in the buffer's own slice instead, where reading the
chunks twice would move more bytes than storing the sum once (``round_job.UNSTORED_SUM_MAX_WORLD``) and where the
norm needs it in memory (tensor parallelism's norm ranges).

Threads, streams and ownership: called on the communication side (CPU: the executor's worker thread, gloo;
CUDA: the executor's side stream, NCCL, everything queued on it) with the job's gradient buffer and the
pipeline's residual of that group (full size, the buffer's dtype), which only jobs touch while training runs
(the compute side reads and writes it only when drained: snapshot, restart). The quantizer is
``acco_ds.ops.quantize``: on CPU its C++ kernel where built, on CUDA its Triton kernels, else the torch
reference (the same bits).

:func:`exchange_quantized_difference` replaces the parameter all-gather when ``all_gather`` is compressed:
rather than its new parameters, each rank sends the int8 blocks of their difference to what every replica
already holds (the MODEL buffer at the job's launch, identical on every rank), and every rank, the owner
included, writes ``base + dequantized difference`` into each slice (the owner's own slice in its AdamW pass,
``acco_ds.ops.adamw_difference``; the peers' slices by ``add_dequantized``; no fp32 temporary): the replicas stay
bitwise identical and
what quantization withheld is part of the next round's difference (the fp32 master is exact; the replicas
trail it by at most half a quantization step per element). gloo: point-to-point to every peer; NCCL: one
all-gather (``acco_ds.core.comm.all_gather_single``) of the values and one of the scales.

:class:`Traffic` counts the bytes a rank hands to (``sent``) and takes from (``received``) the network
in one job, counted at each send/receive call (point-to-point: the tensor's bytes; NCCL's collectives:
what the call moves per rank, (W-1)/W of the buffer each way; an all-to-all or all-gather of W chunks: the
W-1 chunks of the peers each way). The scalar all-reduce of the norm and the
adaptive counts' all-gather (8 bytes per rank) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from acco_ds.core.comm import all_gather_single
from acco_ds.ops.quantize import (
    add_dequantized,
    dequantize_sum,
    num_blocks,
    pack_int4,
    quantize,
    quantize_with_residual,
    unpack_int4,
)


@dataclass
class Traffic:
    """Bytes this rank sent and received in one job (see the module docstring)."""

    sent: int = 0
    received: int = 0

    def send(self, t: torch.Tensor, group, dst: int):
        self.sent += t.numel() * t.element_size()
        return dist.isend(t, group=group, group_dst=dst)

    def recv(self, t: torch.Tensor, group, src: int):
        self.received += t.numel() * t.element_size()
        return dist.irecv(t, group=group, group_src=src)

    def collective(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received


def point_to_point(group) -> bool:
    """How the compressed exchanges move the quantized chunks over ``group``: point-to-point, one peer at a
    time (True: gloo, whose collectives would move twice the bytes), else as collectives (NCCL: one
    all-to-all or all-gather of the values and one of the scales). Both give the same bits: the owner sums the
    same chunks in the same order."""
    return dist.get_backend(group) == "gloo"


@dataclass(frozen=True)
class Compression:
    """What a round compresses: its gradient exchange (``gradients``: blocks of ``block_size`` elements in
    ``gradient_bits``, with the pipeline's residuals when ``error_feedback``) and/or its parameter all-gather
    (``parameters``: the differences to the replicas' parameters in ``parameter_bits``)."""

    block_size: int
    error_feedback: bool
    gradients: bool = True
    parameters: bool = False
    gradient_bits: int = 8  # 8 (int8) or 4 (two values per byte on the wire)
    parameter_bits: int = 8


@dataclass(frozen=True)
class QuantizedShard:
    """The W ranks' quantized chunks of this rank's shard, as the owner sums them: ``q`` int8 ``[W, shard]`` and
    ``scales`` fp32 ``[W, blocks]`` (row r: rank r's chunk, this rank's own row included), summed in ``order``
    (own, me-1, me-2, ... mod W). New tensors of the job: the communication side owns them until it drops them."""

    q: torch.Tensor
    scales: torch.Tensor
    order: list


def exchange_quantized_gradients(
    full: torch.Tensor,
    residual: torch.Tensor | None,
    group,
    block_size: int,
    traffic: Traffic,
    bits: int = 8,
    quantized: tuple | None = None,
    on_quantized: Callable[[], None] | None = None,
) -> QuantizedShard:
    """Quantize ``full`` (this rank's flat gradient buffer, fp32 or bf16, length W x shard) chunk by chunk and send
    chunk r to rank r; returns every rank's chunk of this rank's shard, unsummed (``full`` is left as it was).
    ``residual`` (same length and dtype as ``full``, or None: no error feedback) is added before quantizing and
    overwritten with what quantization lost. ``bits``: 8, or 4 (values in [-7, 7], sent two per byte,
    ``pack_int4``; the returned rows hold them unpacked, one per int8). ``quantized``: the ``(q, scales)`` rows the
    fused round end already computed (``core.fused_round_end``: flat, ``full``'s length and W x blocks), sent as
    they are (``full`` and ``residual`` are then not read); the exchange owns them from the call on.
    ``on_quantized`` is called once the residual is no longer touched (before the first send). Collective over
    ``group``."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = full.view(world, -1)
    shard = chunks.shape[1]
    nb = num_blocks(shard, block_size)
    if quantized is not None:
        q, scales = quantized[0].view(world, shard), quantized[1].view(world, nb)
        if full.device.type == "cuda":  # allocated on the compute stream, read on this one
            q.record_stream(torch.cuda.current_stream(full.device))
            scales.record_stream(torch.cuda.current_stream(full.device))
    else:
        q = torch.empty((world, shard), dtype=torch.int8, device=full.device)
        scales = torch.empty((world, nb), dtype=torch.float32, device=full.device)
        rests = None if residual is None else residual.view(world, -1)
        for r in range(world):  # each chunk's blocks straight into its row of q and scales
            if rests is None:
                quantize(chunks[r], block_size, bits=bits, out=(q[r], scales[r]))
            else:
                quantize_with_residual(chunks[r], rests[r], block_size, bits=bits, out=(q[r], scales[r]))
    if on_quantized is not None:
        on_quantized()
    order = [(me - k) % world for k in range(world)]
    if world == 1:
        return QuantizedShard(q, scales, order)
    got_q, got_s = torch.empty_like(q), torch.empty_like(scales)
    if point_to_point(group):
        got_q[me].copy_(q[me])
        got_s[me].copy_(scales[me])
        wire_in = _wire_buffer(shard, bits, full.device) if bits == 4 else None
        for k in range(1, world):
            dst, src = (me + k) % world, (me - k) % world
            reqs = [
                traffic.send(_to_wire(q[dst], bits), group, dst),
                traffic.send(scales[dst], group, dst),
                traffic.recv(got_q[src] if wire_in is None else wire_in, group, src),
                traffic.recv(got_s[src], group, src),
            ]
            for req in reqs:
                req.wait()
            if wire_in is not None:
                got_q[src].copy_(_from_wire(wire_in, shard, bits))
        return QuantizedShard(got_q, got_s, order)
    wire = torch.stack([_to_wire(q[r], bits) for r in range(world)]) if bits == 4 else q
    got_wire = torch.empty_like(wire) if bits == 4 else got_q
    chunk_bytes = wire[0].numel() * wire.element_size() + nb * scales.element_size()
    traffic.collective((world - 1) * chunk_bytes, (world - 1) * chunk_bytes)
    dist.all_to_all_single(got_wire, wire, group=group)
    dist.all_to_all_single(got_s, scales, group=group)
    if bits == 4:  # row r: rank r's chunk of this shard (row me: the copy of q[me] the all-to-all made)
        for r in range(world):
            got_q[r].copy_(_from_wire(got_wire[r], shard, bits))
    return QuantizedShard(got_q, got_s, order)


def compressed_reduce_scatter_inplace(
    full: torch.Tensor,
    residual: torch.Tensor | None,
    group,
    block_size: int,
    traffic: Traffic,
    bits: int = 8,
    quantized: tuple | None = None,
    on_quantized: Callable[[], None] | None = None,
) -> None:
    """Sum ``full`` over the ranks into this rank's own slice of it, through :func:`exchange_quantized_gradients`
    (``quantized``, ``on_quantized``: as there) and one ``dequantize_sum`` pass (in ``full``'s dtype); the other
    slices are left as they were. For the rounds that store the sum (``round_job.UNSTORED_SUM_MAX_WORLD``: many
    ranks, tensor parallelism's norm ranges); the others never do (``acco_ds.ops.quantized_sum_step``). Collective
    over ``group``."""
    got = exchange_quantized_gradients(
        full, residual, group, block_size, traffic, bits, quantized, on_quantized
    )
    me = dist.get_rank(group)
    dequantize_sum(full.view(got.q.shape[0], -1)[me], got.q, got.scales, block_size, got.order)


def _wire_buffer(n: int, bits: int, device) -> torch.Tensor:
    """A receive buffer for ``n`` quantized values in their wire form."""
    if bits == 4:
        return torch.empty(-(-n // 2), dtype=torch.uint8, device=device)
    return torch.empty(n, dtype=torch.int8, device=device)


def _to_wire(q: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_int4(q) if bits == 4 else q


def _from_wire(w: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    return unpack_int4(w, n) if bits == 4 else w


def exchange_quantized_difference(
    target: torch.Tensor,
    base: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    group,
    block_size: int,
    traffic: Traffic,
    bits: int = 8,
) -> None:
    """The exchange of a compressed all-gather: this rank's quantized difference (``q``, ``scales``: of its slice,
    whose new value ``base + deq(q, scales)`` is already in ``target``) to every peer, and every peer's applied
    to its slice of ``target`` (``target[c] = base[c] + deq(q_c, scales_c)``; ``target`` and ``base``: full, the
    parameter dtype, ``base`` what every replica holds, the MODEL buffer, which may be ``target`` itself: each slice
    is read before it is written). Collective over ``group``."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return
    chunks, bases = target.view(world, -1), base.view(world, -1)
    shard = chunks.shape[1]
    wire = _to_wire(q, bits)
    got_s = torch.empty((world, num_blocks(shard, block_size)), dtype=torch.float32, device=target.device)
    if point_to_point(group):
        got_q = [_wire_buffer(shard, bits, target.device) for _ in range(world)]
        reqs = []
        for k in range(1, world):
            dst, src = (me + k) % world, (me - k) % world
            reqs += [traffic.send(wire, group, dst), traffic.send(scales, group, dst)]
            reqs += [traffic.recv(got_q[src], group, src), traffic.recv(got_s[src], group, src)]
        for req in reqs:
            req.wait()
    else:  # flat outputs, the W inputs one after the other (the form every backend takes)
        gathered = torch.empty(world * wire.numel(), dtype=wire.dtype, device=target.device)
        moved = (world - 1) * (wire.numel() * wire.element_size() + scales.numel() * scales.element_size())
        traffic.collective(moved, moved)
        all_gather_single(gathered, wire, group=group)
        all_gather_single(got_s.view(-1), scales, group=group)
        got_q = list(gathered.view(world, -1))
    for c in range(world):
        if c != me:
            q_c = _from_wire(got_q[c], shard, bits)
            add_dequantized(chunks[c], bases[c], q_c, got_s[c], block_size)
