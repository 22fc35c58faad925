"""Session set-up for the test suite.

The tests that build DeepSpeed engines inside the pytest process (one gloo rank) mean CPU: DeepSpeed's
accelerator is fixed to the CPU one before DeepSpeed is first imported, so on a machine with a GPU they run as
here (without it DeepSpeed would pick CUDA and put those engines on the GPU). Launched ranks get their own
environment from ``tests/ranks/launch.rank_env`` (CPU, or CUDA for the GPU tests). ``torch.cuda`` itself stays
visible to this process: the GPU kernel tests use it directly.

``make test-fast`` (``scripts/run_tests.sh --fast``) deselects the tests marked ``launcher`` and sets
``ACCO_DS_TEST_NO_LAUNCH=1``: then a launcher started from this process anyway (the ``deepspeed`` runner or its
per-node launcher, ``torchrun``, ``accelerate launch``; ``tests/ranks/launch.run_local`` checks it too) raises,
so a launching test without the marker shows up at once.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tests.ranks import cpuinfo_cache, no_shm_comm  # noqa: E402

# DeepSpeed's CPU probe answered from one file per machine, in this process and in every process the suite starts
# (the ranks' start-up hook runs it: tests/ranks/cpu_hook/sitecustomize.py, first on the session's PYTHONPATH)
os.environ.setdefault(cpuinfo_cache.CACHE_ENV, cpuinfo_cache.default_path())
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
_here = os.path.dirname(os.path.realpath(__file__))
_hook = os.path.join(_here, "ranks", "cpu_hook")  # tests/ranks/launch.CPU_RANKS_HOOK
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([_hook, os.path.dirname(_here), *_paths]))
cpuinfo_cache.install()
# and without DeepSpeed's CPU shared-memory communication op (built, loaded and mapped by every rank; it serves only
# inference_all_reduce, which then takes torch.distributed's all_reduce as on CUDA): tests/ranks/no_shm_comm.py
os.environ.setdefault(no_shm_comm.ENV, "1")
no_shm_comm.install()

import contextlib  # noqa: E402
import glob  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

_SHM_PATTERN = "/dev/shm/deepspeed_allreduce_buffer_*"
_SHM_AT_START = set(glob.glob(_SHM_PATTERN))


def _mapped_shm_buffers() -> set:
    """The DeepSpeed buffers another live process still maps (a run of another pytest session, say); this
    process's own (an in-process engine's) are not counted: they are removed as before."""
    mapped, own = set(), f"/proc/{os.getpid()}/maps"
    for maps in glob.glob("/proc/[0-9]*/maps"):
        if maps == own:
            continue
        with contextlib.suppress(OSError), open(maps) as fh:
            mapped.update(
                line.split(None, 5)[-1].strip() for line in fh if "deepspeed_allreduce_buffer_" in line
            )
    return mapped


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers():
    """DeepSpeed's CPU communication op creates a 69 MB shared-memory buffer per rank
    (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``) and never unlinks it: each
    launch of the suite would leave its ranks' buffers in RAM (gigabytes over a run). Every test's
    launched ranks have exited when it returns (also those of module-scoped fixtures, which launch
    before this fixture starts): remove every buffer that appeared since the session started and that no
    live process maps (so the ranks of another test session running at the same time keep theirs;
    unlinking one an in-process engine still maps would leave its mapping valid anyway), and that is older than
    a minute: the ranks of a test running in another worker may have created theirs and not mapped it yet
    (the launch helpers remove their own ranks' buffers by name as the launch ends)."""
    yield
    new = set(glob.glob(_SHM_PATTERN)) - _SHM_AT_START
    if not new:
        return
    now = time.time()
    for path in new - _mapped_shm_buffers():
        with contextlib.suppress(OSError):
            if now - os.stat(path).st_mtime > 60:
                os.unlink(path)


_LAUNCHER_MODULES = ("deepspeed.launcher.runner", "deepspeed.launcher.launch", "torch.distributed.run")
_LAUNCHER_PROGRAMS = ("deepspeed", "torchrun", "accelerate")


def _is_launch(args) -> bool:
    argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    if not argv:
        return False
    if os.path.basename(argv[0]) in _LAUNCHER_PROGRAMS:
        return True
    return any(a in _LAUNCHER_MODULES for a in argv)


if os.environ.get("ACCO_DS_TEST_NO_LAUNCH") == "1":
    _popen_init = subprocess.Popen.__init__

    def _refuse_launchers(self, args, *a, **kw):
        if _is_launch(args):
            raise RuntimeError(
                f"ACCO_DS_TEST_NO_LAUNCH=1 (make test-fast) but this test starts a launcher: {args!r}. "
                "Mark it @pytest.mark.launcher (or the module with pytestmark = pytest.mark.launcher)."
            )
        _popen_init(self, args, *a, **kw)

    subprocess.Popen.__init__ = _refuse_launchers


def pytest_collection_modifyitems(config, items):
    """Longest files first: the benchmarks' smoke runs and the compile checks (tests/compile: nvcc and Triton
    compiles, about 10 minutes on one core), then the files that launch ranks, then the rest (a stable sort: each
    file keeps its order). With parallel workers (``--dist loadfile``) a long file handed out last would finish
    alone while the other worker idles."""

    def weight(item) -> int:
        path = str(item.fspath)
        if os.sep + os.path.join("tests", "benchmarks") + os.sep in path and item.get_closest_marker(
            "launcher"
        ):
            return 0
        if os.sep + os.path.join("tests", "compile") + os.sep in path:
            return 0
        return 1 if item.get_closest_marker("launcher") else 2

    items.sort(key=weight)


_FILE_SECONDS: dict = {}
SLOWEST_FILES = 15


def pytest_runtest_logreport(report):
    """Sums each test file's setup, call and teardown seconds (on the controller under xdist, which receives every
    worker's reports), for :func:`pytest_terminal_summary`."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)


def pytest_terminal_summary(terminalreporter):
    """The slowest test files (module fixtures' launches included, in their first test's setup), so that the suite's
    creep shows file by file in every run of ``scripts/run_tests.sh``."""
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section(
        f"slowest {SLOWEST_FILES} test files (of {len(_FILE_SECONDS)}; {total:.0f} s in all)"
    )
    for path, secs in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        terminalreporter.write_line(f"{secs:8.1f} s  {path}")
