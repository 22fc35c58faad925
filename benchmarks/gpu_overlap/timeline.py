"""Did the compute stream ever run out of queued work because the host was late? (pure functions, no torch)

Input: the device timeline of a few profiled steps, as ``torch.profiler`` exports it (Chrome trace JSON: device ops
``cat`` "kernel" / "gpu_memcpy" / "gpu_memset" with ``ts``, ``dur`` and ``args.stream``/``args.correlation``;
their launch calls ``cat`` "cuda_runtime" / "cuda_driver" with the same ``args.correlation``), or the same records
built by hand (the tests). All times in microseconds on the profiler's one clock.

The compute stream is the stream with the most device ops (the model's kernels); every other stream is a side
stream (ACCO's communication job). For two consecutive ops ``a``, ``b`` of the compute stream, the stream is idle
from ``a.end`` to ``b.start``. That idle time is the host's doing only where ``b`` had not been launched yet when
``a`` ended (``b.launch > a.end``: nothing was queued), and only from the later of ``a.end`` and the last end of a
side-stream op before ``b.launch`` (had the host queued ``b`` earlier, ``b`` would still have waited for the side
stream it depends on): ``host_gap = b.launch - max(a.end, last side end before b.launch)``, at most the idle time.
A gap of the host at or under ``threshold_us`` is launch latency, not a stall.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, List, Sequence, Tuple

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("cpu_op", "user_annotation", "python_function", *LAUNCH_CATS)
STALL_THRESHOLD_US = 100.0  # a host gap above this is a stall: launch latency on a busy host is ~5-20 us


@dataclass(frozen=True)
class DeviceOp:
    start: float
    end: float
    stream: int
    launch: float  # when the host's launch call started (same clock); -inf when unknown (treated as queued)
    launch_tid: object = None  # the host thread that launched it, when known


def ops_from_trace(trace: dict) -> List[DeviceOp]:
    """The device ops of a Chrome trace (``torch.profiler``'s ``export_chrome_trace``), each with its launch time."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    launches = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (float(e["ts"]), e.get("tid"))
    ops = []
    for e in events:
        if e.get("cat") in DEVICE_CATS and e.get("ph", "X") == "X":
            args = e.get("args", {})
            start = float(e["ts"])
            launch, tid = launches.get(args.get("correlation"), (float("-inf"), None))
            ops.append(
                DeviceOp(start, start + float(e.get("dur", 0.0)), int(args.get("stream", -1)), launch, tid)
            )
    return ops


def compute_stream(ops: Sequence[DeviceOp]) -> int:
    """The stream with the most device ops."""
    counts: dict = {}
    for op in ops:
        counts[op.stream] = counts.get(op.stream, 0) + 1
    return max(counts, key=lambda s: (counts[s], -s))


def host_gaps(ops: Iterable[DeviceOp], stream: int | None = None) -> List[float]:
    """The host gaps (module docstring) of the compute stream (``stream``, else :func:`compute_stream`), in
    microseconds, one per idle interval the host caused (positive ones only), in time order."""
    return [end - start for start, end, _ in host_gap_intervals(ops, stream)]


def host_gap_intervals(
    ops: Iterable[DeviceOp], stream: int | None = None
) -> List[Tuple[float, float, object]]:
    """The host gaps of :func:`host_gaps` as (start, end, thread) on the profiler's clock: from when the compute
    stream could have run its next op to that op's launch, and the host thread that launched it."""
    ops = list(ops)
    if not ops:
        return []
    stream = compute_stream(ops) if stream is None else stream
    main = sorted((op for op in ops if op.stream == stream), key=lambda op: op.start)
    side_ends = sorted(op.end for op in ops if op.stream != stream)
    gaps = []
    for a, b in zip(main, main[1:]):
        idle = b.start - a.end
        if idle <= 0 or b.launch <= a.end:
            continue
        i = bisect.bisect_right(side_ends, b.launch)
        ready = max(a.end, side_ends[i - 1]) if i else a.end
        gap = min(b.launch - ready, idle)
        if gap > 0:
            gaps.append((b.launch - gap, b.launch, b.launch_tid))
    return gaps


def host_activity(
    trace: dict, start: float, end: float, tid: object = None, top: int = 6
) -> List[Tuple[str, float]]:
    """What the host was doing from ``start`` to ``end`` (a host gap) on thread ``tid`` (every thread when None):
    the host events of the trace (``cat`` in :data:`HOST_CATS`: ATen ops, annotations, Python functions when
    recorded, CUDA runtime/driver calls), each with its self time inside the interval (its overlap with the
    interval less that of the events nested in it on its thread), summed per name, the ``top`` largest first."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    spans = sorted(
        (
            (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("tid"), e.get("name", "?"))
            for e in events
            if e.get("cat") in HOST_CATS and e.get("ph", "X") == "X" and (tid is None or e.get("tid") == tid)
        ),
        key=lambda sp: (sp[2] is None, str(sp[2]), sp[0], -sp[1]),
    )
    spent: dict = {}
    stacks: dict = {}  # thread -> open spans [(end, name)], innermost last
    for s, e, t, name in spans:
        stack = stacks.setdefault(t, [])
        while stack and stack[-1][0] <= s:
            stack.pop()
        overlap = min(end, e) - max(start, s)
        if overlap > 0:
            spent[name] = spent.get(name, 0.0) + overlap
            if stack:  # nested: the parent's self time loses what this span covers
                parent = stack[-1][1]
                spent[parent] = spent.get(parent, 0.0) - overlap
        stack.append((e, name))
    return sorted(((n, us) for n, us in spent.items() if us > 0), key=lambda kv: -kv[1])[:top]


def stalls(gaps: Iterable[float], threshold_us: float = STALL_THRESHOLD_US) -> List[float]:
    """The host gaps longer than ``threshold_us``: the device ran out of queued work because the host was late."""
    return [g for g in gaps if g > threshold_us]
