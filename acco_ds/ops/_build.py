"""Locate and load the compiled kernels, keeping the original import error for the log.

Four pybind11 modules, built by ``setup.py`` (in place, editable or regular install) next to this package from
csrc/ (laid out by kernel: csrc/common, csrc/adamw, csrc/accumulate, csrc/quantize), each named for what it
holds:

- ``acco_ds._adamw_cpu`` (kind ``"adamw_cpu"``): the CPU AdamW launcher (OpenMP) and the CPU harness of the CUDA
  AdamW kernel body.
- ``acco_ds._accumulate_cpu`` (kind ``"accumulate_cpu"``): the CPU gradient accumulate / cast-copy launcher.
- ``acco_ds._quantize_cpu`` (kind ``"quantize_cpu"``): the CPU blockwise int8 quantize / dequantize launchers.
- ``acco_ds._adamw_cuda`` (kind ``"adamw_cuda"``): the CUDA AdamW launcher (cudart linked statically).

The kinds ``"cpu"`` and ``"cuda"`` name the AdamW modules (``"adamw_cpu"``, ``"adamw_cuda"``): scripts and
benchmarks ask for the device's AdamW kernel by device name.

None links libtorch, so one build serves any torch version. Loading never raises: a missing module yields
``None`` and :func:`why_missing` returns the text of the ImportError (or the reason it was not attempted). A
module whose ``ABI_VERSION`` differs from :data:`ABI_VERSION` (a stale build) counts as missing.

The CUDA module carries its CUDA runtime (static cudart), which needs a driver of at least the same CUDA major
version: loading asks the module for both versions (``cuda_versions()``, no GPU work) and treats a driver that is
missing or older than the runtime's major version as "missing", with the reason (instead of a first launch that
fails inside the communication job).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Dict, Tuple

_MODULES = {
    "adamw_cpu": "acco_ds._adamw_cpu",
    "accumulate_cpu": "acco_ds._accumulate_cpu",
    "quantize_cpu": "acco_ds._quantize_cpu",
    "adamw_cuda": "acco_ds._adamw_cuda",
}
_ALIASES = {"cpu": "adamw_cpu", "cuda": "adamw_cuda"}
_lock = threading.Lock()
_cache: Dict[str, Tuple[object | None, str]] = {}

ABI_VERSION = 8
"""The argument layout the Python fronts use (csrc/common/bindings.h's kAbiVersion must match)."""

DISABLE_ENV = "ACCO_DS_DISABLE_EXT"
"""Set to 1 to ignore the compiled extensions at runtime (the torch reference is used instead)."""


def _kind(kind: str) -> str:
    kind = _ALIASES.get(kind, kind)
    if kind not in _MODULES:
        allowed = sorted([*_MODULES, *_ALIASES])
        raise ValueError(f"acco_ds.ops._build.load: kind must be one of {allowed}, got {kind!r}.")
    return kind


def load(kind: str):
    """Return the compiled module for ``kind`` (a key of ``_MODULES``, or "cpu"/"cuda": the AdamW modules), or
    ``None`` when it cannot be imported."""
    kind = _kind(kind)
    hit = _cache.get(kind)
    if hit is not None:
        return hit[0]
    with _lock:
        if kind not in _cache:
            _cache[kind] = _try_import(kind)
    return _cache[kind][0]


def _try_import(kind: str) -> Tuple[object | None, str]:
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        return None, f"{DISABLE_ENV}={os.environ[DISABLE_ENV]} is set"
    rebuild = "Rebuild with `ACCO_DS_BUILD_EXT=1 pip install -e .` or `python setup.py build_ext --inplace`."
    try:
        mod = importlib.import_module(_MODULES[kind])
    except ImportError as e:  # not built (no compiler at install time) or a broken build
        return None, f"{_MODULES[kind]} could not be imported: {type(e).__name__}: {e}. {rebuild}"
    found = getattr(mod, "ABI_VERSION", None)
    if found != ABI_VERSION:
        return (
            None,
            f"{mod.__file__} is a stale build (ABI_VERSION {found}, expected {ABI_VERSION}). {rebuild}",
        )
    if kind.endswith("cuda"):
        why = driver_mismatch(mod)
        if why:
            return None, why
    return mod, ""


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def driver_mismatch(mod) -> str:
    """Why the CUDA module ``mod`` cannot run with this machine's driver ("" when it can).

    The module links the CUDA runtime statically (cudart of the nvcc that built it); a runtime of CUDA major
    version R needs a driver that supports CUDA R (CUDA 13: driver >= 580). Minor versions are compatible.
    """
    probe = getattr(mod, "cuda_versions", None)
    rebuild = "Rebuild it (`python setup.py build_ext --inplace`) with this acco_ds."
    if probe is None:
        return f"{mod.__file__} predates the driver check (no cuda_versions()). {rebuild}"
    driver, runtime, err, text = probe()
    if err:
        return f"{mod.__file__}: the CUDA runtime linked into it cannot query the driver ({text})."
    if driver == 0:
        return f"{mod.__file__}: no CUDA driver is loaded on this machine (cudaDriverGetVersion returned 0)."
    if driver // 1000 < runtime // 1000:
        return (
            f"{mod.__file__} links the CUDA {_version(runtime)} runtime statically, but the driver supports CUDA "
            f"{_version(driver)} only, so every launch would fail. Rebuild it with the nvcc of CUDA "
            f"{driver // 1000} (the CUDA of your torch: NVCC=... or CUDA_HOME=... `python setup.py build_ext "
            f"--inplace`) or update the driver (CUDA 13 needs >= 580)."
        )
    return ""


def why_missing(kind: str) -> str:
    """The reason the ``kind`` module is unavailable ("" when it loaded)."""
    load(kind)
    return _cache[_kind(kind)][1]


def available(kind: str) -> bool:
    """True when the compiled module for ``kind`` imports."""
    return load(kind) is not None


def reset_cache() -> None:
    """Forget load results (tests use it after changing the environment)."""
    with _lock:
        _cache.clear()


_logged_choices: set = set()


def triton_available() -> bool:
    """True when triton imports (the CUDA default of the Triton-backed ops)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


TRITON_MIN_CAPABILITY = (7, 0)
"""The lowest CUDA compute capability the Triton kernels run on (V100, sm_70): tests/compile/test_cuda_compile.py
compiles them for it and for sm_75 (T4). Triton lists 8.0+ as supported; the kernels use no tensor-core op (the part
Triton dropped below sm_80) and no bf16 arithmetic (bf16 and fp16 are converted with integer operations). Below it,
the ops take their torch form."""

_logged_capabilities: set = set()
_capability_logger = logging.getLogger("acco_ds.ops")


def cuda_capability(device) -> Tuple[int, int]:
    """``torch.cuda.get_device_capability(device)`` (tests mock it)."""
    import torch

    return tuple(torch.cuda.get_device_capability(device))


def triton_obstacle(device) -> str:
    """Why the Triton kernels cannot run on the CUDA ``device``; "" when they can. A compute capability below
    :data:`TRITON_MIN_CAPABILITY` is logged once per process and capability (a warning naming the torch form)."""
    if not triton_available():
        return "triton is not installed"
    cap = cuda_capability(device)
    if cap >= TRITON_MIN_CAPABILITY:
        return ""
    low = "sm_{}{}".format(*TRITON_MIN_CAPABILITY)
    why = f"compute capability {cap[0]}.{cap[1]} is below {low}, the lowest the Triton kernels target"
    if cap not in _logged_capabilities:
        _logged_capabilities.add(cap)
        _capability_logger.warning(
            "acco_ds: %s (%s); the accumulate, quantize, norm and fused kernels take their torch form on it",
            why,
            device,
        )
    return why


def default_backend(what: str, device, cpu_kind: str, logger) -> str:
    """The backend an op picks by default on ``device``: on CPU the compiled ``cpu_kind`` module ("cpp") where it
    loads, on CUDA "triton" where triton imports and the device's compute capability is at least
    :data:`TRITON_MIN_CAPABILITY` (:func:`triton_obstacle`), else "ref"; the choice is logged once per (op, device
    type) on ``logger`` (a warning when a kernel is missing)."""
    if device.type == "cpu":
        chosen, why = ("cpp", "") if available(cpu_kind) else ("ref", why_missing(cpu_kind))
    elif device.type == "cuda":
        why = triton_obstacle(device)
        chosen = "ref" if why else "triton"
    else:
        chosen, why = "ref", f"no kernel for device type {device.type}"
    if (what, device.type, chosen) not in _logged_choices:
        _logged_choices.add((what, device.type, chosen))
        (logger.warning if why else logger.info)(
            "acco_ds %s on %s: using the %s backend%s", what, device.type, chosen, f" ({why})" if why else ""
        )
    return chosen
