"""Bytes a rank puts on the network, counted at its ``torch.distributed`` calls, for every contender alike.

``acco_ds`` counts its own rounds (``engine.optimizer.stats()``); DeepSpeed's ZeRO counts nothing. So that the
benchmarks compare the same figure, :class:`WireCounter` wraps the ``torch.distributed`` functions every
backend path ends in (DeepSpeed's ``deepspeed.comm`` and acco_ds call them by attribute at call time) while
installed, and adds, per call, what one rank SENDS on a ring (the algorithm NCCL and gloo use for large
tensors; ``W`` the group's size, ``B`` the tensor's bytes):

- ``all_reduce``: ``2 (W-1)/W B`` (a reduce-scatter then an all-gather);
- ``reduce_scatter_tensor`` / ``reduce_scatter_single`` (``B`` the input), ``all_gather_into_tensor`` /
  ``all_gather_single`` (``B`` the output) and
  ``all_to_all_single`` (``B`` the input: the compressed exchanges on NCCL): ``(W-1)/W B``; ``all_gather`` (a list of W outputs of ``B``): ``(W-1) B``;
- ``send`` / ``isend``: ``B``; ``broadcast``: ``B`` from the source, 0 elsewhere (a tree or a ring moves
  at most that per rank).

Receives are not counted (on a ring every rank receives what it sends). ``install(bound)`` also wraps the
collectives a library holds bound under other names (DeepSpeed's backend keeps ``all_gather_into_tensor``
and ``reduce_scatter_tensor`` so: ``acco_ds.deepspeed.bound_collectives``), counted as the function they are.
A call made inside a counted call (torch >= 2.10's ``reduce_scatter_tensor`` calls ``reduce_scatter_single``) is
not counted again. Functions this torch lacks are not wrapped.
Threads: the calls may come from the communication thread; the counts are kept under a lock. ``install`` /
``uninstall`` are not thread-safe (call them while no collective runs).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Sequence, Tuple

import torch.distributed as dist

_WRAPPED = (
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "all_gather_single",
    "all_gather",
    "all_to_all_single",
    "send",
    "isend",
    "broadcast",
)


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def _group_size(kwargs: dict) -> int:
    return dist.get_world_size(kwargs.get("group"))


def sent_bytes(name: str, args: tuple, kwargs: dict) -> float:
    """What one call of ``torch.distributed.<name>`` sends from this rank (see the module docstring)."""
    first = args[0] if args else None
    if name == "all_reduce":
        t = kwargs.get("tensor", first)
        w = _group_size(kwargs)
        return 2 * (w - 1) / w * _bytes(t)
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        t = kwargs.get("input", args[1] if len(args) > 1 else None)
        w = _group_size(kwargs)
        return (w - 1) / w * _bytes(t)
    if name in ("all_gather_into_tensor", "all_gather_single"):
        t = kwargs.get("output_tensor", first)
        w = _group_size(kwargs)
        return (w - 1) / w * _bytes(t)
    if name == "all_to_all_single":  # every rank keeps its own chunk and sends the other W - 1
        t = kwargs.get("input", args[1] if len(args) > 1 else None)
        w = _group_size(kwargs)
        return (w - 1) / w * _bytes(t)
    if name == "all_gather":
        outs = kwargs.get("tensor_list", first)
        return (len(outs) - 1) * _bytes(outs[0]) if outs else 0.0
    if name in ("send", "isend"):
        return float(_bytes(kwargs.get("tensor", first)))
    if name == "broadcast":
        t = kwargs.get("tensor", first)
        src = kwargs.get("src", args[1] if len(args) > 1 else None)
        group_src = kwargs.get("group_src")
        me = dist.get_rank(kwargs.get("group")) if group_src is not None else dist.get_rank()
        return float(_bytes(t)) if me == (group_src if group_src is not None else src) else 0.0
    raise ValueError(f"sent_bytes: {name!r} is not counted; counted: {', '.join(_WRAPPED)}")


def peers(name: str, args: tuple, kwargs: dict) -> list:
    """The global ranks one call of ``torch.distributed.<name>`` involves: the group's (the world's when none), or
    this rank and the destination of a send (``dst`` global, ``group_dst`` the group's)."""
    group = kwargs.get("group")
    if name in ("send", "isend"):
        dst = kwargs.get("dst", args[1] if len(args) > 1 else None)
        if dst is None and kwargs.get("group_dst") is not None:
            dst = dist.get_global_rank(group, kwargs["group_dst"])
        return [dist.get_rank(), dst]
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


class WireCounter:
    """Counts the bytes this rank sends through ``torch.distributed`` while installed: all of them (``sent``) and,
    given ``ranks_per_node`` (consecutive ranks share a node), those of the calls that involve ranks of more than
    one node (``sent_internode``: every byte of such a call, an upper bound of what crosses between nodes)."""

    def __init__(self, ranks_per_node: int | None = None) -> None:
        self.sent = 0.0
        self.sent_internode = 0.0
        self.ranks_per_node = ranks_per_node
        self.calls = 0
        self._lock = threading.Lock()
        self._originals: dict = {}
        self._inside = threading.local()  # depth of counted calls on this thread

    def install(self, bound: Sequence[Tuple[object, str, str]] = ()) -> WireCounter:
        """Wrap the ``torch.distributed`` functions, and each ``(holder, attribute, name)`` of ``bound`` (a
        collective held under another name, counted as ``torch.distributed.<name>``)."""
        targets = [(dist, name, name) for name in _WRAPPED if hasattr(dist, name)] + list(bound)
        for holder, attr, name in targets:
            if name not in _WRAPPED:
                raise ValueError(f"WireCounter: {name!r} is not counted; counted: {', '.join(_WRAPPED)}")
            fn = getattr(holder, attr)
            self._originals[(id(holder), attr)] = (holder, attr, fn)
            setattr(holder, attr, self._wrap(name, fn))
        return self

    def uninstall(self) -> None:
        for holder, attr, fn in self._originals.values():
            setattr(holder, attr, fn)
        self._originals = {}

    @contextlib.contextmanager
    def not_counted(self):
        """Inside, the calls this thread makes are not counted (acco-train's evaluations); other threads' are."""
        depth = getattr(self._inside, "depth", 0)
        self._inside.depth = depth + 1
        try:
            yield
        finally:
            self._inside.depth = depth

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._inside, "depth", 0)
            if depth:
                return fn(*args, **kwargs)
            self._inside.depth = depth + 1
            try:
                self._count(name, args, kwargs)
                return fn(*args, **kwargs)
            finally:
                self._inside.depth = depth

        return counted

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        n = sent_bytes(name, args, kwargs)
        across = (
            self.ranks_per_node and len({r // self.ranks_per_node for r in peers(name, args, kwargs)}) > 1
        )
        with self._lock:
            self.sent += n
            self.sent_internode += n if across else 0.0
            self.calls += 1
