"""Alpha-beta times of the collectives of one data-parallel step (docs/PLAN.md, "Communication").

A ring reduce-scatter (or all-gather) of ``B`` bytes over ``W`` ranks sends ``(W-1)/W x B`` bytes
from every rank in ``W-1`` steps: ``t = (W-1)/W x B / bw + (W-1) x latency``; a ring all-reduce is a
reduce-scatter followed by an all-gather. With several nodes the collective is hierarchical: a
phase over the ``g`` data-parallel ranks of a node on the intra-node link, then a phase over the
``n`` nodes on the inter-node link, in which the ``g`` ranks of a node each move their ``1/g`` of
the bytes at once through the node's network: ``(n-1)/n x (B/g) / (bw_node/g) + (n-1) x latency``.

``bw`` is what nccl-tests calls bus bandwidth (per rank, one direction); ``bw_node`` the node's
total inter-node bandwidth (all its NICs). ``Topology.reduce_scatter(B)`` etc. return seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


def ring_phase(nbytes: float, ranks: int, bw: float, latency: float) -> float:
    """One ring reduce-scatter or all-gather of ``nbytes`` (the full buffer) over ``ranks``."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bw + (ranks - 1) * latency


@dataclass(frozen=True)
class Topology:
    """The data-parallel group: ``nodes`` x ``ranks_per_node`` ranks (ranks_per_node = GPUs per
    node / tensor-parallel size), the intra-node bus bandwidth per rank (bytes/s) and latency per
    ring step (s), the inter-node bandwidth per node and latency per step."""

    nodes: int
    ranks_per_node: int
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def phases(self, nbytes: float) -> dict:
        """The intra-node and inter-node phase of one reduce-scatter (an all-gather is the same
        two phases in the other order)."""
        g, n = self.ranks_per_node, self.nodes
        intra = ring_phase(nbytes, g, self.intra_bw, self.intra_latency) if g > 1 else 0.0
        # each of the g ranks moves nbytes/g through the node's network at bw_node/g
        inter = ring_phase(nbytes, n, self.inter_bw, self.inter_latency) if n > 1 else 0.0
        return {"intra_s": intra, "inter_s": inter}

    def reduce_scatter(self, nbytes: float) -> float:
        p = self.phases(nbytes)
        return p["intra_s"] + p["inter_s"]

    def all_gather(self, nbytes: float) -> float:
        return self.reduce_scatter(nbytes)

    def all_reduce(self, nbytes: float) -> float:
        return 2 * self.reduce_scatter(nbytes)
