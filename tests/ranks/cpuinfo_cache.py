"""One CPU probe per machine for the whole test session, instead of one per DeepSpeed op load.

DeepSpeed asks py-cpuinfo for the CPU's architecture and SIMD width each time a rank loads one of its CPU ops
(``OpBuilder.cpu_arch`` and ``simd_width``: the shared-memory communication op at ``init_distributed``, cpu_adam,
fused_adam), and ``cpuinfo.get_cpu_info()`` starts a fresh Python interpreter for every call (about 0.8 CPU-seconds
each): one suite run on 2 cores started about 300 of them. The answer cannot change while the machine runs, so
:func:`install` makes ``get_cpu_info_json`` read it from the file named by ``ACCO_DS_TEST_CPUINFO_CACHE`` once one
process of the session has probed and written it (an atomic rename: a reader never sees half a file). The file's
name carries the boot id and the user (tests/conftest.py), so another machine, a reboot or another user probes
afresh; a probe that failed (py-cpuinfo's ``"{}"``) is not kept. Only the tests use it: the product and its users'
runs keep DeepSpeed's probe as it is.
"""

from __future__ import annotations

import contextlib
import os

CACHE_ENV = "ACCO_DS_TEST_CPUINFO_CACHE"


def default_path() -> str:
    """``<tmp>/acco_ds_cpuinfo_<boot id>_<uid>.json``: one file per boot and user."""
    import tempfile

    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "noboot"
    return os.path.join(tempfile.gettempdir(), f"acco_ds_cpuinfo_{boot}_{os.getuid()}.json")


def install() -> bool:
    """Wrap ``cpuinfo.cpuinfo.get_cpu_info_json`` with the file cache named by ``ACCO_DS_TEST_CPUINFO_CACHE``;
    False (nothing changed) when the variable is unset or py-cpuinfo is not installed."""
    path = os.environ.get(CACHE_ENV)
    if not path:
        return False
    try:
        from cpuinfo import cpuinfo
    except ImportError:
        return False
    probe = getattr(cpuinfo.get_cpu_info_json, "__wrapped__", cpuinfo.get_cpu_info_json)

    def get_cpu_info_json() -> str:
        with contextlib.suppress(OSError), open(path) as fh:
            text = fh.read()
            if text.strip() not in ("", "{}"):
                return text
        text = probe()
        if text.strip() not in ("", "{}"):
            tmp = f"{path}.{os.getpid()}.tmp"
            with contextlib.suppress(OSError):
                with open(tmp, "w") as fh:
                    fh.write(text)
                os.replace(tmp, path)
        return text

    get_cpu_info_json.__wrapped__ = probe
    cpuinfo.get_cpu_info_json = get_cpu_info_json
    return True
