"""Build of acco_ds: the package is pure Python; the kernels in csrc/ are optional compiled modules.

csrc/ is laid out by kernel: csrc/common (rules every kernel shares: the bf16 rounding, dtype codes, the CPU
ISA choice, the ABI version), csrc/adamw, csrc/accumulate, csrc/quantize. The modules (``MODULES``), named for
what they hold:

- ``acco_ds._adamw_cpu``: the CPU AdamW launcher and the CPU harness of the CUDA AdamW body; g++ (or $CXX),
  OpenMP, pybind11 only (no libtorch).
- ``acco_ds._accumulate_cpu``: the CPU gradient accumulate / cast-copy launcher; the same toolchain.
- ``acco_ds._quantize_cpu``: the CPU blockwise int8 quantize / dequantize launchers and the fused round end's
  (fold_quantize); the same toolchain.
- ``acco_ds._adamw_cuda``: the CUDA AdamW launcher; nvcc for sm_80 and sm_90 (+ PTX for newer GPUs), cudart
  linked statically.

All are built with ninja when it is on PATH (otherwise the same commands run one by one). Environment:

- ``ACCO_DS_BUILD_EXT``: unset/``auto`` builds what the compilers present allow and, if a build fails, warns
  and installs without that module (acco_ds then logs it and uses the torch reference); ``0`` builds nothing
  (pure-Python install); ``1`` requires g++ (and builds CUDA when nvcc is present) and fails loudly.
- ``ACCO_DS_BUILD_CUDA``: ``0`` skips the CUDA module, ``1`` requires it (fails without nvcc).
- ``ACCO_DS_CUDA_ARCHS``: semicolon list of SM versions, default ``80;90``.
- ``CXX``, ``NVCC`` (or ``CUDA_HOME``/bin/nvcc): the compilers.

Works for ``pip install .``, ``pip install -e .`` and ``python setup.py build_ext --inplace``. A module that is
skipped (no compiler, no nvcc, ``ACCO_DS_BUILD_CUDA=0``) or whose build failed in auto mode is marked optional, so
setuptools does not try to copy a file that was never built; a stale copy of it in the build folder is removed so
that it cannot be installed in its place (a module already in the source tree from an earlier in-place build is
left there: ``acco_ds.ops._build`` checks it at load).

The CUDA module links cudart statically: it needs a driver that supports the CUDA major version of the nvcc that
built it (nvcc 13 needs driver >= 580). The build warns when nvcc's major version differs from torch's CUDA major
version (``torch.version.cuda``), and ``acco_ds.ops._build`` refuses a module whose runtime the driver cannot run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"  # the include root: sources include "common/bf16.h", "adamw/adamw_math.h", ...

MODULES = {
    # module: (toolchain, [(source under csrc/, extra compiler flags), ...])
    "acco_ds._adamw_cpu": (
        "cpu",
        [("adamw/bindings.cpp", ["-DACCO_BIND_CPU"]), ("adamw/adamw_cpu.cpp", []),
         ("adamw/adamw_difference_cpu.cpp", []), ("adamw/adamw_quantized_sum_cpu.cpp", []),
         ("adamw/cuda_body_harness.cpp", [])],
    ),
    "acco_ds._accumulate_cpu": ("cpu", [("accumulate/bindings.cpp", []), ("accumulate/accumulate_cpu.cpp", [])]),
    "acco_ds._quantize_cpu": (
        "cpu",
        [("quantize/bindings.cpp", []), ("quantize/quantize_cpu.cpp", []), ("quantize/fold_quantize_cpu.cpp", [])],
    ),
    "acco_ds._adamw_cuda": ("cuda", [("adamw/adamw_cuda.cu", []), ("adamw/bindings.cpp", ["-DACCO_BIND_CUDA"])]),
}  # fmt: skip
# No -march=native (the modules must run on any x86-64: csrc/common/cpu.h picks AVX-512/AVX2 at load), no
# -ffast-math (IEEE results, close to torch), no FMA contraction (the same fp32 operations on every ISA).
CXX_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-fno-math-errno"]
CXX_FLAGS += ["-Wall", "-Wextra"]
# --fmad=false: the GPU does the fp32 operations of adamw_math.h one by one, like the CPU build, so a GPU
# result is bit-identical to the CPU extension's and to the CPU harness's (tests/gpu/test_kernels_gpu.py checks it).
NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "--fmad=false",
    "-Xcompiler",
    "-fPIC,-fvisibility=hidden,-ffp-contract=off",
]


def _log(msg: str) -> None:
    print(f"acco_ds setup: {msg}", file=sys.stderr, flush=True)


def _mode(var: str) -> str:
    value = os.environ.get(var, "auto").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise SystemExit(f"acco_ds setup: {var} must be 0, 1 or auto, got {value!r}.")
    return value


def _find_nvcc() -> str | None:
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _cuda_major(version: str | None) -> int | None:
    m = re.match(r"\s*(\d+)\.", version or "")
    return int(m.group(1)) if m else None


def nvcc_version(nvcc: str) -> str | None:
    """nvcc's CUDA version ("13.0"), from ``nvcc --version`` ("... release 13.0, V13.0.88"); None if unreadable."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def cuda_major_mismatch(nvcc_cuda: str | None, torch_cuda: str | None) -> str:
    """The warning for a CUDA module built by ``nvcc_cuda`` next to a torch built for ``torch_cuda`` ("" if none:
    same major, or either unknown, e.g. a CPU-only torch whose ``torch.version.cuda`` is None)."""
    a, b = _cuda_major(nvcc_cuda), _cuda_major(torch_cuda)
    if a is None or b is None or a == b:
        return ""
    return (
        f"WARNING: nvcc is CUDA {nvcc_cuda} but torch was built for CUDA {torch_cuda}. The module links the CUDA "
        f"{a} runtime statically and needs a driver for CUDA {a} (CUDA 13: driver >= 580), which torch's CUDA {b} "
        f"does not; where the driver is older acco_ds refuses the module and uses its torch fallback. Build with a "
        f"CUDA {b} nvcc (NVCC=... or CUDA_HOME=...) to match torch."
    )


def _warn_cuda_major_mismatch(nvcc: str) -> None:
    try:
        import torch

        torch_cuda = torch.version.cuda
    except Exception:  # noqa: BLE001 - no torch in an isolated build environment: nothing to compare with
        return
    msg = cuda_major_mismatch(nvcc_version(nvcc), torch_cuda)
    if msg:
        _log(msg)


def _includes() -> list[str]:
    import pybind11

    return [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}"]


def _headers() -> list[Path]:
    """Every header under csrc/: each compile step depends on all of them (a few, small)."""
    return sorted(CSRC.rglob("*.h"))


def _object(build_dir: Path, src: str) -> Path:
    """The object file of csrc/``src`` ("adamw/bindings.cpp" -> adamw_bindings.o)."""
    return build_dir / (Path(src).with_suffix("").as_posix().replace("/", "_") + ".o")


class NinjaBuild:
    """A tiny ninja file writer: compile rules per source, one link; falls back to running commands in order."""

    def __init__(self, build_dir: Path):
        self.build_dir = build_dir
        self.steps: list[tuple[str, list[str], list[str]]] = []  # (output, inputs, command)

    def add(self, output: Path, inputs: list[Path], command: list[str]) -> Path:
        self.steps.append((str(output), [str(i) for i in inputs], command))
        return output

    def run(self) -> None:
        self.build_dir.mkdir(parents=True, exist_ok=True)
        ninja = shutil.which("ninja")
        if ninja is None:
            for _, _, cmd in self.steps:
                _log(shlex.join(cmd))
                subprocess.run(cmd, check=True)
            return
        lines = ["ninja_required_version = 1.3", ""]
        for i, (out, ins, cmd) in enumerate(self.steps):
            esc = lambda s: s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")  # noqa: E731
            lines += [
                f"rule r{i}",
                f"  command = {shlex.join(cmd).replace('$', '$$')}",
                f"  description = {out}",
            ]
            lines += [f"build {esc(out)}: r{i} {' '.join(esc(x) for x in ins)}", ""]
        (self.build_dir / "build.ninja").write_text("\n".join(lines))
        subprocess.run([ninja, "-C", str(self.build_dir)], check=True)


class AccoBuildExt(build_ext):
    """Builds the csrc modules with ninja (not distutils' compiler), honouring ACCO_DS_BUILD_EXT."""

    def build_extensions(self) -> None:
        mode = _mode("ACCO_DS_BUILD_EXT")
        if mode == "0":
            _log("ACCO_DS_BUILD_EXT=0: pure-Python install, no compiled kernels.")
            return
        # The modules build side by side (each its own ninja; nvcc's long compile of the CUDA module overlaps
        # the g++ ones); a forced mode's failure is raised once every build has ended.
        with ThreadPoolExecutor(max_workers=max(1, len(self.extensions))) as pool:
            outcomes = list(pool.map(self._build_one, self.extensions))
        for ext, (built, error) in zip(self.extensions, outcomes):
            if error is not None:
                if mode == "1" or (ext.name.endswith("cuda") and _mode("ACCO_DS_BUILD_CUDA") == "1"):
                    raise error
                _log(f"building {ext.name} failed ({type(error).__name__}: {error}); installing without it.")
            if not built:
                self._drop_stale_output(ext)

    def _build_one(self, ext: Extension) -> tuple:
        """(built, the exception that stopped the build or None)."""
        try:
            return self.build_extension(ext), None
        except Exception as e:  # noqa: BLE001 - handed back to build_extensions, which reports or re-raises it
            return False, e

    def build_extension(self, ext: Extension) -> bool:
        """Build ``ext``; False when it was skipped (its module is then not installed)."""
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / ext.name
        toolchain, sources = MODULES[ext.name]
        if toolchain == "cpu":
            return self._build_cpu(target, build_dir, sources)
        return self._build_cuda(target, build_dir, sources)

    def _drop_stale_output(self, ext: Extension) -> None:
        """A module not built in this run must not be installed from an older build left in the build folder;
        the extension is optional, so setuptools then copies nothing for it (instead of failing)."""
        stale = Path(self.get_ext_fullpath(ext.name))
        if stale.exists():
            stale.unlink()
            _log(f"removed {stale} (an earlier build; {ext.name} was not built now)")
        in_tree = ROOT / "acco_ds" / stale.name
        if in_tree.exists():
            _log(f"{ext.name} was not built; {in_tree} from an earlier in-place build stays in the source tree "
                 "(acco_ds checks it when it loads; delete it to use the torch fallback there).")  # fmt: skip

    def _cxx(self) -> str:
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if cxx is None or shutil.which(cxx) is None:
            raise RuntimeError(f"no C++ compiler found (CXX={os.environ.get('CXX')!r}, no g++/c++ on PATH)")
        return cxx

    def _build_cpu(self, target: Path, build_dir: Path, sources: list) -> bool:
        cxx = self._cxx()
        nb = NinjaBuild(build_dir)
        flags = CXX_FLAGS + ["-fopenmp"] + _includes()
        headers = _headers()
        objs = [
            nb.add(_object(build_dir, src), [CSRC / src, *headers],
                   [cxx, *flags, *extra, "-c", str(CSRC / src), "-o", str(_object(build_dir, src))])
            for src, extra in sources
        ]  # fmt: skip
        target.parent.mkdir(parents=True, exist_ok=True)
        nb.add(target, objs, [cxx, "-shared", "-fopenmp", *map(str, objs), "-o", str(target)])
        nb.run()
        _log(f"built {target}")
        return True

    def _build_cuda(self, target: Path, build_dir: Path, sources: list) -> bool:
        cuda_mode = _mode("ACCO_DS_BUILD_CUDA")
        if cuda_mode == "0":
            _log("ACCO_DS_BUILD_CUDA=0: skipping the CUDA module.")
            return False
        nvcc = _find_nvcc()
        if nvcc is None:
            if cuda_mode == "1":
                raise RuntimeError("ACCO_DS_BUILD_CUDA=1 but nvcc was not found (set NVCC or CUDA_HOME)")
            _log("nvcc not found: skipping the CUDA module (CPU kernels and the torch fallback still work).")
            return False
        _warn_cuda_major_mismatch(nvcc)
        cxx = self._cxx()
        archs = [a.strip() for a in os.environ.get("ACCO_DS_CUDA_ARCHS", "80;90").split(";") if a.strip()]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX for newer GPUs
        headers = _headers()
        nb = NinjaBuild(build_dir)
        objs = []
        for src, extra in sources:
            obj = _object(build_dir, src)
            if src.endswith(".cu"):
                cmd = [nvcc, *NVCC_FLAGS, *gencode, f"-ccbin={cxx}", f"-I{CSRC}", *extra, "-c", str(CSRC / src),
                       "-o", str(obj)]  # fmt: skip
            else:
                cmd = [cxx, *CXX_FLAGS, *_includes(), *extra, "-c", str(CSRC / src), "-o", str(obj)]
            objs.append(nb.add(obj, [CSRC / src, *headers], cmd))
        target.parent.mkdir(parents=True, exist_ok=True)
        nb.add(target, objs,
               [nvcc, "-shared", "--cudart=static", *gencode, f"-ccbin={cxx}", *map(str, objs),
                "-o", str(target)])  # fmt: skip
        nb.run()
        _log(f"built {target}")
        return True


def _extensions() -> list[Extension]:
    if _mode("ACCO_DS_BUILD_EXT") == "0":
        _log(
            "ACCO_DS_BUILD_EXT=0: pure-Python install, no compiled kernels (acco_ds uses its torch fallback)."
        )
        return []
    # Sources are compiled by AccoBuildExt, not by distutils; listing them (and every header) keeps sdists
    # complete. optional: a module skipped or failed in auto mode is not copied (setuptools would fail on the
    # missing file); the forced modes raise in AccoBuildExt before that.
    headers = [str(p.relative_to(ROOT)) for p in _headers()]
    return [
        Extension(
            name, sources=[str((CSRC / src).relative_to(ROOT)) for src, _ in srcs] + headers, optional=True
        )
        for name, (_, srcs) in MODULES.items()
    ]


if __name__ == "__main__":  # pip's build backend and `python setup.py ...` run this file as __main__
    setup(ext_modules=_extensions(), cmdclass={"build_ext": AccoBuildExt})
