"""Quantities with units for ``acco-plan``'s options: bandwidths, times, memory sizes, counts.

Contract: every ``parse_*`` takes the option's text and returns a float in SI base units (bytes/s,
seconds, bytes, plain count) or raises ``ValueError`` with a message saying what is allowed; the
caller prefixes the option's name. Values must be finite and >= 0; zero is refused too where the caller
asks for a positive one (``positive=True``; bandwidths, memory sizes and counts always).
"""

from __future__ import annotations

import math
import re

_NUM = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"

# bandwidth: bits or bytes per second; decimal prefixes (network and NVLink figures are decimal)
_BW_UNITS = {
    "bit/s": 1 / 8,
    "bps": 1 / 8,
    "kbit/s": 1e3 / 8,
    "kbps": 1e3 / 8,
    "mbit/s": 1e6 / 8,
    "mbps": 1e6 / 8,
    "gbit/s": 1e9 / 8,
    "gbps": 1e9 / 8,
    "tbit/s": 1e12 / 8,
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "tb/s": 1e12,
}
# "mbit" and "gbit" alone are what tc and many spec sheets write
_BW_UNITS.update({k[:-2]: v for k, v in list(_BW_UNITS.items()) if k.endswith("it/s")})
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_MEM_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _split(text: str, what: str, examples: str):
    m = re.fullmatch(r"\s*" + _NUM + r"\s*([A-Za-zµ/]*)\s*", str(text))
    if not m:
        raise ValueError(f"{text!r} is not a {what}; write e.g. {examples}")
    return float(m.group(1)), m.group(2).lower()


def _check(value: float, text: str, positive: bool) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not finite")
    if positive and value <= 0:
        raise ValueError(f"{text!r} must be > 0")
    if value < 0:
        raise ValueError(f"{text!r} must be >= 0")
    return value


def parse_bandwidth(text: str) -> float:
    """Bytes per second from e.g. ``400Gbit/s``, ``100gbps``, ``450GB/s``, ``50mbit``. A unit is
    required: ``GB/s`` (bytes) and ``Gbit/s`` (bits) differ by 8x and are both in common use."""
    examples = "400Gbit/s, 25Gbps, 450GB/s or 50mbit"
    value, unit = _split(text, "bandwidth", examples)
    if not unit:
        raise ValueError(f"{text!r} has no unit; write e.g. {examples} (bits and bytes differ by 8x)")
    if unit not in _BW_UNITS:
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use one of {', '.join(sorted(_BW_UNITS))}")
    return _check(value * _BW_UNITS[unit], text, positive=True)


def parse_time(text: str, positive: bool = False) -> float:
    """Seconds from e.g. ``5us``, ``0.25``, ``12ms`` (a bare number is seconds)."""
    value, unit = _split(text, "time", "0.25, 250ms or 5us")
    unit = unit or "s"
    if unit not in _TIME_UNITS:
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use one of {', '.join(_TIME_UNITS)}")
    return _check(value * _TIME_UNITS[unit], text, positive)


def parse_memory(text: str) -> float:
    """Bytes from e.g. ``80GiB``, ``40GB``, ``3e9`` (a bare number is bytes)."""
    value, unit = _split(text, "memory size", "80GiB, 40GB or 8e10")
    unit = unit or "b"
    if unit not in _MEM_UNITS:
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use one of {', '.join(_MEM_UNITS)}")
    return _check(value * _MEM_UNITS[unit], text, positive=True)


def parse_count(text: str) -> float:
    """A count from e.g. ``125M``, ``2.7B``, ``7e9``, ``1300000`` (suffixes k, M, B/G, T)."""
    value, unit = _split(text, "count", "125M, 2.7B or 7e9")
    if unit not in _COUNT_SUFFIX:
        raise ValueError(f"{text!r}: unknown suffix {unit!r}; use k, M, B or T (or none)")
    return _check(value * _COUNT_SUFFIX[unit], text, positive=True)
