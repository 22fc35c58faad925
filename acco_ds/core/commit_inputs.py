"""A commit's AdamW inputs, kept so that a peer can step its copy of the rank's state instead of receiving the state:
the "inputs" form of ``core.peer_copies`` (a third of the bytes of the state in fp32, a sixth in bf16).

Per group, what the commit's ``ops.adamw.adamw_step`` reads besides the state: the reduced gradient shard as the step
reads it (``shard_numel`` elements in the gradient buffer's dtype, padding included) and its step scalars, 10 fp32:
the ``hyper_tensor`` row (8), ``scale_tensor`` (1) and ``noop_flag`` (1, 0 or 1). One flat uint8 message per commit:
the groups' gradients back to back (each at an offset aligned to 16 bytes), then the groups' scalars
(:class:`InputsLayout`).

Contract:
- :class:`CommitInputs` has two slots, commit k in slot ``k % 2``. ``run_round_job`` fills a COMMIT's slot on the
  job's thread (the communication worker thread) right before each group's step, through :class:`Capture`: copies
  enqueued on that thread's current stream (non-blocking into pinned memory on CUDA); the job's own host read of
  the applied count (``MemoryState.after_job``) then orders them before the slot is read, and right after that read
  the job calls :meth:`CommitInputs.synchronized`. Its CPU test mode (``emulate_async``: on the CUDA executor on
  emulated streams, ``core.emulated_stream``) lands a capture's data only there, as a GPU's copies land when the
  stream's work is done: each take keeps its source's value of that moment (the step after it may overwrite the
  gradient) and writes the slot at :meth:`~CommitInputs.synchronized`, so a slot read before that point holds an
  older commit's inputs (or none), a mismatch the copies report. A commit whose step is
  not the plain ``adamw_step`` (compressed gradients read unsummed, compressed parameters, offload) marks its slot
  as holding no inputs (:meth:`CommitInputs.has`): its copy is sent as the state.
- The copies' thread reads slot k until the copies of the steps naming commit k are through; the job of commit
  k + 2 writes it only after ``PeerCopies.wait_slot_free(k + 1)`` returned (the commit record of k + 1 is written
  after that wait, and jobs run one at a time), so a slot is never rewritten while it is sent.
- :func:`step_copy` steps a held copy with the host AdamW (``ops.adamw.adamw_step`` on CPU tensors: the CPU extension,
  whose bits are the CUDA kernel's, tests/gpu/test_kernels_gpu.py). :func:`state_digest` is the check of the result:
  both sides compute it on the copies' thread over the whole flat state (every group's master, exp_avg, exp_avg_sq,
  padding included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence

import numpy as np
import torch

from acco_ds.ops.adamw import adamw_step

SCALARS = 10  # per group: hyper_tensor (8), scale_tensor, noop_flag
_ALIGN = 16
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class InputsLayout:
    """Where each group's gradient and scalars are in one commit's flat message (uint8)."""

    numels: tuple  # per group, shard_numel
    dtypes: tuple  # per group, the gradient buffer's dtype
    offsets: tuple  # per group, the byte offset of its gradient
    scalars_at: int  # the byte offset of the [groups, SCALARS] fp32 scalars
    nbytes: int

    @classmethod
    def of(cls, numels: Sequence[int], dtypes: Sequence[torch.dtype]) -> InputsLayout:
        offsets, at = [], 0
        for n, dt in zip(numels, dtypes):
            offsets.append(at)
            at += _aligned(int(n) * dt.itemsize)
        scalars_at = at
        return cls(tuple(int(n) for n in numels), tuple(dtypes), tuple(offsets), scalars_at,
                   scalars_at + 4 * SCALARS * len(numels))  # fmt: skip

    @classmethod
    def of_groups(cls, groups) -> InputsLayout:
        """The layout of ``groups`` (``core.buffers.GroupBuffers``): the same on every rank of a run."""
        return cls.of([b.layout.shard_numel for b in groups], [b.grad_bufs[0].dtype for b in groups])

    def grads(self, flat: torch.Tensor) -> List[torch.Tensor]:
        out = []
        for n, dt, at in zip(self.numels, self.dtypes, self.offsets):
            out.append(flat[at : at + n * dt.itemsize].view(dt))
        return out

    def scalars(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.scalars_at : self.nbytes].view(torch.float32).view(len(self.numels), SCALARS)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class CommitInputs:
    """The rank's two slots of commit inputs (see the module docstring); ``groups``: the pipeline's groups."""

    def __init__(self, groups, device: torch.device, emulate_async: bool = False):
        self.layout = InputsLayout.of_groups(groups)
        pin = device.type == "cuda"
        self._flats = [torch.zeros(self.layout.nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._keys: List[int | None] = [None, None]  # the commit each slot holds complete inputs of
        self._non_blocking = pin
        # the CPU test mode's copies not landed yet: (slot view, the source's value at the take)
        self._pending: List[tuple] | None = [] if emulate_async else None
        self.landed = 0  # copies landed late by the CPU test mode (a test sees it ran)

    def synchronized(self) -> None:
        """The job's thread, right after the host read that ends the job's stream work: the captures' copies are in
        their slots (CUDA, CPU: nothing to do; the CPU test mode writes them now)."""
        if self._pending:
            for dst, value in self._pending:
                dst.copy_(value)
            self.landed += len(self._pending)
            self._pending.clear()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._pending is not None:
            self._pending.append((dst, src.detach().clone()))
        else:
            dst.copy_(src, non_blocking=self._non_blocking)

    def capture(self, key: int) -> Capture:
        """The writer of commit ``key``'s slot (the slot's previous inputs are gone from now on)."""
        slot = key % 2
        self._keys[slot] = None
        return Capture(self, key, slot)

    def has(self, key: int) -> bool:
        """Whether the slot of commit ``key`` holds that commit's inputs."""
        return self._keys[key % 2] == key

    def flat(self, key: int) -> torch.Tensor:
        """Commit ``key``'s message (a view of its slot; see the module docstring for how long it stays valid)."""
        if not self.has(key):
            raise KeyError(f"no inputs of commit {key} are held")
        return self._flats[key % 2]


class Capture:
    """One COMMIT job's writer (``run_round_job(commit_inputs=...)``): :meth:`take` for each group's step inputs, in
    group order, or :meth:`none` when the job's step is another function; the slot counts as complete once every
    group was taken."""

    def __init__(self, owner: CommitInputs, key: int, slot: int):
        self._owner, self._key, self._slot = owner, key, slot
        self._taken = 0
        self._failed = False

    def take(self, group: int, fn: Callable[..., Any], tensors: Dict[str, Any]) -> None:
        """Copy group ``group``'s inputs of a step by ``fn`` with ``tensors`` (the job's keywords: ``grad``,
        ``hyper_tensor``, ``scale_tensor``, ``noop_flag``); a step by another function marks the slot empty."""
        plain = getattr(fn, "func", None) is adamw_step and set(tensors) == {
            "grad", "hyper_tensor", "scale_tensor", "noop_flag"
        }  # fmt: skip
        if not plain or group != self._taken or self._failed:
            self.none()
            return
        owner = self._owner
        flat = owner._flats[self._slot]
        with torch.no_grad():
            owner._copy(owner.layout.grads(flat)[group], tensors["grad"].reshape(-1))
            row = owner.layout.scalars(flat)[group]
            owner._copy(row[:8], tensors["hyper_tensor"].reshape(-1))
            owner._copy(row[8:9], tensors["scale_tensor"].reshape(-1)[:1])
            owner._copy(row[9:10], tensors["noop_flag"].reshape(-1)[:1].to(torch.float32))
        self._taken += 1
        if self._taken == len(owner.layout.numels):
            owner._keys[self._slot] = self._key

    def none(self) -> None:
        """This commit's step is not one a copy can be stepped with: its copy is sent as the state."""
        self._failed = True
        self._owner._keys[self._slot] = None


def step_copy(state: torch.Tensor, inputs: torch.Tensor, layout: InputsLayout) -> None:
    """Step a held copy in place: ``state`` the flat fp32 state of every group (master, exp_avg, exp_avg_sq each
    ``shard_numel`` long, in group order, as a commit record holds it), ``inputs`` a commit's message
    (``layout``). The host AdamW, one call per group, as the rank's own step."""
    views = state.split([n for n in layout.numels for _ in range(3)])
    scalars = layout.scalars(inputs)
    for i, grad in enumerate(layout.grads(inputs)):
        row = scalars[i]
        master, exp_avg, exp_avg_sq = views[3 * i : 3 * i + 3]
        adamw_step(master, exp_avg, exp_avg_sq, grad, hyper_tensor=row[:8].contiguous(),
                   scale_tensor=row[8:9].contiguous(), noop_flag=row[9:10].to(torch.int32), commit=True)  # fmt: skip


def state_digest(state: torch.Tensor) -> int:
    """A check of a flat fp32 state in host memory: the sum, modulo 2**64, of its bytes read as unsigned 64-bit words
    (an odd last element as a 32-bit one), as a signed 64-bit integer. Equal states give equal digests; any one
    element's bits changed changes it (the word it is in changes by less than 2**64). One pass over the bytes without
    widening them (numpy's unsigned sum wraps): a twentieth of the time of a widening sum of the int32 patterns."""
    words = state.detach().reshape(-1).numpy().view(np.uint32)
    even = words.size - words.size % 2
    total = int(words[:even].view(np.uint64).sum(dtype=np.uint64)) if even else 0
    if even != words.size:
        total += int(words[-1])
    total &= _MASK64
    return total - (1 << 64) if total >> 63 else total
